"""A reader's snapshot locates its buffered samples a column at a time (``pack_located``): the same
packed columns, byte for byte, as locating each item (``state_dict``) and packing the lists."""

from __future__ import annotations

import base64
import functools
import json
import zlib

import pytest
import shardutil
from resume_oracle import assert_resumes_exactly, batch_view
from shardutil import RESUME_SOURCES

import mixer
from mixer.batching.batchers import Bucketer
from mixer.plan.world import World
from mixer.read.decode import Sample
from mixer.state.checkpoint import LOCATION_COLUMNS, locate_pair, locate_sample, pack_located, readable
from mixer.state.columns import pack, pack_items, pack_parts, unpack

mixture = functools.partial(
    shardutil.mixture,
    weights={"web": 0.5, "code": 0.3, "tiny": 0.2},
    batching=mixer.TokenBudget(max_tokens=2048),
    shuffle_buffer=64,
)


@pytest.fixture(scope="module")
def shards(make_sources):
    return make_sources(RESUME_SOURCES)


def plain(batchers):
    return pack_parts([b.state_dict() for b in batchers], batchers[0].STATE_DEPTHS)


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_live_readers_columns_equal_the_plain_ones_at_every_batch(shards, mix_mode, packed):
    batching = (
        mixer.Packed(max_tokens=4096, seq_len=1024, split_documents=True)
        if packed
        else mixer.TokenBudget(max_tokens=2048)
    )
    mix = mixture(shards, mix=mix_mode, batching=batching, stop="all_exhausted")
    reader = mix.reader(World(num_workers=1))
    batchers = reader.batchers[:1] if mix_mode == "sample" else reader.batchers
    # The column path is the one taken for padded batches (a Packer's pieces go the plain way).
    assert (batchers[0].locate in LOCATION_COLUMNS and hasattr(batchers[0], "unlocated_state")) is not packed
    assert pack_located(batchers) == plain(batchers)  # nothing held yet
    held = []
    for n, _ in enumerate(reader, 1):
        assert pack_located(batchers) == plain(batchers), f"batch {n}"
        held.append(readable(reader._snapshot())["batchers"])
    # ... while the batchers held samples, and to the end of the pass, where they held none.
    assert n > 20 and any(len(b.get("items", ())) or b.get("buffers") for s in held for b in s)
    assert pack_located(batchers) == plain(batchers)


def sample(shard, offset, length=3):
    return Sample(key=f"{shard}/{offset}", tokens=None, length=length, shard=shard, offset=offset)


@pytest.mark.parametrize("shared", [False, True], ids=["per-source", "shared"])
def test_ready_batches_and_buckets_by_hand(shared):
    # Buckets of edges 4 and 8 at 16 tokens hold 4 and 2 items: 5 short items fill one batch
    # (ready) and leave one; 1 long item waits in the second bucket.
    locate = locate_pair if shared else locate_sample
    bucketers = [Bucketer([4, 8], mixer.TokenBudget(max_tokens=16), locate=locate) for _ in range(2)]
    items = [sample(s, 512 * k) for s, k in ((0, 3), (1, 0), (0, 9), (2, 1), (0, 1))]
    longer = sample(5, 1 << 40, length=7)  # offsets beyond 32 bits
    wrap = (lambda i, x: (i, x)) if shared else (lambda i, x: x)
    for x in items:
        bucketers[0].add(wrap(1, x), x.length)
    bucketers[0].add(wrap(0, longer), longer.length)
    assert len(bucketers[0].ready) == 1 and bucketers[0].count == 2
    loc = (lambda i, x: [i, x.shard, x.offset]) if shared else (lambda i, x: [x.shard, x.offset])
    cols = pack_located(bucketers)
    assert cols == plain(bucketers)
    assert unpack(cols["ready"], 3, 2, "ready") == [[[loc(1, x) for x in items[:4]]], []]
    assert unpack(cols["items"], 2, 2, "items") == [[loc(1, items[4]), loc(0, longer)], []]


def test_pack_items_is_pack_of_the_located_items():
    # Every depth a location column has, empty parts and empty lists among them.
    to_ints = LOCATION_COLUMNS[locate_sample]
    a, b, c = sample(3, 1024), sample(0, 0), sample(7, 512)
    for values, depth in [
        ([[a, b], [], [c]], 2),
        ([[], [], []], 2),
        ([[[a], [b, c]], [], [[]]], 3),
        ([[], [[]]], 3),
        ([[[[a, b]], []], [[[c]]]], 4),
    ]:
        located = located_lists(values, depth)
        assert pack_items(values, depth, to_ints) == pack(located, depth)


def located_lists(values, depth):
    if depth == 1:
        return [list(locate_sample(x)) for x in values]
    return [located_lists(v, depth - 1) for v in values]


def level1(text):
    """A packed column as the previous release compressed it (zlib level 1, all match lengths)."""
    return base64.b64encode(zlib.compress(zlib.decompress(base64.b64decode(text)), 1)).decode("ascii")


def test_states_whose_columns_were_compressed_the_older_way_resume_exactly(shards):
    # Columns are compressed with run-length matches only; any zlib stream reads back the same, so
    # a state saved before (level 1) resumes exactly: the same oracle, on states rewritten so.
    rewritten = []

    def save(loader):
        state = loader.state_dict()
        for reader in state["readers"]:
            snap = reader["snapshot"]
            if snap is None:
                continue
            before = json.dumps(snap)
            snap["active"], snap["counters"] = level1(snap["active"]), level1(snap["counters"])
            for part in ("streams", "batchers"):
                snap[part] = {k: level1(v) for k, v in snap[part].items()}
            rewritten.append(json.dumps(snap) != before)
        return state

    mix = mixture(shards, state_every=8)
    assert_resumes_exactly(lambda: mixer.make_loader(mix), cuts=[9, 16, 30], window=10, view=batch_view, save=save)
    assert rewritten and all(rewritten)  # every state had its bytes changed, and still resumed
