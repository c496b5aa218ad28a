"""Collate and the Batch type."""

import pickle

import numpy as np
import torch

from mixer.batching.batch import Batch, BatchMeta
from mixer.batching.collate import collate


def make(pad_id=0, dtype="int32"):
    toks = [np.array([5, 6, 7], dtype=np.int32), np.array([8], dtype=np.int64), np.array([9, 10], dtype=np.uint16)]
    lengths = np.array([3, 1, 2])
    return collate(
        toks, lengths, np.array([2, 0, 1]), ["a", "b", "c"], pad_id=pad_id, dtype=dtype, meta=BatchMeta(step=4)
    )


def test_collate_pads_into_one_buffer():
    b = make(pad_id=-1)
    assert b.tokens.tolist() == [[5, 6, 7], [8, -1, -1], [9, 10, -1]]
    assert b.lengths.tolist() == [3, 1, 2]
    assert b.source.tolist() == [2, 0, 1]
    assert b.keys == ["a", "b", "c"]
    assert b.tokens.dtype == torch.int32
    # One storage behind every field.
    ptr = b.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == ptr for t in (b.tokens, b.lengths, b.source))
    assert b.num_tokens == 6 and abs(b.padding_efficiency - 6 / 9) < 1e-12


def test_int64_option():
    assert make(dtype="int64").tokens.dtype == torch.int64


def test_pickle_round_trip_rebuilds_views():
    b = make()
    c = pickle.loads(pickle.dumps(b))
    assert isinstance(c, Batch)
    assert torch.equal(c.tokens, b.tokens) and torch.equal(c.lengths, b.lengths) and c.meta == BatchMeta(step=4)


def test_to_and_pin_memory_keep_views_consistent():
    b = make()
    c = b.to("cpu")
    assert torch.equal(c.tokens, b.tokens) and c.keys == b.keys
    if torch.cuda.is_available():
        p = b.pin_memory()
        assert p.is_pinned() and p.tokens.is_pinned() and torch.equal(p.tokens, b.tokens)
