"""What one DataLoader worker holds in memory under the reader's buffer budget (``Mixture(buffer_budget=...)``),
as sources and sample lengths grow: USS per worker, padding efficiency, batch fill, share error.

For 3 and 100 sources (equal weights: every source is read, the most a budget is spread over) of
lognormal lengths (sigma 0.6) at median 300 and 4,000 tokens (int32 ``tokens.npy``), a `Mixture` with
``TokenBudget(65536)`` streamed through `make_loader(num_workers=1)` for ``BATCHES`` batches, each
configuration in a fresh process, for each ``mix`` and for two budgets: the default and the old
default, ``"65536 samples"`` (a count of samples, which grows with sample length). Measured:

* the worker's USS (unique set size: ``Private_Clean + Private_Dirty`` of ``/proc/<pid>/smaps_rollup``,
  what the worker alone holds; pages it shares with the main process after the fork are not in it),
  the most seen over samples taken every 10 batches, and its ratio to the 3-source, 300-token figure at
  the default budget measured in the same run;
* padding efficiency (real tokens / ``B * L``), batch fill (real tokens per batch / ``max_tokens``),
  share error (total variation between the realized token shares and the targets).

A source's shards are one of ``POOL`` sets written once under ``<bench-dir>/buffer_memory`` (sources
``i`` and ``i + POOL`` read the same files: memory is per source, not per file, and it keeps the
disk small).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import common

NAME = "buffer_memory"
MEDIANS = (300, 4000)
SOURCE_COUNTS = (3, 100)
SIGMA = 0.6
POOL = 4  # distinct source folders per median
SHARDS = 4
SAMPLES = 600  # per shard: 2,400 per source, more than any buffer holds
MAX_TOKENS = 65536
BATCHES = {"full": 400, "quick": 150}
OLD_DEFAULT = "65536 samples"
DEFAULT = "default"
MIXES = {"full": ("batch", "sample"), "quick": ("sample",)}


def ensure_pool(bench_dir: Path, median: int, log: Callable[[str], None]) -> Path:
    """``POOL`` source folders of ``SHARDS`` shards at ``median`` tokens, written once."""
    root = bench_dir / NAME / f"median{median}"
    done = root / "done.json"
    spec = {"pool": POOL, "shards": SHARDS, "samples": SAMPLES, "sigma": SIGMA, "median": median}
    if done.exists() and json.loads(done.read_text()) == spec:
        return root
    log(f"writing {POOL} sources x {SHARDS} shards x {SAMPLES} samples at median {median} tokens")
    for p in range(POOL):
        rng = np.random.default_rng(7000 + 31 * median + p)
        folder = root / f"p{p}"
        folder.mkdir(parents=True, exist_ok=True)
        for shard in range(SHARDS):
            lengths = np.clip(rng.lognormal(math.log(median), SIGMA, SAMPLES), 8, MAX_TOKENS // 2).astype(int)
            with tarfile.open(folder / f"{shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for j, length in enumerate(lengths):
                    buf = io.BytesIO()
                    np.save(buf, rng.integers(1, common.VOCAB, int(length)).astype(np.int32), allow_pickle=False)
                    info = tarfile.TarInfo(f"p{p}-{shard:06d}-{j:06d}.tokens.npy")
                    info.size, info.mtime = buf.tell(), common.MTIME
                    buf.seek(0)
                    tar.addfile(info, buf)
    done.write_text(json.dumps(spec))
    return root


def uss_mb(pid: int) -> float | None:
    """``Private_Clean + Private_Dirty`` of a process, in MB (None once it is gone)."""
    with contextlib.suppress(OSError):
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        return sum(int(kb) for kb in re.findall(r"^Private_\w+:\s+(\d+) kB", text, re.M)) / 1024
    return None


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def measure_one(root: str, sources: int, mix: str, budget: str, batches: int) -> dict[str, Any]:
    """One configuration, in this process (run by :func:`measure` in a fresh one)."""
    import mixer

    urls = [f"{root}/p{i % POOL}/{{000000..{SHARDS - 1:06d}}}.tar" for i in range(sources)]
    srcs = [mixer.Source(f"s{i:03d}", u) for i, u in enumerate(urls)]
    options: dict[str, Any] = {} if budget == DEFAULT else {"buffer_budget": budget}
    m = mixer.Mixture(srcs, batching=mixer.TokenBudget(MAX_TOKENS), mix=mix, seed=0, **options)  # type: ignore[arg-type]
    loader = mixer.make_loader(m, num_workers=1)
    real = padded = 0
    per_source = np.zeros(sources)
    uss = 0.0
    k = 0
    for k, batch in enumerate(loader, 1):
        lengths = batch.lengths.numpy()
        real += int(lengths.sum())
        padded += int(batch.tokens.numel())
        np.add.at(per_source, batch.source.numpy(), lengths)
        if k % 10 == 0 or k == batches:
            uss = max([uss, *(u for u in map(uss_mb, _children()) if u is not None)])
        if k >= batches:
            break
    del loader
    target = np.full(sources, 1.0 / sources)
    return {
        "sources": sources,
        "mix": mix,
        "budget": budget if budget != DEFAULT else str(m.buffer_budget),
        "default": budget == DEFAULT,
        "batches": k,
        "worker_uss_mb": uss,
        "padding_efficiency": real / padded,
        "batch_fill": real / (k * MAX_TOKENS),
        "share_tv": 0.5 * float(np.abs(per_source / per_source.sum() - target).sum()),
    }


def measure(root: Path, sources: int, mix: str, budget: str, batches: int) -> dict[str, Any]:
    code = (
        "import json, sys; from benchmarks.buffer_memory import measure_one; "
        "print(json.dumps(measure_one(*json.loads(sys.argv[1]))))"
    )
    args = json.dumps([str(root), sources, mix, budget, batches])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code, args], check=True, capture_output=True, text=True, env=env, cwd=common.REPO
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "median",
        "sources",
        "mix",
        "buffer_budget",
        "worker USS",
        "vs reference",
        "padding eff.",
        "batch fill",
        "share error (TV)",
    ]
    body = [
        [
            str(r["median"]),
            str(r["sources"]),
            r["mix"],
            r["budget"] + (" (default)" if r["default"] else ""),
            f"{r['worker_uss_mb']:.0f} MB",
            f"{r['uss_ratio']:.2f}x",
            f"{r['padding_efficiency']:.3f}",
            f"{r['batch_fill']:.2f}",
            f"{r['share_tv']:.3f}",
        ]
        for r in rows
    ]
    return common.markdown_table(header, body)


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    batches = getattr(opts, "batches", None) or BATCHES[opts.profile]
    rows = []
    for median in MEDIANS:
        root = ensure_pool(opts.bench_dir, median, log)
        for sources in SOURCE_COUNTS:
            for mix in MIXES[opts.profile]:
                for budget in (DEFAULT, OLD_DEFAULT):
                    r = {"median": median, **measure(root, sources, mix, budget, batches)}
                    log(f"{r}")
                    rows.append(r)
    for mix in MIXES[opts.profile]:
        ref = next(r for r in rows if r["mix"] == mix and r["default"] and r["median"] == 300 and r["sources"] == 3)
        for r in rows:
            if r["mix"] == mix:
                r["uss_ratio"] = r["worker_uss_mb"] / ref["worker_uss_mb"]
    text = table(rows)
    log("\n" + text)
    checks = []
    for r in rows:
        if not r["default"]:
            continue
        what = f"mix={r['mix']}, {r['sources']} sources, median {r['median']}"
        checks.append(common.value_check(NAME, f"worker USS vs reference, {what}", r["uss_ratio"], 1.5, "<="))
        checks.append(common.value_check(NAME, f"padding efficiency, {what}", r["padding_efficiency"], 0.96, ">="))
    result_rows = [
        {
            "bench": NAME,
            "method": f"{r['mix']}/{r['budget']}",
            "label": f"median={r['median']} sources={r['sources']} mix={r['mix']} budget={r['budget']}",
            "kind": "scale",
            "status": "ok",
            "note": "",
            **r,
        }
        for r in rows
    ]
    return common.BenchResult(NAME, result_rows, checks, {"profile": opts.profile, "batches": batches, "table": text})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.buffer_memory", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--bench-dir", type=Path, default=common.DEFAULT_BENCH_DIR)
    return common.standalone(NAME, p, run, argv, tables=("table",))


if __name__ == "__main__":
    sys.exit(main())
