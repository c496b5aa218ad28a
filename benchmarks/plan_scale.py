"""Scale by simulation: the split plan of 1e5 shards over 4096 ranks x 16 workers, reading no data (issue 7).

    python -m benchmarks plan_scale [--quick]                     # in the suite (one Markdown table)
    python -m benchmarks.plan_scale --shards 100000 --ranks 4096 --workers 16 [--sigma 0.5]

Shard sizes are what an object-store listing gives: bytes per shard, passed to `mixer.shards.plan` as
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
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    sizes: str  # "lognormal", "writer" or "unknown" (round-robin by count, sizes not passed)
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


def simulate(sc: Scenario, *, timed_readers: int = 5, seed: int = 0) -> dict:
    from mixer.shards import _owners_by_size, plan, shard_order
    from mixer.world import World

    sizes = shard_sizes(sc.sizes, sc.shards, sigma=sc.sigma, seed=seed)
    known = sc.sizes != "unknown"
    size_arr = np.asarray(sizes, dtype=np.int64)
    readers = sc.readers
    # spread the timed readers over the world: first, last and some in between
    picks = sorted({round(i * (readers - 1) / max(timed_readers - 1, 1)) for i in range(timed_readers)})
    times, plans = [], {}
    for reader in picks:
        world = World(rank=reader // sc.workers, world_size=sc.ranks, worker=reader % sc.workers, num_workers=sc.workers)
        t0 = time.perf_counter()
        slices = plan(sc.shards, world, seed=seed, source="web", epoch=0, sizes=sizes if known else None)
        times.append(time.perf_counter() - t0)
        plans[reader] = [s.shard for s in slices]
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
        ]
    return [
        Scenario("lognormal, 1e5 shards, 4096x16 readers", 100_000, 4096, 16, "lognormal", target=True),
        Scenario("writer sizes, 1e5 shards, 4096x16 readers", 100_000, 4096, 16, "writer"),
        Scenario("unknown sizes (by count), 1e5 shards, 4096x16", 100_000, 4096, 16, "unknown"),
        Scenario("lognormal, 1e5 shards, 256x16 readers", 100_000, 256, 16, "lognormal"),
        Scenario("writer sizes, 1e5 shards, 256x16 readers", 100_000, 256, 16, "writer"),
        Scenario("lognormal, 1e6 shards, 4096x16 readers", 1_000_000, 4096, 16, "lognormal"),
    ]


def to_row(r: dict) -> dict:
    note = (
        f"{r['readers']:,} readers, {r['shards_per_reader']:.1f} shards/reader ({r['shards_per_reader_min_max'][0]}-"
        f"{r['shards_per_reader_min_max'][1]}); plan {1e3 * r['plan_s_median']:.0f} ms/reader (max {1e3 * r['plan_s_max']:.0f}); "
        f"imbalance {r['imbalance']:.3f} (whole-shard bound {r['lower_bound']:.3f}, min/mean {r['min_over_mean']:.3f}); "
        f"largest shard {r['largest_over_median']:.1f}x median"
    )
    return {"bench": NAME, "method": r["label"], "label": r["label"], "kind": "plan", "status": "ok", "note": note, **r}


def checks_for(results: list[dict]) -> list[dict]:
    checks = []
    for r in results:
        judged = 1.0 if r["target"] else None
        checks.append(common.value_check(NAME, f"{r['label']}: plan time per reader, max s", r["plan_s_max"], judged, "<="))
        if r["sizes"] != "unknown":
            checks.append(
                common.value_check(NAME, f"{r['label']}: imbalance max/mean bytes", r["imbalance"], 1.05 if r["target"] else None, "<=")
            )
            checks.append(common.value_check(NAME, f"{r['label']}: whole-shard lower bound of the imbalance", r["lower_bound"], None))
        else:
            checks.append(common.value_check(NAME, f"{r['label']}: imbalance max/mean bytes", r["imbalance"], None, "<="))
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
    p.add_argument("--sizes", choices=("lognormal", "writer", "unknown"), default="lognormal")
    p.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the shard sizes")
    p.add_argument("--timed-readers", type=int, default=5)
    opts = p.parse_args(argv)
    sc = Scenario(f"{opts.sizes}, {opts.shards:g} shards, {opts.ranks}x{opts.workers}", int(opts.shards), opts.ranks, opts.workers, opts.sizes, opts.sigma, target=True)
    r = simulate(sc, timed_readers=opts.timed_readers)
    res = common.BenchResult(NAME, [to_row(r)], checks_for([r]), {})
    print(common.checks_table([res]))
    print()
    print(to_row(r)["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
