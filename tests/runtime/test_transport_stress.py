"""The worker transport under DataLoader's real request pattern: exactly once, never a reused slot.

DataLoader caps the requests outstanding *in total* (``prefetch_factor * num_workers``); when some
workers end their part of a finite pass early, their share of requests goes to the workers still
running. One worker can then be up to ``prefetch_factor * num_workers`` batches ahead of a slow
consumer, more than its ring of ``prefetch_factor + 2`` slots. Before the slots had their own flow
control that overwrote unread slots ("reused before it was read") for every case here with
``prefetch_factor * num_workers > prefetch_factor + 2``.
"""

from __future__ import annotations

import collections
import time

import pytest
from shardutil import key_lengths, write_token_shards

import mixer

# Every STALL_EVERY-th step the training loop stalls long enough for a worker to answer every
# request it holds (a checkpoint save, an evaluation, a GPU step that blocks).
STALL_EVERY, STALL_S = 10, 0.15


def lopsided_source(folder, num_workers: int) -> tuple[str, dict[str, int]]:
    """One shard per reader: the first holds 360 samples, the others none or 2, so with whole-shard
    assignment one worker streams ~70 batches while the others end before or after their first.
    A worker that ends leaves the requests it held unanswered, and DataLoader gives the running
    worker one more for each ended one."""
    per_shard = [[8 + i % 9 for i in range(360)]] + [[9, 11] if w % 2 else [] for w in range(1, num_workers)]
    return write_token_shards(folder, "lopsided", per_shard), key_lengths("lopsided", per_shard)


def drain(loader, *, stall: float = STALL_S) -> list[str]:
    keys = []
    for step, batch in enumerate(loader):
        keys.extend(batch.keys)
        if step % STALL_EVERY == 1:
            time.sleep(stall)
    return keys


@pytest.mark.parametrize("prefetch_factor", [1, 2, 4])
@pytest.mark.parametrize("num_workers", [1, 3, 6])
def test_workers_that_end_early_never_lose_or_repeat_a_batch(tmp_path, num_workers, prefetch_factor):
    pattern, lengths = lopsided_source(tmp_path, num_workers)
    mix = mixer.Mixture(
        [mixer.Source("lopsided", pattern)],
        batching=mixer.TokenBudget(max_tokens=64, max_length=64),
        stop="all_exhausted",
    )
    loader = mixer.make_loader(mix, num_workers=num_workers, prefetch_factor=prefetch_factor)
    assert loader.pool is not None
    keys = drain(loader)
    counts = collections.Counter(keys)
    assert set(counts) == set(lengths), "samples lost"
    assert max(counts.values()) == 1, "samples repeated"
    # The scenario is what it claims: most batches come from one worker.
    assert len(keys) == len(lengths) and len(keys) > 300


@pytest.mark.parametrize(
    "options",
    [
        {"pin_memory": True},
        {"persistent_workers": True},
        {"pin_memory": True, "persistent_workers": True},
    ],
)
@pytest.mark.slow
def test_slots_hold_with_the_pin_thread_and_persistent_workers(tmp_path, options):
    pattern, lengths = lopsided_source(tmp_path, 4)
    mix = mixer.Mixture(
        [mixer.Source("lopsided", pattern)],
        batching=mixer.TokenBudget(max_tokens=64, max_length=64),
        stop="all_exhausted",
    )
    loader = mixer.make_loader(mix, num_workers=4, prefetch_factor=4, **options)
    # Two passes: persistent workers keep their slots across passes; others map fresh ones.
    for _ in range(2):
        counts = collections.Counter(drain(loader))
        assert set(counts) == set(lengths) and max(counts.values()) == 1


def test_an_abandoned_pass_does_not_disturb_the_next(tmp_path):
    """A pass left mid-way (its iterator still alive, its workers still writing) and a new pass over
    the same loader: each sees its own batches whole."""
    pattern, lengths = lopsided_source(tmp_path, 3)
    mix = mixer.Mixture(
        [mixer.Source("lopsided", pattern)],
        batching=mixer.TokenBudget(max_tokens=64, max_length=64),
        stop="all_exhausted",
    )
    loader = mixer.make_loader(mix, num_workers=3, prefetch_factor=4)
    first = iter(loader)
    head = [k for _ in range(3) for k in next(first).keys]
    second = collections.Counter(drain(loader, stall=0.0))
    assert set(second) == set(lengths) and max(second.values()) == 1
    rest = collections.Counter(head + drain(first, stall=0.0))
    assert set(rest) == set(lengths) and max(rest.values()) == 1
