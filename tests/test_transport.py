"""Batches cross from workers through shared slots (fork) or by value (other start methods)."""

import pickle

import numpy as np
import pytest
import torch

import mixer
from mixer.batch import BatchMeta
from mixer.collate import collate
from mixer.errors import MixerError
from mixer.transport import SlotPool


def batch_in_slot(pool, worker=0):
    """A batch collated as a worker's reader does it: into a slot when one is free, then sealed."""
    writer = pool.writer(worker)
    b = collate([np.array([1, 2, 3]), np.array([4])], np.array([3, 1]), np.array([0, 1]), ["a", "b"], out=writer.out, meta=BatchMeta(step=0))
    b.slot = writer.seal()
    return b


def test_slot_round_trip_copies_the_batch_out():
    pool = SlotPool(num_workers=2, slots=3, slot_elems=64, dtype=np.dtype(np.int32))
    b = batch_in_slot(pool, worker=1)
    assert b.slot is not None
    c = pickle.loads(pickle.dumps(b))
    assert c.slot is None  # a private copy, no longer tied to the slot
    assert c.tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and c.lengths.tolist() == [3, 1] and c.source.tolist() == [0, 1]
    assert c.buffer.untyped_storage().data_ptr() != b.buffer.untyped_storage().data_ptr()


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
