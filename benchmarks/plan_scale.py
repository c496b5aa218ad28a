"""Scale by simulation: the split plan of 1e5 shards over 4096 ranks x 16 workers, reading no data (issue 7).

    python -m benchmarks plan_scale [--quick]                     # in the suite (one Markdown table)
    python -m benchmarks.plan_scale --shards 100000 --ranks 4096 --workers 16 [--sigma 0.5]

Shard sizes are what an object-store listing gives: bytes per shard, passed to `mixer.plan.shards.plan` as
`sizes`. Two size models:

* `lognormal`: sizes lognormal around 512 MB (sigma 0.5 by default: the largest of 1e5 shards is ~8x
  the median), e.g. shards cut by document boundaries from sources of different kinds;
* `writer`: shards as `webdataset.ShardWriter(maxsize=512 MB)` writes them: 90-100% of maxsize, except
  the last shard of each of 100 writers, which is anywhere from empty to full.

For each scenario: the time one reader takes to compute its plan (`plan(...)` for one (rank, worker),
median and max over a few readers spread over the world; every reader computes the whole assignment
and keeps its part), and the load imbalance max/mean of bytes per reader, from the full assignment
(every shard has exactly one owner; the sampled readers' plans are checked against it). Beside the
imbalance: a lower bound that no whole-shard assignment can beat, max(mean, largest shard, two of
the `readers + 1` largest shards on one reader, the ceil(shards / readers) smallest shards on one
reader) / mean: when the plan sits on the bound, the shards, not the split, limit the balance.

With a shard index (`kind="index"`, issue 15): the plan splits shards by sample ranges balanced by
tokens (`mixer.plan.shards.range_bounds`). The index is synthetic and exact: shard i holds a lognormal
number of samples (median `INDEX_SAMPLES`, sigma 0.5, so shard sizes are lognormal too) whose token
lengths are a run of one pool of lognormal lengths (median 400 tokens, sigma 1.0) starting at a
random place; per-shard totals come from the pool's cumulative sum, so no sample is stored twice.
The imbalance is max/mean tokens per reader over all readers' ranges (the ranges are checked to
tile the epoch's samples in order, so every sample, and byte, is read exactly once: no I/O
amplification, where without an index fewer shards than readers means every sharing reader reads
the whole shard).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import common

NAME = "plan_scale"
MEDIAN_BYTES = 512_000_000


@dataclass(frozen=True)
class Scenario:
    label: str
    shards: int
    ranks: int
    workers: int
    sizes: str  # "lognormal", "writer", "unknown" (round-robin by count, sizes not passed) or "index"
    sigma: float = 0.5
    target: bool = False  # the target scenario: judged PASS/MISS

    @property
    def readers(self) -> int:
        return self.ranks * self.workers


def shard_sizes(kind: str, n: int, *, sigma: float = 0.5, seed: int = 0) -> list[int]:
    rng = np.random.default_rng([seed, n])
    if kind in ("lognormal", "unknown"):
        sizes = rng.lognormal(math.log(MEDIAN_BYTES), sigma, n)
    elif kind == "writer":
        sizes = rng.uniform(0.9, 1.0, n) * MEDIAN_BYTES
        last = np.linspace(0, n, 101, dtype=np.int64)[1:] - 1  # 100 writers, each ends with a partial shard
        sizes[last] = rng.uniform(0.0, 1.0, len(last)) * MEDIAN_BYTES
    else:
        raise ValueError(f"unknown size model {kind!r}")
    return np.rint(sizes).astype(np.int64).tolist()


def lower_bound(sizes: np.ndarray, readers: int) -> float:
    s = np.sort(sizes)[::-1]
    bound = max(float(s.sum()) / readers, float(s[0]))
    if len(s) > readers:
        bound = max(bound, float(s[readers - 1] + s[readers]))
    # some reader holds at least ceil(n / readers) shards, at least the smallest ones
    k = -(-len(s) // readers)
    return max(bound, float(s[len(s) - k :].sum()))


INDEX_SAMPLES = 1000  # median samples per shard of the synthetic index
POOL = 1 << 22  # lognormal lengths the synthetic shards take their runs from


class SyntheticIndex:
    """A shard index as `mixer.plan.shards.plan` reads it (the `Ranges` protocol), made up exactly."""

    def __init__(self, n: int, *, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, n, 1])
        self.pool = np.rint(rng.lognormal(math.log(400), 1.0, POOL)).clip(1, 32768).astype(np.int64)
        cum = np.zeros(POOL + 1, dtype=np.int64)
        np.cumsum(self.pool, out=cum[1:])
        self.counts = np.rint(rng.lognormal(math.log(INDEX_SAMPLES), 0.5, n)).clip(1, POOL).astype(np.int64)
        self.first = (rng.random(n) * (POOL - self.counts + 1)).astype(np.int64)
        self.tokens = cum[self.first + self.counts] - cum[self.first]
        self.weights = self.tokens  # every length >= 1

    def lengths(self, shard: int) -> np.ndarray:
        return self.pool[self.first[shard] : self.first[shard] + self.counts[shard]]

    def offsets(self, shard: int) -> np.ndarray:  # 4 bytes per token plus a 1 KB header per sample, in blocks
        blocks = (self.lengths(shard) * 4 + 1024 + 511) // 512
        return np.concatenate([[0], np.cumsum(blocks)]) * 512

    def whole(self, shard: int) -> bool:
        return True


def _timed_plans(sc: Scenario, timed_readers: int, make_plan: Any) -> tuple[list[int], list[float], dict[int, Any]]:
    """The plans of ``timed_readers`` readers spread over the world (first, last and some in
    between), each timed: (the readers, seconds each, reader -> its plan)."""
    from mixer.plan.world import World

    readers = sc.readers
    picks = sorted({round(i * (readers - 1) / max(timed_readers - 1, 1)) for i in range(timed_readers)})
    times, plans = [], {}
    for reader in picks:
        world = World(
            rank=reader // sc.workers, world_size=sc.ranks, worker=reader % sc.workers, num_workers=sc.workers
        )
        t0 = time.perf_counter()
        plans[reader] = make_plan(world)
        times.append(time.perf_counter() - t0)
    return picks, times, plans


def simulate_index(sc: Scenario, *, timed_readers: int = 5, seed: int = 0) -> dict:
    from mixer.plan.shards import plan, range_bounds, shard_order

    index = SyntheticIndex(sc.shards, seed=seed)
    readers = sc.readers
    picks, times, plans = _timed_plans(
        sc, timed_readers, lambda world: plan(sc.shards, world, seed=seed, source="web", epoch=0, index=index)
    )
    # every reader's start at once, for the loads: reader r reads from bounds[r] up to bounds[r + 1]
    order = np.asarray(shard_order(sc.shards, seed=seed, source="web", epoch=0), dtype=np.int64)
    bounds = range_bounds(order, index, readers, list(range(readers + 1)))
    place = np.array([p for p, _ in bounds], dtype=np.int64)
    at = np.array([i for _, i in bounds], dtype=np.int64)
    if (np.diff(place) < 0).any() or ((np.diff(place) == 0) & (np.diff(at) < 0)).any():
        raise AssertionError(f"{sc.label}: the readers' ranges are not in order (samples would be read twice or never)")
    cum = np.zeros(sc.shards + 1, dtype=np.int64)
    np.cumsum(index.tokens[order], out=cum[1:])
    inside = np.array(
        [int(index.lengths(int(order[p]))[:i].sum()) if p < sc.shards else 0 for p, i in bounds], dtype=np.int64
    )
    before = cum[place] + inside  # tokens before each reader's first sample, in the epoch's order
    loads = np.diff(before)
    if int(before[0]) != 0 or int(before[-1]) != int(cum[-1]):
        raise AssertionError(f"{sc.label}: tokens lost or duplicated")
    for reader, slices in plans.items():  # the timed plans are the readers' runs
        got = sum(int(index.lengths(s.shard)[s.start : s.stop].sum()) for s in slices)
        if got != int(loads[reader]):
            raise AssertionError(
                f"{sc.label}: reader {reader}'s plan ({got} tokens) differs from the full split ({int(loads[reader])})"
            )
    # ranges per reader and how many readers share a shard (their reads are disjoint byte ranges)
    spans = np.diff(place) + (at[1:] > 0)
    mean = float(loads.mean())
    return {
        "label": sc.label,
        "shards": sc.shards,
        "ranks": sc.ranks,
        "workers": sc.workers,
        "readers": readers,
        "sizes": sc.sizes,
        "sigma": 0.5,
        "target": sc.target,
        "shards_per_reader": sc.shards / readers,
        "total_tokens": int(cum[-1]),
        "largest_over_median": float(index.counts.max() / np.median(index.counts)),
        "plan_s_median": statistics.median(times),
        "plan_s_max": max(times),
        "plan_s": times,
        "timed_readers": picks,
        "imbalance": float(loads.max()) / mean,
        "lower_bound": 1.0,
        "min_over_mean": float(loads.min()) / mean,
        "shards_per_reader_min_max": [int(spans.min()), int(spans.max())],
    }


def simulate(sc: Scenario, *, timed_readers: int = 5, seed: int = 0) -> dict:
    from mixer.plan.shards import _owners_by_size, plan, shard_order

    if sc.sizes == "index":
        return simulate_index(sc, timed_readers=timed_readers, seed=seed)

    sizes = shard_sizes(sc.sizes, sc.shards, sigma=sc.sigma, seed=seed)
    known = sc.sizes != "unknown"
    size_arr = np.asarray(sizes, dtype=np.int64)
    readers = sc.readers
    picks, times, whole = _timed_plans(
        sc,
        timed_readers,
        lambda world: plan(sc.shards, world, seed=seed, source="web", epoch=0, sizes=sizes if known else None),
    )
    plans = {reader: [s.shard for s in slices] for reader, slices in whole.items()}
    # the whole assignment once, for the imbalance; the timed plans must agree with it
    order = np.asarray(shard_order(sc.shards, seed=seed, source="web", epoch=0), dtype=np.int64)
    if sc.shards < readers:
        raise ValueError(f"{sc.label}: fewer shards than readers is the split-by-samples case; not simulated here")
    if known:
        owner = _owners_by_size(order, sizes, readers)
    else:
        owner = np.empty(sc.shards, dtype=np.int64)
        owner[order] = np.arange(sc.shards) % readers
    for reader, shards in plans.items():
        mine = order[owner[order] == reader].tolist()
        if shards != mine:
            raise AssertionError(f"{sc.label}: reader {reader}'s plan differs from the full assignment")
    loads = np.bincount(owner, weights=size_arr, minlength=readers)
    counts = np.bincount(owner, minlength=readers)
    if int(counts.sum()) != sc.shards or float(loads.sum()) != float(size_arr.sum()):
        raise AssertionError(f"{sc.label}: shards lost or duplicated")
    mean = float(loads.mean())
    return {
        "label": sc.label,
        "shards": sc.shards,
        "ranks": sc.ranks,
        "workers": sc.workers,
        "readers": readers,
        "sizes": sc.sizes,
        "sigma": sc.sigma if sc.sizes in ("lognormal", "unknown") else None,
        "target": sc.target,
        "shards_per_reader": sc.shards / readers,
        "total_bytes": int(size_arr.sum()),
        "largest_over_median": float(size_arr.max() / np.median(size_arr)),
        "plan_s_median": statistics.median(times),
        "plan_s_max": max(times),
        "plan_s": times,
        "timed_readers": picks,
        "imbalance": float(loads.max()) / mean,
        "lower_bound": lower_bound(size_arr, readers) / mean,
        "min_over_mean": float(loads.min()) / mean,
        "shards_per_reader_min_max": [int(counts.min()), int(counts.max())],
    }


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [
            Scenario("lognormal, 1e4 shards, 256x16 readers", 10_000, 256, 16, "lognormal", target=True),
            Scenario("lognormal, 1e4 shards, 16x16 readers", 10_000, 16, 16, "lognormal"),
            Scenario("writer sizes, 1e4 shards, 256x16 readers", 10_000, 256, 16, "writer"),
            Scenario("index, 6144 shards, 256x16 readers", 6_144, 256, 16, "index", target=True),
        ]
    return [
        Scenario("index, 1e5 shards, 4096x16 readers", 100_000, 4096, 16, "index", target=True),
        Scenario("index, 1e6 shards, 4096x16 readers", 1_000_000, 4096, 16, "index", target=True),
        Scenario("index, 1e3 shards, 4096x16 readers", 1_000, 4096, 16, "index"),
        Scenario("lognormal, 1e5 shards, 4096x16 readers", 100_000, 4096, 16, "lognormal", target=True),
        Scenario("writer sizes, 1e5 shards, 4096x16 readers", 100_000, 4096, 16, "writer"),
        Scenario("unknown sizes (by count), 1e5 shards, 4096x16", 100_000, 4096, 16, "unknown"),
        Scenario("lognormal, 1e5 shards, 256x16 readers", 100_000, 256, 16, "lognormal"),
        Scenario("writer sizes, 1e5 shards, 256x16 readers", 100_000, 256, 16, "writer"),
        Scenario("lognormal, 1e6 shards, 4096x16 readers", 1_000_000, 4096, 16, "lognormal"),
    ]


def to_row(r: dict) -> dict:
    if r["sizes"] == "index":
        note = (
            f"{r['readers']:,} readers, {r['shards_per_reader']:.2f} shards/reader (shards touched per reader "
            f"{r['shards_per_reader_min_max'][0]}-{r['shards_per_reader_min_max'][1]}); plan "
            f"{1e3 * r['plan_s_median']:.0f} ms/reader (max {1e3 * r['plan_s_max']:.0f}); imbalance "
            f"{r['imbalance']:.4f} max/mean tokens (min/mean {r['min_over_mean']:.4f}); each byte read once (disjoint "
            "byte ranges)"
        )
        return {
            "bench": NAME,
            "method": r["label"],
            "label": r["label"],
            "kind": "plan",
            "status": "ok",
            "note": note,
            **r,
        }
    note = (
        f"{r['readers']:,} readers, {r['shards_per_reader']:.1f} shards/reader "
        f"({r['shards_per_reader_min_max'][0]}-{r['shards_per_reader_min_max'][1]}); plan "
        f"{1e3 * r['plan_s_median']:.0f} ms/reader (max {1e3 * r['plan_s_max']:.0f}); imbalance {r['imbalance']:.3f} "
        f"(whole-shard bound {r['lower_bound']:.3f}, min/mean {r['min_over_mean']:.3f}); largest shard "
        f"{r['largest_over_median']:.1f}x median"
    )
    return {"bench": NAME, "method": r["label"], "label": r["label"], "kind": "plan", "status": "ok", "note": note, **r}


def checks_for(results: list[dict]) -> list[dict]:
    checks = []
    for r in results:
        judged = 1.0 if r["target"] else None
        checks.append(
            common.value_check(NAME, f"{r['label']}: plan time per reader, max s", r["plan_s_max"], judged, "<=")
        )
        if r["sizes"] == "index":
            checks.append(
                common.value_check(
                    NAME,
                    f"{r['label']}: imbalance max/mean tokens",
                    r["imbalance"],
                    1.05 if r["target"] else None,
                    "<=",
                )
            )
        elif r["sizes"] != "unknown":
            checks.append(
                common.value_check(
                    NAME, f"{r['label']}: imbalance max/mean bytes", r["imbalance"], 1.05 if r["target"] else None, "<="
                )
            )
            checks.append(
                common.value_check(
                    NAME, f"{r['label']}: whole-shard lower bound of the imbalance", r["lower_bound"], None
                )
            )
        else:
            checks.append(
                common.value_check(NAME, f"{r['label']}: imbalance max/mean bytes", r["imbalance"], None, "<=")
            )
    return checks


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    results = []
    for sc in scenarios(opts.quick):
        t0 = time.perf_counter()
        r = simulate(sc)
        log(
            f"{sc.label}: plan {1e3 * r['plan_s_median']:.0f} ms/reader, imbalance {r['imbalance']:.3f} "
            f"(bound {r['lower_bound']:.3f}) [{time.perf_counter() - t0:.1f} s]"
        )
        results.append(r)
    config = {"profile": opts.profile, "median_bytes": MEDIAN_BYTES, "scenarios": [r["label"] for r in results]}
    return common.BenchResult(NAME, [to_row(r) for r in results], checks_for(results), config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_scale", description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=float, default=1e5)
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--sizes", choices=("lognormal", "writer", "unknown", "index"), default="lognormal")
    p.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the shard sizes")
    p.add_argument("--timed-readers", type=int, default=5)
    opts = p.parse_args(argv)
    sc = Scenario(
        f"{opts.sizes}, {opts.shards:g} shards, {opts.ranks}x{opts.workers}",
        int(opts.shards),
        opts.ranks,
        opts.workers,
        opts.sizes,
        opts.sigma,
        target=True,
    )
    r = simulate(sc, timed_readers=opts.timed_readers)
    res = common.BenchResult(NAME, [to_row(r)], checks_for([r]), {})
    print(common.checks_table([res]))
    print()
    print(to_row(r)["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
