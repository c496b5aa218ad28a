"""Batches cross from workers through shared slots (fork) or by value (other start methods)."""

import gc
import pickle

import numpy as np
import pytest
from shardutil import write_token_shards

import mixer
from mixer.batching.batch import BatchMeta
from mixer.batching.collate import collate
from mixer.errors import MixerError
from mixer.runtime.transport import SlotPool, grouped, ungrouped


def batch_in_slot(pool, worker=0):
    """A batch collated as a worker's reader does it: into a slot when one is free, then sealed."""
    writer = pool.writer(worker)
    b = collate(
        [np.array([1, 2, 3]), np.array([4])],
        np.array([3, 1]),
        np.array([0, 1]),
        ["a", "b"],
        out=writer.out,
        meta=BatchMeta(step=0),
    )
    b.slot = writer.seal()
    return b


def test_a_batch_read_from_a_slot_is_a_view_that_holds_the_slot_until_it_is_gone():
    pool = SlotPool(num_workers=2, slots=1, slot_elems=64, dtype=np.dtype(np.int32))
    b = batch_in_slot(pool, worker=1)
    assert b.slot is not None
    c = pickle.loads(pickle.dumps(b))
    assert c.slot is None  # pickles by value from here on
    assert c.tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and c.lengths.tolist() == [3, 1] and c.source.tolist() == [0, 1]
    assert c.buffer.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()  # no copy
    # While any tensor of the batch lives, its worker's only slot stays taken: the next batch
    # travels by value instead of overwriting what the training loop still reads.
    lengths = c.lengths
    del c
    assert batch_in_slot(pool, worker=1).slot is None
    assert lengths.tolist() == [3, 1]
    del lengths
    again = batch_in_slot(pool, worker=1)
    assert again.slot is not None and again.slot[2] == b.slot[2] and again.slot[3] > b.slot[3]


def test_a_sealed_slot_is_never_reused_before_it_is_read():
    pool = SlotPool(num_workers=1, slots=2, slot_elems=64, dtype=np.dtype(np.int32))
    first, second = batch_in_slot(pool), batch_in_slot(pool)
    assert {first.slot[2], second.slot[2]} == {0, 1}
    # Both slots wait to be read: the third batch travels by value instead of overwriting one.
    third = batch_in_slot(pool)
    assert third.slot is None
    sent = [pickle.dumps(b) for b in (first, second, third)]
    # Reading the first releases its slot, and the next batch takes it.
    assert pickle.loads(sent[0]).tokens.tolist() == [[1, 2, 3], [4, 0, 0]]
    fourth = batch_in_slot(pool)
    assert fourth.slot is not None and fourth.slot[2] == first.slot[2] and fourth.slot[3] > second.slot[3]
    for data in (sent[1], sent[2], pickle.dumps(fourth)):
        assert pickle.loads(data).tokens.tolist() == [[1, 2, 3], [4, 0, 0]]


def test_a_slot_read_twice_is_an_error_not_wrong_data():
    """A stamp that does not match (the slot was released and written again) raises rather than
    returning another batch's data."""
    pool = SlotPool(num_workers=1, slots=1, slot_elems=64, dtype=np.dtype(np.int32))
    sent = pickle.dumps(batch_in_slot(pool))
    pickle.loads(sent)
    batch_in_slot(pool)
    with pytest.raises(MixerError, match="expected stamp"):
        pickle.loads(sent)


def test_a_batch_larger_than_a_slot_travels_by_value():
    pool = SlotPool(num_workers=1, slots=2, slot_elems=4, dtype=np.dtype(np.int32))
    b = batch_in_slot(pool)
    assert b.slot is None
    assert pickle.loads(pickle.dumps(b)).tokens.tolist() == [[1, 2, 3], [4, 0, 0]]


def keys_and_tokens(loader):
    return [(k, row[:n].tolist()) for b in loader for k, row, n in zip(b.keys, b.tokens, b.lengths.tolist())]


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_workers_deliver_the_same_samples_by_either_path(three_sources, context):
    def run(workers, ctx=None):
        srcs = [mixer.Source(n, three_sources[n][0]) for n in ("web", "code")]
        mix = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=4096, max_length=4096), stop="all_exhausted")
        loader = mixer.make_loader(mix, num_workers=workers, multiprocessing_context=ctx)
        assert (loader.pool is not None) == (workers > 0 and ctx == "fork")
        return sorted(keys_and_tokens(loader))

    assert run(2, context) == run(0)


# ---- groups: several batches per DataLoader item -------------------------------------------


def test_grouped_sends_1_2_4_then_full_groups_and_marks_the_last():
    assert list(grouped(range(12), 1, 4)) == [
        (1, [0], False),
        (1, [1, 2], False),
        (1, [3, 4, 5, 6], False),
        (1, [7, 8, 9, 10], False),
        (1, [11], True),
    ]
    # A stream that ends on a group's edge still says so, with an empty group.
    assert list(grouped(range(3), 0, 4)) == [(0, [0], False), (0, [1, 2], False), (0, [], True)]
    assert list(grouped([], 2, 4)) == [(2, [], True)]


def test_grouped_sends_what_came_before_an_error_then_the_error():
    def failing():
        yield from range(4)
        raise ValueError("shard broken")

    it = grouped(failing(), 0, 8)
    assert [next(it), next(it), next(it)] == [(0, [0], False), (0, [1, 2], False), (0, [3], False)]
    with pytest.raises(ValueError, match="shard broken"):
        next(it)


def single_batch_order(counts):
    """DataLoader's order without groups: one batch of each worker in turn, ended workers left out."""
    return [(w, k) for k in range(max(counts)) for w, n in enumerate(counts) if k < n]


@pytest.mark.parametrize("counts", [[5, 2, 0], [0, 0, 7], [9, 9], [1], [3, 4, 4, 1], [0]])
@pytest.mark.parametrize("seed", range(4))
def test_ungrouped_restores_single_batch_order_whatever_order_groups_arrive_in(counts, seed):
    """Each worker's groups arrive in its own order, but the workers' groups interleave any way
    (DataLoader's order, or one worker far ahead): the batches come out as without groups."""
    per_worker = [list(grouped([(w, k) for k in range(n)], w, 4)) for w, n in enumerate(counts)]
    rng = np.random.default_rng(seed)
    arrivals = []
    while any(per_worker):
        w = int(rng.choice([i for i, g in enumerate(per_worker) if g]))
        arrivals.append(per_worker[w].pop(0))
    assert list(ungrouped(iter(arrivals), len(counts))) == single_batch_order(counts)


def test_ungrouped_fails_loudly_when_a_worker_never_ends():
    items = iter([(0, ["a"], True), (1, ["b"], False)])
    with pytest.raises(MixerError, match="worker 1 sent its last group"):
        list(ungrouped(items, 2))


def test_workers_deliver_steps_in_order_through_groups(tmp_path):
    """Three workers, one far longer than the others: every batch's global step is the next one of
    DataLoader's single-batch order (k * 3 + w for a worker's k-th batch, ended workers left out)."""
    per_shard = [[8 + i % 9 for i in range(360)], [9, 11] * 20, []]
    pattern = write_token_shards(tmp_path, "lop", per_shard)
    mix = mixer.Mixture(
        [mixer.Source("lop", pattern)], batching=mixer.TokenBudget(max_tokens=64, max_length=64), stop="all_exhausted"
    )
    loader = mixer.make_loader(mix, num_workers=3)
    assert loader.dataloader.dataset.group > 1  # the batches do travel in groups here
    got = [(b.meta.worker, b.meta.step) for b in loader]
    counts = [sum(1 for w, _ in got if w == v) for v in range(3)]
    assert counts[0] > counts[1] > 0 and counts[2] == 0
    assert got == [(w, k * 3 + w) for w, k in single_batch_order(counts)]


def test_the_fork_leaves_the_callers_gc_as_it_was(three_sources):
    """The heap is frozen only around the fork: afterwards the parent collects as before, and a
    caller's own gc.freeze() is left alone. (The suite freezes what it collected, conftest.py: this test
    starts as a caller that has frozen nothing, and puts that freeze back.)"""
    gc.unfreeze()
    try:
        _fork_leaves_the_gc_as_it_was(three_sources)
    finally:
        gc.freeze()


def _fork_leaves_the_gc_as_it_was(three_sources):
    mix = mixer.Mixture(
        [mixer.Source("web", three_sources["web"][0])], batching=mixer.TokenBudget(max_tokens=4096, max_length=4096)
    )
    loader = mixer.make_loader(mix, num_workers=2)
    it = iter(loader)
    next(it)
    assert gc.get_freeze_count() == 0
    it.close()
    gc.freeze()
    try:
        it = iter(loader)
        next(it)
        # Still frozen (the count drops only as frozen objects die); the loader's unfreeze would make it 0.
        assert gc.get_freeze_count() > 0
        it.close()
    finally:
        gc.unfreeze()
