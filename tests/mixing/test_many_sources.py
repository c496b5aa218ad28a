"""Hundreds of sources: a reader's buffers held to one budget over all its sources (in tokens, or
in samples), a state that does not grow with the sources a reader never read, exactly-once and
exact resume."""

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


def held_tokens(reader):
    """Tokens the live reader holds now, as its budget counts them: the lengths in its shuffle
    buffers, what its batchers hold (a bucketer's samples at their bucket's edge, a packer's
    placed tokens) and the lengths in batches ready to leave; recounted from the samples."""
    batchers = {id(b): b for b in reader.batchers}.values()
    shuffled = sum(s.length for st in reader.streams for s in st.buffer)
    assert shuffled == sum(st.held for st in reader.streams)  # the running count is the count
    ready = sum(_length(x) for b in batchers for batch in b.ready for x in batch)
    return shuffled + sum(b.held for b in batchers) + ready


def _length(item):
    return (item[1] if isinstance(item, tuple) and not isinstance(item, mixer.read.decode.Sample) else item).length


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_reader_never_holds_more_than_its_budget(many, mix_mode, packed):
    """Counted from the live reader after every batch, over several epochs of the common sources.
    The same mixture without a budget holds more, so the cap is what keeps it under."""
    n, budget = 120, "600 samples"
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
    assert seen[budget] <= 600, seen
    assert seen[None] > 600, seen  # without the budget these buffers hold more


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_reader_holds_about_its_budget_in_tokens(many, mix_mode, packed):
    """The same, in tokens, part by part after every batch: a shuffle buffer stops at the sample
    that crosses its token limit (it reads counted runs of samples, each aimed at half the room
    left: say two samples over), a batcher releases a batch whenever it holds more than its cap
    (one sample over, as a batch leaves). Without the budget the reader holds several times more
    (over twice: these small sources' shuffle buffers empty at each epoch's end, and their buckets
    wait a quarter of an epoch at most)."""
    n, budget = 120, 24000
    batching = (
        mixer.Packed(max_tokens=1024, seq_len=256, split_documents=True)
        if packed
        else mixer.TokenBudget(max_tokens=1024)
    )
    longest = max(max(lengths.values()) for _, lengths in many.values())
    seen = {}
    for b in (f"{budget} tokens", None):
        mix = mixture(many, weights=weights(n), mix=mix_mode, batching=batching, buffer_budget=b)
        reader = mix.reader(World())
        over = []
        totals = []
        for _ in take(reader, 150):
            totals.append(held_tokens(reader))
            over += [st.held - st.token_limit for st in reader.streams]
            over += [bt.held - cap for bt, cap in zip(reader.batchers, reader._token_caps)]
        assert len(totals) == 150
        seen[b] = (max(totals), max(over))
    total, over = seen[f"{budget} tokens"]
    assert over <= 2 * longest, seen
    assert total <= budget + 2 * longest, seen
    assert seen[None][0] > 2 * budget, seen


def test_a_token_budget_is_apportioned_by_share_with_a_floor(many):
    """A quarter of each source's part for its shuffle buffer, the rest for its buckets; the floor
    (one batch, 1024 tokens, as that is under ``budget // 2n``) keeps a rare source making batches."""
    budget = 480_000
    mix = mixture(many, weights=weights(120), buffer_budget=f"{budget // 1000}k tokens", shuffle_buffer=1000)
    reader = mix.reader(World())
    take(reader, 1)
    limits = [st.token_limit for st in reader.streams]
    caps = reader._token_caps
    assert sum(limits) + sum(caps) <= budget
    assert limits[0] > 5 * limits[-1] and caps[0] > 5 * caps[-1]  # the common source holds most
    assert min(limits) >= 1024 // 4 and min(caps) >= 1024 - 1024 // 4
    assert all(cap >= 3 * limit for limit, cap in zip(limits, caps))
    assert [st.limit for st in reader.streams][:3] == [1000, 500, 334]  # samples: by share, as without a budget
    assert reader._caps == [1 << 62] * 120  # no cap in samples


def test_the_budget_is_apportioned_by_share_with_a_floor(many):
    mix = mixture(many, weights=weights(120), buffer_budget="12000 samples", shuffle_buffer=1000)
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
        mixture(many, weights=weights(120), buffer_budget="100 samples")
    with pytest.raises(mixer.ConfigError, match=r"at least 2 tokens.*>= 240, got 200"):
        mixture(many, weights=weights(120), buffer_budget="200 tokens")
    with pytest.raises(mixer.ConfigError, match="buffer_budget: must be >= 1, got 0"):
        mixture(many, weights=weights(3), buffer_budget=0)


def test_a_bare_integer_budget_is_the_same_budget_in_samples(many):
    """What an integer meant before a budget had a unit, with a FutureWarning: the same mixture
    (fingerprint) and the same batches as ``"<n> samples"``."""
    with pytest.warns(FutureWarning, match=r"buffer_budget=480: a bare integer counts samples"):
        bare = mixture(many, weights=weights(120), buffer_budget=480)
    spelled = mixture(many, weights=weights(120), buffer_budget="480 samples")
    assert bare.fingerprint == spelled.fingerprint and bare.buffer_budget == "480 samples"
    one, two = (list(take(m.reader(World()), 30)) for m in (bare, spelled))
    assert [b.keys for b in one] == [b.keys for b in two]


@pytest.mark.slow
@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
def test_every_sample_of_200_sources_exactly_once_and_exact_resume(many, mix_mode):
    """One pass (all_exhausted) over 200 sources delivers every sample once; a resumed loader
    (2 workers) continues it batch for batch, including past the end of rare sources."""
    mix = mixture(
        many, weights=weights(MANY, skew=0.5), mix=mix_mode, stop="all_exhausted", buffer_budget="60000 tokens"
    )
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
    assert buffered > 150
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
    # over a cap in tokens (held 1,460 padded > 1,000) the floor is 0.97: the 104s still fit
    # ((540 + 104 t) / ((5 + t) 108) >= 0.97 for t <= 21), no 80 does ((1060 + 80) / (11 x 108) = 0.96)
    by_tokens_cap = Bucketer([80, 104, 108, 200, 400], mixer.TokenBudget(max_tokens=4000))
    for i, length in enumerate([108] * 5 + [104] * 5 + [80] * 5):
        by_tokens_cap.add((length, i), length)
    assert by_tokens_cap.release(hold=1 << 62, tokens=1000)
    assert [x[0] for x in by_tokens_cap.ready[0]] == [108] * 5 + [104] * 5 and by_tokens_cap.held == 400
    assert not Bucketer([80, 104], mixer.TokenBudget(max_tokens=4000)).release(hold=1 << 62, tokens=0)  # empty


@pytest.mark.parametrize("budget", ["480 samples", "24000 tokens"])
@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
def test_a_reader_of_120_sources_resumes_exactly_under_a_tight_budget(many, mix_mode, budget):
    """The shared oracle on one reader of 120 sources whose budget binds (allotments of a few
    samples or a few hundred tokens: early releases, shrunk shuffle buffers, buffers refilled to a
    token limit), cut where buffers are full."""
    mix = mixture(many, weights=weights(120), mix=mix_mode, buffer_budget=budget)
    assert_resumes_exactly(lambda: mix.reader(World()), cuts=[3, 17, 40], window=6, view=batch_view)
