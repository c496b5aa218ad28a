"""Hundreds of sources (issue 14): a reader's buffers held to one budget over all its sources, a
state that does not grow with the sources a reader never read, exactly-once and exact resume."""

from __future__ import annotations

import collections
import functools
import json

import pytest
import shardutil
from resume_oracle import assert_resumes_exactly, batch_view, take
from shardutil import LogNormal

import mixer
from mixer.plan.world import World

MANY = 200


@pytest.fixture(scope="module")
def many(make_sources):
    """200 small sources: 1-2 shards of 6-17 samples, lengths of different medians."""
    spec = {
        f"s{i:03d}": LogNormal(
            shards=1 + i % 2, samples=6 + i % 12, median=40 + 7 * (i % 13), sigma=0.6, lo=2, hi=1024, seed=100 + i
        )
        for i in range(MANY)
    }
    return make_sources(spec)


def weights(n, skew=1.0):
    """Zipf-like shares: a few common sources, a long tail of rare ones."""
    return {f"s{i:03d}": 1.0 / (1 + i) ** skew for i in range(n)}


mixture = functools.partial(
    shardutil.mixture, batching=mixer.TokenBudget(max_tokens=1024), shuffle_buffer=64, state_every=4
)


def held(reader):
    """Samples the live reader holds now: shuffle buffers, batcher buffers and ready batches."""
    batchers = {id(b): b for b in reader.batchers}.values()
    return sum(len(st.buffer) for st in reader.streams) + sum(b.count + sum(map(len, b.ready)) for b in batchers)


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_reader_never_holds_more_than_its_budget(many, mix_mode, packed):
    """Counted from the live reader after every batch, over several epochs of the common sources.
    The same mixture without a budget holds more, so the cap is what keeps it under."""
    n, budget = 120, 600
    batching = (
        mixer.Packed(max_tokens=1024, seq_len=256, split_documents=True)
        if packed
        else mixer.TokenBudget(max_tokens=1024)
    )
    world = World()
    seen = {}
    for b in (budget, None):
        mix = mixture(many, weights=weights(n), mix=mix_mode, batching=batching, buffer_budget=b)
        reader = mix.reader(world)
        counts = [held(reader) for _ in take(reader, 150)]
        assert len(counts) == 150
        seen[b] = max(counts)
    assert seen[budget] <= budget, seen
    assert seen[None] > budget, seen  # without the budget these buffers hold more


def test_the_budget_is_apportioned_by_share_with_a_floor(many):
    mix = mixture(many, weights=weights(120), buffer_budget=12000, shuffle_buffer=1000)
    reader = mix.reader(World())
    take(reader, 1)
    limits = [st.limit for st in reader.streams]
    caps = reader._caps
    assert sum(limits) + sum(caps) <= 12000
    assert limits[0] > 5 * limits[-1] and caps[0] > 5 * caps[-1]  # the common source holds most
    assert min(limits) >= 16 and min(caps) >= 16  # a rare source still has room (BUDGET_FLOOR // 2)


def test_a_budget_too_small_for_the_sources_is_refused(many):
    with pytest.raises(
        mixer.ConfigError, match=r"buffer_budget: must give each of the 120 sources at least 2 samples.*>= 240, got 100"
    ):
        mixture(many, weights=weights(120), buffer_budget=100)
    with pytest.raises(mixer.ConfigError, match="buffer_budget: must be >= 1, got 0"):
        mixture(many, weights=weights(3), buffer_budget=0)


@pytest.mark.slow
@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
def test_every_sample_of_200_sources_exactly_once_and_exact_resume(many, mix_mode):
    """One pass (all_exhausted) over 200 sources delivers every sample once; a resumed loader
    (2 workers) continues it batch for batch, including past the end of rare sources."""
    mix = mixture(many, weights=weights(MANY, skew=0.5), mix=mix_mode, stop="all_exhausted", buffer_budget=1600)
    batches = list(mixer.make_loader(mix))
    keys = [k for b in batches for k in b.keys]
    expected = {k for _, lengths in many.values() for k in lengths}
    assert len(keys) == len(expected) and set(keys) == expected
    counts = collections.Counter(int(s) for b in batches for s in b.source)
    assert len(counts) == MANY
    n = len(batches)
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=2), cuts=[5, n // 3, (2 * n) // 3, n - 2], window=6, view=batch_view
    )


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
def test_the_state_of_a_reader_costs_bytes_per_source_not_objects(many, mix_mode):
    """At 200 sources, most read a little or not at all: the reader state is columns over the
    sources plus a few bytes per buffered sample (before issue 14: ~300 B per source for the
    fields alone, ~12 B per buffered sample)."""
    mix = mixture(many, weights=weights(MANY), mix=mix_mode)
    reader = mix.reader(World())
    take(reader, 40)
    state = reader.state_dict()
    buffered = sum(mixer.state.checkpoint.buffered(state["snapshot"]))
    assert buffered == held(reader)
    size = len(json.dumps(state))
    assert buffered > 200
    assert size < 10 * MANY + 4 * buffered + 1500, (size, buffered)


def test_a_budget_capped_release_keeps_padding_a_token_capped_one_tops_up():
    """Hand-computed (capacities 4000 // edge): 3 samples of 400 tokens, 5 of 108, 5 of 104, 5 of 80.
    Over its token hold, a bucketer tops the longest bucket up with the shorter ones (400-slot rows:
    3 + 5 + 2 samples, ~49% efficient at the edges); over only its item cap (a budget share), a
    batch takes shorter samples only while it stays >= 95% efficient, so the 3 long ones leave alone."""
    from mixer.batching.batchers import Bucketer

    def filled():
        b = Bucketer([80, 104, 108, 200, 400], mixer.TokenBudget(max_tokens=4000))
        for i, length in enumerate([400] * 3 + [108] * 5 + [104] * 5 + [80] * 5):
            assert not b.add((length, i), length)
        assert b.count == 18 and b.held == 3 * 400 + 5 * 108 + 5 * 104 + 5 * 80
        return b

    by_tokens = filled()
    assert by_tokens.release(hold=1000)
    assert [x[0] for x in by_tokens.ready[0]] == [400] * 3 + [108] * 5 + [104] * 2 and by_tokens.count == 8
    by_items = filled()
    assert by_items.release(hold=1 << 62, items=10)
    assert [x[0] for x in by_items.ready[0]] == [400] * 3 and by_items.count == 15
    # topping up within the efficiency floor: bucket 108 takes all of 104 (>= 0.95 x 108) and one 80
    only_short = Bucketer([80, 104, 108, 200, 400], mixer.TokenBudget(max_tokens=4000))
    for i, length in enumerate([108] * 5 + [104] * 5 + [80] * 5):
        only_short.add((length, i), length)
    assert only_short.release(hold=1 << 62, items=10)
    assert [x[0] for x in only_short.ready[0]] == [108] * 5 + [104] * 5 + [80]


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
def test_a_reader_of_120_sources_resumes_exactly_under_a_tight_budget(many, mix_mode):
    """The shared oracle on one reader of 120 sources whose budget binds (allotments of a few
    samples: early releases, shrunk shuffle buffers), cut where buffers are full."""
    mix = mixture(many, weights=weights(120), mix=mix_mode, buffer_budget=480)
    assert_resumes_exactly(lambda: mix.reader(World()), cuts=[3, 17, 40], window=6, view=batch_view)
