"""What a reader's periodic state snapshot costs per sample, with 0 DataLoader workers (issue 17).

Every ``state_every`` batches a reader packs its whole state, every buffered sample by location,
into the snapshot its next batch carries. Two measures, same shard set, same run:

- end to end: `mixer.make_loader(Mixture(state_every=64), num_workers=0)` against the same with
  ``state_every=10**9`` (never), for the same number of batches, alternating; the difference of
  their CPU-µs/sample (median of the per-round differences) is the snapshot's price, garbage
  collection included;
- direct: on a live reader that has made those batches, ``Reader._snapshot()`` timed alone
  (median of repeats, the collector left on), spread over the ``64 × samples per batch`` the
  snapshot stands for.

Target: under 0.5 CPU-µs/sample end to end (it was ~1.65 when the snapshot built a tuple per
buffered sample).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

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

    def __call__(self, phase: str, info: dict) -> None:
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


def consume(shards: ShardSet, state_every: int, batches: int, collections: list[FullCollections]) -> Callable[[Tally], None]:
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


def direct(shards: ShardSet, batches: int, repeats: int) -> dict[str, float]:
    """``_snapshot()`` on a live reader after ``batches`` batches: ms per call, samples it holds."""
    from mixer.checkpoint import buffered
    from mixer.world import World

    mixture = make_mixture(shards, state_every=NEVER)
    reader = mixture.reader(World(num_workers=1))
    samples = 0
    for i, batch in enumerate(reader):
        samples += len(batch.lengths)
        if i + 1 >= batches:
            break
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        snap = reader._snapshot()
        times.append(time.process_time() - t0)
    shuffle, batched = buffered(snap)
    return {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times), "per_batch": samples / batches,
            "shuffle": shuffle, "batched": batched}  # fmt: skip


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    batches = BATCHES[opts.profile]
    skip = common.missing("mixer", "Mixture", "make_loader")
    collections: dict[int, list[FullCollections]] = {STATE_EVERY: [], NEVER: []}
    methods = [
        Method(f"state_{every}", f"mixer w0, state_every={every:g}", consume(shards, every, batches, collections[every]), skip=skip,
               note=f"{batches} batches")  # fmt: skip
        for every in (STATE_EVERY, NEVER)
    ]
    outcomes = common.run_rounds(methods, opts.rounds, shards.weights, opts.window_tokens, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in methods]
    a = common.per_round(outcomes[methods[0].name], "cpu_us_per_sample")
    b = common.per_round(outcomes[methods[1].name], "cpu_us_per_sample")
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    d = direct(shards, batches, repeats=5 if opts.quick else 20)
    per_sample = 1e3 * d["ms"] / (STATE_EVERY * d["per_batch"])
    log(f"direct: {d['ms']:.2f} ms per snapshot (min {d['ms_min']:.2f}), {d['shuffle']} shuffled + {d['batched']} batched samples held, "
        f"{d['per_batch']:.0f} samples/batch: {per_sample:.3f} µs/sample at state_every={STATE_EVERY}")  # fmt: skip
    end_to_end = statistics.median(diffs) if diffs else float("nan")
    full_gc = {every: {"count": statistics.median([c.count for c in runs]), "ms": 1e3 * statistics.median([c.seconds for c in runs])}
               for every, runs in collections.items() if runs}  # fmt: skip
    for every, g in full_gc.items():
        log(f"state_every={every:g}: {g['count']:g} full collections per run, {g['ms']:.1f} ms (medians)")
    checks = [
        dict(common.value_check(NAME, f"snapshot CPU-µs/sample, state_every={STATE_EVERY} minus never", end_to_end, 0.5, "<="),
             per_round=diffs),  # fmt: skip
        common.value_check(NAME, "direct _snapshot() CPU-µs/sample", per_sample, None),
        common.value_check(NAME, "direct _snapshot() ms per call", d["ms"], None),
    ]
    config = {"profile": opts.profile, "rounds": opts.rounds, "batches": batches, "direct": d, "full_gc": full_gc, "targets": shards.weights.tolist(),
              "shards": shards.describe()}  # fmt: skip
    return common.BenchResult(NAME, rows, checks, config)

