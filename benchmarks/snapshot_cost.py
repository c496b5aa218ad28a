"""What a reader's periodic state snapshot costs per sample, with 0 DataLoader workers (issue 17).

Every ``state_every`` batches a reader packs its whole state, every buffered sample by location,
into the snapshot its next batch carries. Three measures on the same shard set, in one run:

- end to end: `mixer.make_loader(Mixture(state_every=64), num_workers=0)` against the same with
  ``state_every=10**9`` (never), for the same number of batches, alternating; the difference of
  their CPU-µs/sample (median of the per-round differences) is the snapshot's price, garbage
  collection and cache effects included, but on a shared machine it swings by ±0.5 a round;
- in place: the reader's ``_snapshot()`` timed where its batch accounting calls it (its samples
  out of cache, as they are then), summed over the run and divided by the samples delivered;
- warm: the same call repeated at the end of that run.

Full (generation 2) garbage collections are counted per run. Target: under 0.5 CPU-µs/sample (the
snapshot cost ~1.65 when it built a tuple per buffered sample).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from . import common
from .common import Method, ShardSet, Tally
from .throughput import make_mixture

NAME = "snapshot_cost"
STATE_EVERY = 64
NEVER = 10**9
BATCHES = {"full": 700, "quick": 100}


class FullCollections:
    """Full (generation 2) garbage collections while it is entered, and their CPU time: what the
    objects a snapshot leaves behind cost on top of making them."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                self._t0 = time.process_time()
            else:
                self.count += 1
                self.seconds += time.process_time() - self._t0

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def consume(
    shards: ShardSet, state_every: int, batches: int, collections: list[FullCollections]
) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        import mixer

        loader = mixer.make_loader(make_mixture(shards, state_every=state_every), num_workers=0)
        with FullCollections() as full:
            for i, batch in enumerate(loader):
                tally.add_batch(batch.lengths.numpy(), batch.source.numpy(), batch.tokens.numel())
                if i + 1 >= batches:
                    break
        collections.append(full)

    return run


def in_place(shards: ShardSet, batches: int, repeats: int) -> dict[str, Any]:
    """A reader's ``_snapshot()`` timed where it is called over ``batches`` batches, then warm."""
    from mixer.plan.world import World
    from mixer.state.checkpoint import buffered

    reader = make_mixture(shards, state_every=STATE_EVERY).reader(World(num_workers=1))
    snapshot, taken = reader._snapshot, []

    def timed() -> dict[str, Any]:
        t0 = time.process_time()
        state = snapshot()
        taken.append(time.process_time() - t0)
        return state

    reader._snapshot = timed  # type: ignore[method-assign]  # the instance's: the batch accounting calls it
    samples = 0
    for i, batch in enumerate(reader):
        samples += len(batch.lengths)
        if i + 1 >= batches:
            break
    warm = []
    for _ in range(repeats):
        t0 = time.process_time()
        state = snapshot()
        warm.append(time.process_time() - t0)
    shuffle, batched = buffered(state)
    return {
        "ms": 1e3 * statistics.median(taken),
        "us_per_sample": 1e6 * sum(taken) / samples,
        "snapshots": len(taken),
        "warm_ms": 1e3 * statistics.median(warm),
        "per_batch": samples / batches,
        "shuffle": shuffle,
        "batched": batched,
    }


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    batches = BATCHES[opts.profile]
    skip = common.missing("mixer", "Mixture", "make_loader")
    collections: dict[int, list[FullCollections]] = {STATE_EVERY: [], NEVER: []}
    methods = [
        Method(
            f"state_{every}",
            f"mixer w0, state_every={every:g}",
            consume(shards, every, batches, collections[every]),
            skip=skip,
            note=f"{batches} batches",
        )
        for every in (STATE_EVERY, NEVER)
    ]
    outcomes = common.run_rounds(methods, opts.rounds, shards.weights, opts.window_tokens, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in methods]
    a = common.per_round(outcomes[methods[0].name], "cpu_us_per_sample")
    b = common.per_round(outcomes[methods[1].name], "cpu_us_per_sample")
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    end_to_end = statistics.median(diffs) if diffs else float("nan")
    full_gc = {
        every: {
            "count": statistics.median([c.count for c in runs]),
            "ms": 1e3 * statistics.median([c.seconds for c in runs]),
        }
        for every, runs in collections.items()
        if runs
    }
    for every, g in full_gc.items():
        log(f"state_every={every:g}: {g['count']:g} full collections per run, {g['ms']:.1f} ms (medians)")
    p = in_place(shards, batches, repeats=5 if opts.quick else 20)
    log(
        f"_snapshot() in place: {p['ms']:.2f} ms (median of {p['snapshots']}), {p['us_per_sample']:.3f} µs/sample; "
        f"warm {p['warm_ms']:.2f} ms; {p['shuffle']} shuffled + {p['batched']} batched samples held, "
        f"{p['per_batch']:.0f} samples/batch"
    )
    checks = [
        dict(
            common.value_check(
                NAME, f"snapshot CPU-µs/sample, state_every={STATE_EVERY} minus never", end_to_end, 0.5, "<="
            ),
            per_round=diffs,
        ),
        common.value_check(NAME, "_snapshot() in place, CPU-µs/sample", p["us_per_sample"], 0.5, "<="),
        common.value_check(NAME, "_snapshot() in place, ms per call", p["ms"], None),
        common.value_check(NAME, "_snapshot() warm, ms per call", p["warm_ms"], None),
    ]
    config = {
        "profile": opts.profile,
        "rounds": opts.rounds,
        "batches": batches,
        "in_place": p,
        "full_gc": full_gc,
        "targets": shards.weights.tolist(),
        "shards": shards.describe(),
    }
    return common.BenchResult(NAME, rows, checks, config)
