"""Resume cost: time to the first batch after `load_state_dict`, at the start vs deep into a large
epoch (they must be about equal), and the state size per worker (issue 6, item 2).

    python -m benchmarks resume [--quick] [--rounds N]      # in the suite (one Markdown table)

Data: the suite's cached shard set (`common.ensure_shards`: web/code/books, ~100M tokens in `full`,
2M in `quick`), mixed by its token shares with `stop="never"`, default buffers (shuffle_buffer=1000
per source) and `state_every=16`. For each `num_workers` (0 and 2), one pass from the start saves the
loader state after an *early* batch (1.5 snapshot cycles in), a *deep* one (about 90% into the first
epoch of the largest source) and a *mid* one (a quarter of the way to deep), all at the same point of
the snapshot cycle, so they re-run the same number of batches in-process after seeking. Then, in
alternating rounds, each of:

* `fresh`: a new loader's first batch, no state (worker start-up and first fill: the floor);
* `early` / `mid` / `deep`: a new loader, `load_state_dict(state)` (pushed through JSON first), first
  batch: the reader re-reads every buffered sample at its (shard, byte offset) and re-runs
  < state_every batches;

(each round keeps the fastest of 3 tries of each, 1 with --quick) and, once, `replay`: the time the
first pass took to reach the deep batch, i.e. what resuming by replaying the stream would cost.
Every resumed first batch is checked against the uninterrupted pass. State size: compact JSON of
`loader.state_dict()`, total and per reader (worker). Beside the times: the bytes of shard ranges a
restore reads again (from the lowest to the highest buffered offset of each shard), which explains
most of the difference between the points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from . import common

NAME = "resume"
WORKERS = (0, 2)
STATE_EVERY = 16
DEEP_FRACTION = 0.9
# Each round keeps the fastest of a few tries per measurement: a noisy neighbour only ever adds time.
REPEATS, REPEATS_QUICK = 3, 1


def _mixture(shards: common.ShardSet, max_tokens: int) -> Any:
    import mixer

    sources = [mixer.Source(s.name, s.pattern, weight=s.weight) for s in shards.sources]
    budget = mixer.TokenBudget(max_tokens=max_tokens, max_length=max_tokens)
    return mixer.Mixture(sources, batching=budget, stop="never", state_every=STATE_EVERY, shuffle_buffer=1000)


def _first_batch(mix: Any, num_workers: int, state: dict[str, Any] | None) -> tuple[float, list[str]]:
    import mixer

    t0 = time.perf_counter()
    loader = mixer.make_loader(mix, num_workers=num_workers)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    batch = next(it)
    seconds = time.perf_counter() - t0
    keys = list(batch.keys)
    del it, batch, loader  # shuts the workers down before the next measurement
    common.reap_children(10)
    return seconds, keys


POINTS = ("early", "mid", "deep")


def _cut_points(mix: Any, num_workers: int, shards: common.ShardSet, max_tokens: int) -> dict[str, Any]:
    """One pass from the start: the states after an early, a mid (a quarter of the way to deep) and a
    deep batch, the batch after each, the time the pass took to reach each, and how far into the
    largest source's epoch the deep one is."""
    import mixer

    readers = max(num_workers, 1)
    cycle = STATE_EVERY * readers
    offset = (STATE_EVERY // 2) * readers  # mid-cycle: each reader re-runs STATE_EVERY/2 batches
    largest = max(shards.sources, key=lambda s: s.tokens)
    # batches until the largest source has delivered DEEP_FRACTION of its epoch (its tokens arrive
    # at about its weight's share of every batch's budget, padding aside)
    estimate = int(
        DEEP_FRACTION * largest.tokens / (largest.weight / sum(s.weight for s in shards.sources)) / max_tokens
    )
    early = cycle + offset
    deep = max(early + 2 * cycle, (estimate // cycle) * cycle + offset)
    mid = max(early + cycle, (deep // 4 // cycle) * cycle + offset)
    at = {"early": early, "mid": mid, "deep": deep}
    states: dict[int, dict[str, Any]] = {}
    after: dict[int, list[str]] = {}
    reached: dict[int, float] = {}
    epoch_done = 0.0
    loader = mixer.make_loader(mix, num_workers=num_workers)
    t0 = time.perf_counter()
    for i, batch in enumerate(loader, 1):
        if i - 1 in states:
            after[i - 1] = list(batch.keys)
        if i in at.values():
            reached[i] = time.perf_counter() - t0
            states[i] = json.loads(json.dumps(loader.state_dict()))
            if i == deep:
                epoch_done = loader.counters()[largest.name]["tokens"] / largest.tokens
        if i > deep:
            break
    del loader
    common.reap_children(10)
    return {
        "at": at,
        "states": states,
        "after": after,
        "reached": reached,
        "deep_epoch_fraction": epoch_done,
        "largest": largest.name,
    }


def measure(
    shards: common.ShardSet,
    num_workers: int,
    rounds: int,
    max_tokens: int,
    log: Callable[[str], None],
    *,
    repeats: int = 1,
) -> dict[str, Any]:
    import mixer

    mix = _mixture(shards, max_tokens)
    cuts = _cut_points(mix, num_workers, shards, max_tokens)
    at = cuts["at"]
    log(
        f"num_workers={num_workers}: states at batches {at} (deep: {cuts['deep_epoch_fraction']:.0%} of "
        f"{cuts['largest']}'s epoch)"
    )
    order = ["fresh", *POINTS]
    times: dict[str, list[float]] = {what: [] for what in order}
    for r in range(rounds):
        for what in order[r % len(order) :] + order[: r % len(order)]:
            state = None if what == "fresh" else cuts["states"][at[what]]
            seconds, keys = min(_first_batch(mix, num_workers, state) for _ in range(repeats))
            if what != "fresh" and keys != cuts["after"][at[what]]:
                raise AssertionError(
                    f"num_workers={num_workers}: resumed at batch {at[what]}, the next batch differs from the "
                    "uninterrupted pass"
                )
            times[what].append(seconds)
    out: dict[str, Any] = {
        "num_workers": num_workers,
        "deep_epoch_fraction": cuts["deep_epoch_fraction"],
        "times": times,
    }
    for what in order:
        out[f"{what}_s"] = statistics.median(times[what])
    for what in POINTS:
        state = cuts["states"][at[what]]
        out[f"{what}_batch"] = at[what]
        out[f"state_bytes_{what}"] = mixer.state.checkpoint.size_bytes(state)
        out[f"state_bytes_per_reader_max_{what}"] = max(
            len(json.dumps(r, separators=(",", ":"))) for r in state["readers"]
        )
        out[f"reread_mb_{what}"] = reread_span(state)["reread_mb"]
    for num, den in (("deep", "early"), ("deep", "mid")):
        ratios = [a / b for a, b in zip(times[num], times[den])]
        out[f"{num}_over_{den}"] = statistics.median(ratios)
        out[f"{num}_over_{den}_per_round"] = ratios
    out["replay_deep_s"] = cuts["reached"][at["deep"]]
    out["rerun_batches_max"] = max(int(r["replay"]) for p in POINTS for r in cuts["states"][at[p]]["readers"])
    return out


def reread_span(state: dict[str, Any]) -> dict[str, float]:
    """What restoring ``state`` reads again, about: per (reader, source, shard), the runs of buffered
    offsets that mixer.stream.reread.reread reads through (neighbours closer than its gap), summed."""
    from mixer.state.checkpoint import readable
    from mixer.stream.reread import _REREAD_GAP, _runs

    span = 0
    for reader in state["readers"]:
        saved = readable(reader["snapshot"]) if reader["snapshot"] else {"streams": [], "batchers": []}
        for stream, bucketer in zip(saved["streams"], saved["batchers"]):
            by_shard: dict[int, list[int]] = {}
            for shard, offset in stream["buffer"]:
                by_shard.setdefault(int(shard), []).append(int(offset))
            for group in (*bucketer["ready"], bucketer["items"]):
                for shard, offset in group:
                    by_shard.setdefault(int(shard), []).append(int(offset))
            span += sum(run[-1] - run[0] for o in by_shard.values() for run in _runs(sorted(set(o)), _REREAD_GAP))
    return {"reread_mb": span / 1e6}


def to_row(r: dict[str, Any]) -> dict[str, Any]:
    label = f"resume, num_workers={r['num_workers']}"
    points = ", ".join(f"batch {r[f'{p}_batch']} {1e3 * r[f'{p}_s']:.0f} ms" for p in POINTS)
    note = (
        f"first batch: fresh {1e3 * r['fresh_s']:.0f} ms; resumed at {points} (deep = {r['deep_epoch_fraction']:.0%} "
        f"into the epoch; deep/early {r['deep_over_early']:.2f}, deep/mid {r['deep_over_mid']:.2f}); replaying to "
        f"batch {r['deep_batch']} instead: {r['replay_deep_s']:.1f} s; state {r['state_bytes_deep'] / 1024:.0f} KiB "
        f"(largest reader {r['state_bytes_per_reader_max_deep'] / 1024:.0f} KiB); restore re-reads "
        + " / ".join(f"{r[f'reread_mb_{p}']:.0f}" for p in POINTS)
        + " MB of shard ranges (early / mid / deep) "
        f"and re-runs <= {r['rerun_batches_max']} batch(es) per reader"
    )
    return {
        "bench": NAME,
        "method": label,
        "label": label,
        "kind": "resume",
        "status": "ok",
        "wall_s": r["deep_s"],
        "note": note,
        **r,
    }


def checks_for(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for r in results:
        w = r["num_workers"]
        checks.append(
            {
                **common.value_check(
                    NAME, f"num_workers={w}: resume time deep / early", r["deep_over_early"], 1.5, "<="
                ),
                "per_round": r["deep_over_early_per_round"],
            }
        )
        checks.append(
            {
                **common.value_check(NAME, f"num_workers={w}: resume time deep / mid", r["deep_over_mid"], None, "<="),
                "per_round": r["deep_over_mid_per_round"],
            }
        )
        checks.append(
            common.value_check(
                NAME,
                f"num_workers={w}: resume deep / replay to the same batch",
                r["deep_s"] / r["replay_deep_s"],
                None,
                "<=",
            )
        )
        checks.append(
            common.value_check(
                NAME,
                f"num_workers={w}: state KiB per worker (largest, deep)",
                r["state_bytes_per_reader_max_deep"] / 1024,
                1024.0,
                "<=",
            )
        )
    return checks


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.ensure_shards(opts.profile, opts.bench_dir, log)
    common.warm_page_cache(shards)
    max_tokens = 16384 if opts.quick else 65536
    results = []
    for w in WORKERS:
        r = measure(shards, w, opts.rounds, max_tokens, log, repeats=REPEATS_QUICK if opts.quick else REPEATS)
        log(to_row(r)["note"])
        results.append(r)
    config = {
        "profile": opts.profile,
        "shards": shards.describe(),
        "max_tokens": max_tokens,
        "state_every": STATE_EVERY,
        "shuffle_buffer": 1000,
        "rounds": opts.rounds,
        "repeats": REPEATS_QUICK if opts.quick else REPEATS,
    }
    return common.BenchResult(NAME, [to_row(r) for r in results], checks_for(results), config)


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as suite

    return suite([NAME, *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
