"""Packed batches (mixer.Packed): placement by hand, every document whole and once (or split and
counted), boundaries consistent, token shares as in the padded layout, exact resume, devices."""

from __future__ import annotations

import functools
import pickle
from collections import defaultdict

import numpy as np
import pytest
import shardutil
import torch
from resume_oracle import _equal, assert_resumes_exactly, take
from shardutil import LogNormal, expected_tokens

import mixer
from mixer.batching.batch import BatchMeta
from mixer.batching.batchers import PackedGroup, Packer
from mixer.batching.collate import PackedLayout
from mixer.read.decode import Sample

SEQ = 512


@pytest.fixture(scope="module")
def shards(make_sources):
    """'short' documents well under a row, 'long' ones around and beyond it (up to 4 rows)."""
    return make_sources(
        {
            "short": LogNormal(shards=4, samples=600, median=60, sigma=0.9, lo=1, hi=400, seed=0),
            "long": LogNormal(shards=2, samples=120, median=400, sigma=0.9, lo=1, hi=4 * SEQ, seed=1),
        }
    )


# mixture(shards, batching=..., **mixture_options)
mixture = functools.partial(shardutil.mixture, weights={"short": 0.4, "long": 0.6}, shuffle_buffer=32, state_every=4)


# ---- the packer, by hand ---------------------------------------------------------------------


def placements(group):
    return [(item, r, c, s, k) for item, r, c, s, k in zip(group, group.rows, group.cols, group.starts, group.counts)]


def test_first_fit_without_splitting_by_hand():
    # 2 rows of 4 slots, one batch open at a time.
    p = Packer(mixer.Packed(max_tokens=8, seq_len=4, open_batches=1))
    assert not p.add("a", 3)  # row 0: a a a .
    assert not p.add("b", 2)  # does not fit row 0 (1 free): row 1: b b . .
    assert not p.add("c", 1)  # first fit: row 0, column 3
    assert p.add("d", 4)  # fits no row: the batch leaves, d starts the next one
    assert placements(p.ready.popleft()) == [("a", 0, 0, 0, 3), ("c", 0, 3, 0, 1), ("b", 1, 0, 0, 2)]
    assert p.add("e", 4)  # row 1 of the second batch: now full, it leaves at once
    assert placements(p.ready.popleft()) == [("d", 0, 0, 0, 4), ("e", 1, 0, 0, 4)]
    assert not p.open and len(p) == 0


def test_first_fit_looks_at_every_open_batch():
    p = Packer(mixer.Packed(max_tokens=8, seq_len=4, open_batches=2))
    for item, n in [("a", 3), ("b", 3), ("c", 3), ("d", 1)]:
        assert not p.add(item, n)
    # a, b fill batch 0's rows to 3/4; c opens batch 1; d goes back to batch 0, row 0
    assert [placements(g) for g in p.drain()] == [
        [("a", 0, 0, 0, 3), ("d", 0, 3, 0, 1), ("b", 1, 0, 0, 3)],
        [("c", 0, 0, 0, 3)],
    ]


def test_splitting_fills_free_space_then_new_rows_by_hand():
    p = Packer(mixer.Packed(max_tokens=8, seq_len=4, split_documents=True, open_batches=1))
    assert not p.add("a", 3)
    # 6 tokens fit no row whole: 1 piece fills row 0, 4 fill row 1, the last 1 opens a batch
    assert p.add("b", 6)
    assert placements(p.ready.popleft()) == [("a", 0, 0, 0, 3), ("b", 0, 3, 0, 1), ("b", 1, 0, 1, 4)]
    assert [placements(g) for g in p.drain()] == [[("b", 0, 0, 5, 1)]]


def test_flat_packing_has_one_row_and_no_padding():
    p = Packer(mixer.Packed(max_tokens=10, open_batches=1))
    for item, n in [("a", 4), ("b", 5), ("c", 2)]:
        p.add(item, n)
    assert [placements(g) for g in p.drain()] == [[("a", 0, 0, 0, 4), ("b", 0, 4, 0, 5)], [("c", 0, 0, 0, 2)]]


def test_packer_state_round_trips_through_locations():
    cfg = mixer.Packed(max_tokens=12, seq_len=4, split_documents=True, open_batches=2)
    items = [(f"x{i}", 1 + (7 * i) % 9) for i in range(40)]

    class Fed:
        def __init__(self):
            self.p = Packer(cfg, locate=lambda x: (x,))  # an item is its own location
            self.i = 0

        def __iter__(self):
            while True:
                while not self.p.ready:
                    self.p.add(*items[self.i % len(items)])
                    self.i += 1
                yield placements(self.p.ready.popleft())

        def state_dict(self):
            return {"p": self.p.state_dict(), "i": self.i}

        def load_state_dict(self, state):
            self.p.load_state_dict(state["p"])
            self.p.attach(lambda loc: loc[0])
            self.i = state["i"]

    assert_resumes_exactly(Fed, cuts=[1, 2, 5, 9], window=6)


def test_collate_geometry_by_hand():
    toks = {k: np.arange(1, 11, dtype=np.int32) * (i + 1) for i, k in enumerate("abc")}
    s = {k: Sample(k, toks[k], n, 0, i) for i, (k, n) in enumerate([("a", 3), ("b", 6), ("c", 2)])}
    # rows of 4: [a a a b] [b b b b] [c c . .]   (b split into 1 + 4 + ... here: 1 + 4, and c whole)
    group = PackedGroup(
        [s["a"], s["b"], s["b"], s["c"]],
        rows=[0, 0, 1, 2],
        cols=[0, 3, 0, 0],
        starts=[0, 0, 1, 0],
        counts=[3, 1, 4, 2],
        row_len=4,
        flat=False,
    )
    batch = PackedLayout(
        mixer.Packed(max_tokens=12, seq_len=4, split_documents=True), dtype="int32", pad_id=-1
    ).collate(group, np.array([1, 0, 0, 1]), meta=BatchMeta(step=0))
    a, b, c = toks["a"], toks["b"], toks["c"]
    assert batch.rows.tolist() == [[*a[:3], b[0]], b[1:5].tolist(), [*c[:2], -1, -1]]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 3, 4, 8, 12]
    assert batch.position_ids.tolist() == [
        0,
        1,
        2,
        0,
        0,
        1,
        2,
        3,
        0,
        1,
        2,
        3,
    ]  # c's segment runs on over its row's tail
    assert batch.lengths.tolist() == [3, 1, 4, 2] and batch.offsets.tolist() == [0, 0, 1, 0]
    assert batch.source.tolist() == [1, 0, 0, 1] and batch.keys == ["a", "b", "b", "c"]
    assert batch.max_seqlen == 4 and batch.num_tokens == 10 and batch.padding_efficiency == 10 / 12
    ptr = batch.buffer.untyped_storage().data_ptr()
    assert all(
        t.untyped_storage().data_ptr() == ptr
        for t in (batch.tokens, batch.cu_seqlens, batch.position_ids, batch.source)
    )


# ---- end to end --------------------------------------------------------------------------------


def check_batches(batches, packed, pad_id=0):
    """Invariants of every batch; returns ({key: [(offset, tokens)]}, delivered per source)."""
    pieces = defaultdict(list)
    per_source = np.zeros(2)
    for b in batches:
        cu, n = b.cu_seqlens.numpy().astype(np.int64), len(b)
        lengths, offsets, tokens = b.lengths.numpy(), b.offsets.numpy(), b.tokens.numpy()
        extent = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == tokens.size and np.all(extent >= lengths)
        assert b.max_seqlen == extent.max()
        # positions restart at every segment and count up to its end
        assert np.array_equal(b.position_ids.numpy(), np.arange(tokens.size) - np.repeat(cu[:-1], extent))
        if packed.seq_len is None:
            assert np.array_equal(extent, lengths) and tokens.size <= packed.max_tokens  # no padding at all
        else:
            rows = tokens.size // packed.seq_len
            assert tokens.size == rows * packed.seq_len and rows <= packed.rows
            # a segment never crosses a row; what follows its real tokens is padding
            assert np.all(cu[:-1] // packed.seq_len == (cu[1:] - 1) // packed.seq_len)
            real = b.position_ids.numpy() < np.repeat(lengths, extent)
            assert np.all(tokens[~real] == pad_id)
        for k in range(n):
            pieces[b.keys[k]].append((int(offsets[k]), tokens[cu[k] : cu[k] + lengths[k]].copy()))
        per_source += np.bincount(b.source.numpy(), weights=lengths, minlength=2)
    return pieces, per_source


@pytest.mark.parametrize(
    "packed",
    [
        mixer.Packed(max_tokens=4 * SEQ),
        mixer.Packed(max_tokens=4 * SEQ, split_documents=True, open_batches=1),
        mixer.Packed(max_tokens=4 * SEQ, seq_len=SEQ, split_documents=True),
    ],
    ids=["flat", "flat-split", "rows-split"],
)
def test_every_document_whole_and_once_or_split_and_counted(shards, packed):
    loader = mixer.make_loader(mixture(shards, batching=packed, stop="all_exhausted"))
    pieces, _ = check_batches(loader, packed)
    lengths = {**shards["short"][1], **shards["long"][1]}
    assert set(pieces) == set(lengths)
    split = 0
    for key, got in pieces.items():
        got.sort(key=lambda p: p[0])
        assert [o for o, _ in got] == list(np.cumsum([0] + [len(t) for _, t in got[:-1]]))  # contiguous pieces
        assert np.array_equal(np.concatenate([t for _, t in got]), expected_tokens(key, lengths[key]))
        split += len(got) > 1
        if not packed.split_documents:
            assert len(got) == 1
    counters = loader.counters()
    assert sum(c["split"] for c in counters.values()) == split
    assert (split > 0) == packed.split_documents
    for name in ("short", "long"):
        assert counters[name]["samples"] == len(shards[name][1])
        assert counters[name]["tokens"] == sum(shards[name][1].values())


def test_rows_without_splitting_keep_documents_whole(shards):
    packed = mixer.Packed(max_tokens=8 * SEQ, seq_len=4 * SEQ)
    pieces, _ = check_batches(
        mixer.make_loader(mixture(shards, batching=packed, stop="all_exhausted")), packed, pad_id=0
    )
    assert all(len(p) == 1 for p in pieces.values()) and len(pieces) == 720


def test_a_document_longer_than_a_row_needs_splitting_or_max_length(shards):
    # found while profiling: the readers' error, naming shard and key
    with pytest.raises(
        mixer.SampleError,
        match=r"source 'long': shard \S*long-\d+\.tar, key '[^']+': length \d+ exceeds seq_len=512; set "
        r"Packed\(split_documents=True",
    ):
        mixture(shards, batching=mixer.Packed(max_tokens=4 * SEQ, seq_len=SEQ))
    packed = mixer.Packed(max_tokens=4 * SEQ, seq_len=SEQ, max_length=SEQ, overlong="drop")
    loader = mixer.make_loader(mixture(shards, batching=packed, stop="all_exhausted"))
    pieces, _ = check_batches(loader, packed)
    too_long = {k for k, n in shards["long"][1].items() if n > SEQ}
    assert too_long and set(pieces) == set(shards["short"][1]) | (set(shards["long"][1]) - too_long)
    assert loader.counters()["long"]["dropped"] == len(too_long)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # The same rules and words as a config file's batching.<key> (mixer._check).
        ({"max_tokens": 0}, r"^Packed\.max_tokens: must be >= 1, got 0$"),
        ({"max_tokens": 8, "seq_len": 9}, r"^Packed\.seq_len: must be <= 8, got 9$"),
        (
            {"max_tokens": 8, "seq_len": 4, "max_length": 5},
            r"^Packed\.max_length: must be <= seq_len \(4\) unless split_documents is true, got 5$",
        ),
        ({"max_tokens": 8, "open_batches": 0}, r"^Packed\.open_batches: must be >= 1, got 0$"),
        ({"max_tokens": 8, "overlong": "cut"}, r"^Packed\.overlong: must be one of 'truncate', 'drop', got 'cut'$"),
        ({"max_tokens": 8, "split_documents": 1}, r"^Packed\.split_documents: must be true or false, got 1$"),
    ],
)
def test_packed_configuration_is_checked(kwargs, match):
    with pytest.raises(mixer.ConfigError, match=match):
        mixer.Packed(**kwargs)


def test_packing_multi_field_samples_is_refused(shards):
    with pytest.raises(mixer.ConfigError, match="fields: multi-field samples are batched with TokenBudget"):
        mixture(shards, batching=mixer.Packed(max_tokens=1024), fields={"x": mixer.Field()})


def shares(counters):
    tokens = np.array([counters[n]["tokens"] for n in ("short", "long")], dtype=np.float64)
    return tokens / tokens.sum()


@pytest.mark.parametrize("mix", ["batch", "sample"])
def test_token_shares_per_source_as_in_the_padded_layout(shards, mix):
    """The selector balances real tokens delivered whatever the layout: after the same number of
    real tokens both layouts sit on the 0.4 / 0.6 target."""
    results = {}
    for name, batching in (
        ("padded", mixer.TokenBudget(max_tokens=4 * SEQ, max_length=4 * SEQ)),
        ("packed", mixer.Packed(max_tokens=4 * SEQ, seq_len=SEQ, split_documents=True)),
    ):
        loader = mixer.make_loader(mixture(shards, batching=batching, mix=mix))
        delivered = np.zeros(2)
        for b in loader:
            delivered += np.bincount(b.source.numpy(), weights=b.lengths.numpy(), minlength=2)
            if delivered.sum() >= 600_000:
                break
        assert np.allclose(delivered / delivered.sum(), shares(loader.counters()))  # counters = what the batches hold
        results[name] = delivered / delivered.sum()
    # (mix="sample" counts a sample when it is drawn, so what waits in buckets or open rows lags; the
    # padded layout's buckets hold long samples back longer than the packer's rows do. That lag shrinks
    # as 1/tokens: measured over 8 seeds it is 0.018-0.031 at 300k tokens, which straddled the bound
    # depending on the RNG stream, and 0.017-0.022 at 600k.)
    assert abs(results["packed"][0] - 0.4) < 0.01
    assert abs(results["padded"][0] - 0.4) < 0.03
    assert abs(results["packed"][0] - results["padded"][0]) < 0.03


def packed_view(batch):
    return (
        tuple(batch.keys),
        batch.tokens.clone(),
        batch.cu_seqlens.clone(),
        batch.position_ids.clone(),
        batch.source.clone(),
        batch.offsets.clone(),
        batch.meta.step,
    )


SPLIT = mixer.Packed(max_tokens=2 * SEQ, seq_len=SEQ, split_documents=True, open_batches=2)
WHOLE = mixer.Packed(max_tokens=8 * SEQ, seq_len=4 * SEQ, open_batches=3)  # several batches open at every state


@pytest.mark.parametrize(
    "num_workers, mix, stop, packed",
    [
        (0, "batch", "never", SPLIT),
        (2, "batch", "all_exhausted", SPLIT),
        (2, "sample", "never", SPLIT),
        (0, "sample", "all_exhausted", SPLIT),
        (0, "batch", "never", WHOLE),
        (2, "sample", "never", WHOLE),
    ],
)
def test_resume_oracle_packed(shards, num_workers, mix, stop, packed):
    mix_ = mixture(shards, batching=packed, mix=mix, stop=stop)
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix_, num_workers=num_workers), cuts=[1, 3, 4, 9, 22], window=8, view=packed_view
    )


def test_int64_buffer_keeps_int32_cu_seqlens(shards):
    packed = mixer.Packed(max_tokens=4 * SEQ, seq_len=SEQ, split_documents=True)
    batches = take(mixer.make_loader(mixture(shards, batching=packed, dtype="int64"), num_workers=2), 5)
    assert all(b.tokens.dtype == torch.int64 and b.cu_seqlens.dtype == torch.int32 for b in batches)
    check_batches(batches, packed)


def test_pickle_to_and_device_feed_keep_views_consistent(shards):
    packed = mixer.Packed(max_tokens=4 * SEQ, seq_len=SEQ, split_documents=True)
    (b,) = take(mixer.make_loader(mixture(shards, batching=packed)), 1)
    for c in (pickle.loads(pickle.dumps(b)), b.to("cpu")):
        assert type(c) is mixer.PackedBatch and _equal(packed_view(c), packed_view(b))
        assert c.max_seqlen == b.max_seqlen and c.rows.shape == b.rows.shape
    fed = take(mixer.make_loader(mixture(shards, batching=packed), device="cpu"), 2)
    assert all(isinstance(x, mixer.PackedBatch) for x in fed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_and_cuda_paths():
    packed = mixer.Packed(max_tokens=64, seq_len=16, split_documents=True)
    s = [Sample(f"k{i}", np.arange(1, 20 + i, dtype=np.int32), 19 + i, 0, i) for i in range(3)]
    p = Packer(packed)
    for x in s:
        p.add(x, x.length)
    group = next(p.drain())
    b = PackedLayout(packed, dtype="int32", pad_id=0).collate(
        group, np.zeros(len(group), dtype=np.int64), meta=BatchMeta()
    )
    pinned = b.pin_memory()
    assert pinned.is_pinned() and pinned.cu_seqlens.is_pinned() and torch.equal(pinned.tokens, b.tokens)
    on = pinned.to("cuda", non_blocking=True)
    assert (
        on.tokens.is_cuda and on.cu_seqlens.dtype == torch.int32 and torch.equal(on.position_ids.cpu(), b.position_ids)
    )
    fed = list(mixer.to_device([pinned], "cuda"))
    assert torch.equal(fed[0].cu_seqlens.cpu(), b.cu_seqlens)
