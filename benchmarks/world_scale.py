"""A thousand ranks, simulated: the costs per rank that must not grow with the world, as curves over world sizes.

    python -m benchmarks world_scale [--quick]        # one Markdown table, and the checks
    python -m benchmarks.world_scale [--quick|--smoke]  # the sections' own tables (--smoke: in the test suite)

Sections (each a module with ``run(profile) -> list[dict]`` rows, ``profile`` a key of
:data:`SIZES` (every section module has a size for each);
those not present are left out):

* ``plan``: the CPU time one reader takes to plan its part of epoch 0 of every source
  (`mixer.plan.shards.plan`, shard sizes lognormal around 512 MB, as a listing gives them), at
  64 / 256 / 1,024 ranks x 16 workers and 100 / 1,000 sources (median 16,384 / 2,048 shards per
  source: at 16,384 readers many sources have fewer shards than readers and split them in-shard);
* ``state``: checkpoint bytes per rank (one loader state as JSON, 16 readers) at the same sizes,
  the states built as `benchmarks.world_scale_elastic` builds them (every reader holding the default
  `buffer_budget` of 65,536 buffered samples);
* ``elastic``: `benchmarks.world_scale_elastic`, an elastic resume's `load_state_dict` per new rank;
* ``startup``, ``index``: `benchmarks.world_scale_startup` and `benchmarks.world_scale_index` when present.

``--quick``: 10 / 100 sources, 4 / 8 / 16 ranks x 4 workers, smaller shard counts. ``--smoke``: the
smallest sizes that still exercise every section (10 / 30 sources, 4 / 8 ranks x 2 workers, one startup
count at 2 ranks, indexes of 1e4 and 1e5 samples read by 2 ranks at once): what the test suite runs,
end to end, in seconds.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import common

NAME = "world_scale"
SIZES = {
    # (sources, median shards per source), old worlds (ranks), workers per rank
    "full": {"sources": ((100, 16_384), (1_000, 2_048)), "worlds": (64, 256, 1024), "workers": 16},
    "quick": {"sources": ((10, 64), (100, 16)), "worlds": (4, 8, 16), "workers": 4},
    "smoke": {"sources": ((10, 16), (30, 8)), "worlds": (4, 8), "workers": 2},
}
OPTIONAL = ("world_scale_startup", "world_scale_index")


def shard_counts(sources: int, median: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng([seed, sources, median])
    counts = np.clip(np.rint(rng.lognormal(math.log(median), 0.7, sources)), median // 8, median * 4)
    return [int(c) for c in counts]


def plan_rows(profile: str) -> list[dict[str, Any]]:
    """``plan``: one reader's plans of epoch 0 of every source, CPU seconds (reader 0 and a middle one)."""
    from mixer.plan.shards import plan
    from mixer.plan.world import World

    size = SIZES[profile]
    rows = []
    for sources, median in size["sources"]:
        counts = shard_counts(sources, median)
        rng = np.random.default_rng([1, sources])
        sizes = [tuple(np.rint(rng.lognormal(math.log(5.12e8), 0.5, n)).astype(np.int64).tolist()) for n in counts]
        for ranks in size["worlds"]:
            readers = ranks * size["workers"]
            times = []
            for reader in (0, readers // 2 + 1):
                rank, worker = divmod(reader, size["workers"])
                world = World(rank=rank, world_size=ranks, worker=worker, num_workers=size["workers"])
                t0 = time.process_time()
                for i, (n, s) in enumerate(zip(counts, sizes)):
                    plan(n, world, seed=0, source=f"s{i:04d}", epoch=0, sizes=s)
                times.append(time.process_time() - t0)
            split = sum(n < readers for n in counts)
            rows.append(
                {
                    "section": "plan",
                    "sources": sources,
                    "shards": sum(counts),
                    "world": f"{ranks}x{size['workers']}",
                    "plan_cpu_s": statistics.mean(times),
                    "split_in_shard": split,
                }
            )
    return rows


def state_rows(profile: str) -> list[dict[str, Any]]:
    """``state``: one old rank's loader state, JSON bytes (ranks 0 and a middle one), per world size."""
    from . import world_scale_elastic as wse

    size = SIZES[profile]
    rows = []
    for sources, median in size["sources"]:
        mix = wse.build_mixture(wse.Scale(sources=sources, shards=median, workers=size["workers"], worlds=()))
        for ranks in size["worlds"]:
            old = wse.OldWorld(mix, ranks, size["workers"])
            t0 = time.process_time()
            texts = [old.text(r) for r in (0, ranks // 2)]
            per_rank = statistics.mean(map(len, texts))
            buffered = int((old.buffer + old.items).sum()) * size["workers"]
            rows.append(
                {
                    "section": "state",
                    "sources": sources,
                    "world": f"{ranks}x{size['workers']}",
                    "state_kb_per_rank": per_rank / 1e3,
                    "buffered_per_rank": buffered,
                    "bytes_per_buffered": per_rank / buffered,
                    "build_cpu_s": (time.process_time() - t0) / len(texts),
                }
            )
    return rows


def sections(profile: str, log: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    """Every section's rows (a missing optional module is noted and left out)."""
    from . import world_scale_elastic

    out: dict[str, list[dict[str, Any]]] = {}
    runs: tuple[tuple[str, Callable[[bool], list[dict[str, Any]]]], ...] = (
        ("plan", plan_rows),
        ("state", state_rows),
        ("elastic", lambda q: world_scale_elastic.run(q, log)),
    )
    for name, run in runs:
        t0 = time.perf_counter()
        out[name] = run(profile)
        log(f"{name}: {len(out[name])} rows in {time.perf_counter() - t0:.0f} s")
    for module in OPTIONAL:
        try:
            mod = importlib.import_module(f"benchmarks.{module}")
        except ImportError as exc:
            log(f"{module}: not present ({exc})")
            continue
        t0 = time.perf_counter()
        out[module.removeprefix("world_scale_")] = mod.run(profile)
        log(f"{module}: {len(out[module.removeprefix('world_scale_')])} rows in {time.perf_counter() - t0:.0f} s")
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def section_table(rows: list[dict[str, Any]]) -> str:
    """A section's rows as one Markdown table, its own columns (the elastic one's own layout)."""
    if rows and rows[0].get("section") == "elastic":
        from .world_scale_elastic import table

        return table(rows)
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "section"]
    return common.markdown_table(keys, [[_cell(r.get(k)) for k in keys] for r in rows])


def checks_for(found: dict[str, list[dict[str, Any]]], profile: str) -> list[dict[str, Any]]:
    """The targets at the simulated 1,024 x 16 old world of 100 sources: ``load_state_dict`` per new rank
    <= 1 CPU-s and <= 50 MB, bytes read <= 2x the rank's share (the worst of the new shapes)."""
    size = SIZES[profile]
    target = f"{size['worlds'][-1]}x{size['workers']}"
    sources = size["sources"][0][0]
    rows = [
        r
        for r in found.get("elastic", [])
        if r.get("old") == target and r.get("sources") == sources and r.get("load_s") is not None
    ]
    if not rows:
        return []
    name = f"elastic load_state_dict at {target} old, {sources} sources (worst new rank)"
    checks = [
        common.value_check(NAME, f"{name}: CPU s", max(r["load_cpu_s"] for r in rows), 1.0, "<="),
        common.value_check(NAME, f"{name}: wall s", max(r["load_s"] for r in rows), 1.0, "<="),
        common.value_check(NAME, f"{name}: peak MB", max(r["peak_mb"] for r in rows), 50.0, "<="),
        common.value_check(NAME, f"{name}: bytes read / own share", max(r["read_ratio"] for r in rows), 2.0, "<="),
        common.value_check(
            NAME,
            "bytes read / own share, worst of every new rank, a file per old rank",
            max(r["worst_files_ratio"] for r in rows),
            2.0,
            "<=",
        ),
        common.value_check(
            NAME,
            "bytes read / own share, worst of every new rank, old readers read one by one",
            max(r["worst_readers_ratio"] for r in rows),
            2.0,
            "<=",
        ),
    ]
    bound = [r for r in found["elastic"] if r.get("old") == target and r.get("shape") == "old path (lower bound)"]
    if bound:
        checks.append(
            common.value_check(NAME, f"old path lower bound at {target}: CPU s", bound[0]["load_cpu_s"], None)
        )
    return checks


_NAMES = ("sources", "world", "old", "new", "shape", "rank", "check")  # what names a row; the rest is figures


def _suite_row(section: str, r: dict[str, Any]) -> dict[str, Any]:
    """A section's row in the suite's table: what it is as the label, its figures as the note."""
    named = [f"{k}={_cell(r[k])}" for k in _NAMES if k in r and r[k] is not None]
    figures = [f"{k}={_cell(v)}" for k, v in r.items() if k not in _NAMES and k != "section"]
    return {"label": f"{section}: " + " ".join(named), "note": ", ".join(figures)}


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    found = sections(opts.profile, log)
    rows = [_suite_row(name, r) for name, section in found.items() for r in section]
    tables = {f"table_{name}": section_table(section) for name, section in found.items()}
    config = {"profile": opts.profile, "sections": list(found), "tables": list(tables), **tables}
    return common.BenchResult(NAME, rows, checks_for(found, opts.profile), config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.world_scale", description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="profile", const="quick", default="full")
    size.add_argument("--smoke", action="store_const", dest="profile", const="smoke", help="the test suite's sizes")
    p.add_argument("--bench-dir", type=common.Path, default=common.DEFAULT_BENCH_DIR)
    opts = p.parse_args(argv)
    res = run(opts, lambda m: print(f"[{NAME} {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True))
    common.write_json(res, opts.bench_dir / f"{NAME}{'' if opts.profile == 'full' else '.' + opts.profile}.json")
    for key in res.config["tables"]:
        print(f"### {key.removeprefix('table_')}\n")
        print(res.config[key])
        print()
    print(common.checks_table([res]))
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
