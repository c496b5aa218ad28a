"""Exact checkpoint/resume: batch-for-batch identical continuation, cheap and bounded state."""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest
import shardutil
import torch
from resume_oracle import assert_resumes_exactly, batch_view, tail_cuts, take
from shardutil import RESUME_SOURCES

import mixer
from mixer.mixing.selector import SELECTORS, Deficit, RandomPick, RoundRobin


@pytest.fixture(scope="module")
def shards(make_sources):
    """'tiny' turns over its epoch every few batches, so cuts land right after epoch restarts."""
    return make_sources(RESUME_SOURCES)


# mixture(shards, **mixture_options)
mixture = functools.partial(
    shardutil.mixture,
    weights={"web": 0.5, "code": 0.3, "tiny": 0.2},
    batching=mixer.TokenBudget(max_tokens=2048),
    state_every=8,
    shuffle_buffer=64,
)


def oracle(mix, *, num_workers=0, cuts, window=12, reference=None, saved="in one pass"):
    return assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=num_workers),
        cuts=cuts,
        window=window,
        view=batch_view,
        reference=reference,
        saved=saved,
    )


@pytest.mark.slow
def test_fifty_random_cut_points_with_the_uninterrupted_run_as_oracle(shards):
    mix = mixture(shards)
    reference = [batch_view(b) for b in take(mixer.make_loader(mix), 260)]
    # Cuts right after 'tiny' restarted an epoch: find them from the counters the batches carry.
    epochs = [
        b.meta.counters[2][mixer.read.counters.Counters.FIELDS.index("epochs")]
        for b in take(mixer.make_loader(mix), 240)
    ]
    after_restart = [i + 1 for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]][:8]
    assert after_restart, "the fixture should make 'tiny' restart its epoch"
    rng = random.Random(0)
    cuts = sorted(set(after_restart) | set(rng.sample(range(1, 240), 50 - len(after_restart))))
    # each state from a loader stopped at its cut, as a job that saves and exits (the other tests take
    # theirs from one pass that goes on)
    oracle(mix, cuts=cuts, window=10, reference=reference, saved="a run per cut")


@pytest.mark.parametrize("num_workers", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_resume_with_workers(shards, num_workers):
    mix = mixture(shards)
    oracle(mix, num_workers=num_workers, cuts=[1, 7, 8, 9, 31, 50])


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("stop", ["never", "first_exhausted", "all_exhausted"])
def test_every_selector_and_stop_policy(shards, selector, stop):
    mix = mixture(shards, selector=selector, stop=stop)
    # Finite passes can be short (the tiny source ends first_exhausted early): cut inside them,
    # including one batch before the end.
    length = len(take(mixer.make_loader(mix), 200))
    cuts = sorted({3, length // 3, (2 * length) // 3, max(length - 1, 1)})
    oracle(mix, cuts=cuts, window=8)


def test_sample_level_mixing(shards):
    oracle(mixture(shards, mix="sample", stop="all_exhausted"), cuts=[2, 11, 29, 60], num_workers=2)


def test_time_varying_schedule_resumes_at_the_same_step(shards):
    schedule = mixer.Curriculum(
        [
            mixer.Phase(weights={"web": 1.0}, until=30),
            mixer.Phase(weights={"code": 1.0, "tiny": 1.0}, until=None, ramp=20),
        ],
        unit="steps",
    )
    mix = mixture(shards, schedule=schedule)
    reference = oracle(mix, cuts=[10, 29, 30, 41, 55], window=10)
    assert [r[-1] for r in reference[:5]] == [0, 1, 2, 3, 4]  # global steps


def test_a_source_whose_share_rises_and_falls_resumes_exactly(shards):
    """What a source holds ahead follows its share (issue 12, item 9): 'code' starts rare (a small
    shuffle buffer, buckets released early), becomes the main source, then rare again (its buffers
    hand out their excess first). Cuts at every change and inside the ramps."""
    schedule = mixer.Floored(
        mixer.Curriculum(
            [
                mixer.Phase(weights={"web": 1.0, "tiny": 0.3}, until=25),
                mixer.Phase(weights={"code": 1.0, "web": 0.2}, until=55, ramp=10),
                mixer.Phase(weights={"web": 1.0, "tiny": 0.3}, until=None, ramp=5),
            ],
            unit="steps",
        ),
        0.005,
    )
    mix = mixture(shards, schedule=schedule, shuffle_buffer=200)
    reference = oracle(mix, cuts=[3, 24, 25, 30, 36, 54, 55, 58, 61, 80], window=12)
    # 'code' (source 1) really was rare, then common: a handful of batches early, most in the middle
    sources = [int(r[1][0]) for r in reference]
    assert sum(s == 1 for s in sources[:25]) <= 3 and sum(s == 1 for s in sources[35:55]) >= 10


def test_resume_of_a_resumed_run(shards):
    mix = mixture(shards)
    reference = [batch_view(b) for b in take(mixer.make_loader(mix, num_workers=2), 60)]
    first = mixer.make_loader(mix, num_workers=2)
    take(first, 13)
    second = mixer.make_loader(mix, num_workers=2)
    second.load_state_dict(first.state_dict())
    take(second, 20)  # now at 33
    third = mixer.make_loader(mix, num_workers=2)
    third.load_state_dict(second.state_dict())
    got = [batch_view(b) for b in take(third, 20)]
    assert all(oracle_equal(a, b) for a, b in zip(reference[33:53], got))


def oracle_equal(a, b):
    from resume_oracle import _equal

    return _equal(a, b)


def test_state_is_plain_small_and_torch_saveable(shards, tmp_path):
    mix = mixture(shards, shuffle_buffer=1000, state_every=16, batching=mixer.TokenBudget(max_tokens=16384))
    loader = mixer.make_loader(mix, num_workers=2)
    take(loader, 40)
    state = loader.state_dict()
    text = json.dumps(state)
    # Issue 6's target: under 1 MiB per worker with default buffers; here each reader holds its
    # sources' parts of an epoch (at most: a shuffle buffer hands out all of an epoch before it
    # reads the next) and bucket buffers after 40 batches, and issue 14's columns keep it to a few
    # bytes per buffered sample.
    per_reader = [mixer.state.checkpoint.size_bytes(r) for r in state["readers"]]
    assert len(per_reader) == 2 and all(r["snapshot"] is not None for r in state["readers"])
    held = [sum(mixer.state.checkpoint.buffered(r["snapshot"])) for r in state["readers"]]
    assert min(held) > 400, held  # the buffered locations really are in it
    assert all(size < 4 * n + 2000 for size, n in zip(per_reader, held)), (per_reader, held)
    torch.save({"data": state}, tmp_path / "ckpt.pt")
    back = torch.load(tmp_path / "ckpt.pt", weights_only=True)["data"]
    assert json.dumps(back) == text


def test_state_from_a_different_mixture_is_refused(shards):
    loader = mixer.make_loader(mixture(shards))
    take(loader, 5)
    state = loader.state_dict()
    for other in (
        mixture(shards, seed=1),
        mixture(shards, shuffle_buffer=65),
        mixture(shards, selector="random"),
        mixture(shards, buffer_budget="600 samples"),
        mixture(shards, buffer_budget="600k tokens"),
    ):
        with pytest.raises(mixer.StateError, match="different mixture"):
            mixer.make_loader(other).load_state_dict(state)


def test_state_of_another_topology_or_version_is_refused(shards):
    mix = mixture(shards)
    loader = mixer.make_loader(mix, num_workers=2)
    take(loader, 5)
    state = loader.state_dict()
    with pytest.raises(mixer.StateError, match="num_workers or world_size"):
        mixer.make_loader(mix, num_workers=3).load_state_dict(state)
    with pytest.raises(mixer.StateError, match="version"):
        mixer.make_loader(mix, num_workers=2).load_state_dict(dict(state, version=999))
    with pytest.raises(mixer.StateError, match="not a mixer loader state"):
        mixer.make_loader(mix, num_workers=2).load_state_dict({"step": 3})
    # A state of the previous format says what it is and what this mixer reads.
    old = {**state, "version": 2, "readers": [{"state": None, "since": 0, "skips": []}] * 2}
    with pytest.raises(
        mixer.StateError, match=r"version 2 \(mixer before the checkpoint module.*reads state version 6"
    ):
        mixer.make_loader(mix, num_workers=2).load_state_dict(old)
    # The state before the columnar reader snapshots (one JSON object per source) likewise.
    with pytest.raises(
        mixer.StateError, match=r"version 4 \(mixer before the columnar reader state.*reads state version 6"
    ):
        mixer.make_loader(mix, num_workers=2).load_state_dict(dict(state, version=4))


def test_the_fingerprint_is_computed_once_per_mixture(shards, monkeypatch):
    mix = mixture(shards)
    loader = mixer.make_loader(mix)
    take(loader, 3)

    def boom(*args, **kwargs):
        raise AssertionError("the fingerprint is computed when the mixture is built, not per state")

    monkeypatch.setattr(mixer.mixing.fingerprint, "fingerprint", boom)
    state = loader.state_dict()
    assert state["fingerprint"] == mix.fingerprint and len(mix.fingerprint) == 32
    mixer.make_loader(mix).load_state_dict(state)


def test_every_part_refuses_unknown_and_missing_keys(shards):
    """Each part restores only itself, and a key it does not know (or lacks) is a StateError that
    names the part and the key. The streams' and batchers' states are columns over the sources
    (mixer.state.columns): their fields are checked as one part each, and a damaged column is refused."""
    for mix_mode, batching in (
        ("batch", mixer.TokenBudget(max_tokens=2048)),
        ("sample", mixer.Packed(max_tokens=4096, seq_len=2048)),
    ):
        mix = mixture(shards, mix=mix_mode, batching=batching)
        loader = mixer.make_loader(mix)
        take(loader, 8)  # state_every=8: reader 0 holds a snapshot
        state = json.loads(json.dumps(loader.state_dict()))
        snapshot = state["readers"][0]["snapshot"]
        parts = {
            "loader reader 0": lambda s: s["readers"][0],
            "reader snapshot": lambda s: s["readers"][0]["snapshot"],
            "streams": lambda s: s["readers"][0]["snapshot"]["streams"],
            "batchers": lambda s: s["readers"][0]["snapshot"]["batchers"],
            "deficit selector": lambda s: s["readers"][0]["snapshot"]["selector"],
        }
        assert snapshot is not None
        for part, find in parts.items():
            for change, message in (("add", "unknown key 'bogus'"), ("drop", "missing key")):
                broken = json.loads(json.dumps(state))
                piece = find(broken)
                if change == "add":
                    piece["bogus"] = 1
                else:
                    piece.pop(sorted(piece)[0])
                resumed = mixer.make_loader(mix)
                with pytest.raises(mixer.StateError, match=f"{part} state: {message}"):
                    resumed.load_state_dict(broken)
                    take(resumed, 1)  # readers restore themselves when the pass starts
        for part, key in (("streams", "buffer"), ("batchers", "ready"), ("deficit selector", "delivered")):
            broken = json.loads(json.dumps(state))
            column = parts[part](broken)
            column[key] = column[key][:-8] + "A" * 8  # a damaged column
            resumed = mixer.make_loader(mix)
            with pytest.raises(mixer.StateError, match=f"{part} state: '{key}'"):
                resumed.load_state_dict(broken)
                take(resumed, 1)


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_reader_resumes_exactly_from_its_own_state(shards, mix_mode, packed):
    """The Reader is a Stateful part like the others: its state_dict() at any batch (a snapshot of
    every part, nothing to replay) resumes it exactly, through the same oracle."""
    from mixer.plan.world import World

    batching = (
        mixer.Packed(max_tokens=4096, seq_len=1024, split_documents=True)
        if packed
        else mixer.TokenBudget(max_tokens=2048)
    )
    mix = mixture(shards, mix=mix_mode, batching=batching, stop="all_exhausted")
    world = World(rank=0, world_size=1, worker=0, num_workers=1)
    view = (lambda b: (tuple(b.keys), b.source.clone(), b.tokens.clone(), b.meta.step)) if packed else batch_view
    assert_resumes_exactly(lambda: mix.reader(world), cuts=[1, 5, 8, 13, 29], window=10, view=view)


# ---- the same oracle on the smaller stateful parts ---------------------------------------------


class _Picks:
    """A selector driven with fixed amounts, as an iterable with state (for the oracle)."""

    def __init__(self, selector):
        self.selector = selector
        self.probs = np.array([0.5, 0.3, 0.2])

    def __iter__(self):
        active = np.ones(3, dtype=bool)
        k = 0
        while True:
            i = self.selector.choose(self.probs, active)
            self.selector.update(i, 100 + 37 * i, self.probs)
            k += 1
            yield i

    def state_dict(self):
        return self.selector.state_dict()

    def load_state_dict(self, state):
        self.selector.load_state_dict(state)


@pytest.mark.parametrize(
    "make", [lambda: Deficit(3), lambda: RandomPick(3, seed=4, stream=(0,)), lambda: RoundRobin(3)]
)
def test_selectors_resume_exactly(make):
    assert_resumes_exactly(lambda: _Picks(make()), cuts=[1, 5, 33], window=50)


# ---- the tail of a finite pass ----------------------------------------------------------------------

#: Shards of very unequal sizes, so that with 1-6 readers the readers end at different points of the
#: pass's tail while others go on (the round robin then skips the ended ones).
TAIL_SOURCES = {
    "web": shardutil.LogNormal(
        shards=(9, 7, 5, 3, 8, 6, 4, 2, 9, 5, 3, 7, 6, 2, 4, 8, 5, 3), median=90, sigma=0.7, lo=2, hi=1024, seed=20
    ),
    "code": shardutil.LogNormal(shards=(6, 3, 5, 2, 4, 1, 3), median=260, sigma=0.8, lo=2, hi=1024, seed=21),
}
#: So few samples that with many readers some have no work at all and others end after one batch.
SPARSE_SOURCES = {
    "web": shardutil.LogNormal(shards=(4,), median=600, sigma=0.3, lo=2, hi=1024, seed=22),
    "code": shardutil.LogNormal(shards=(2,), median=700, sigma=0.3, lo=2, hi=1024, seed=23),
}


def tail_mixture(make_sources, spec=TAIL_SOURCES, **options):
    return shardutil.mixture(
        make_sources(spec),
        weights={"web": 0.6, "code": 0.4},
        batching=mixer.TokenBudget(max_tokens=1024),
        stop="all_exhausted",
        state_every=3,
        shuffle_buffer=16,
        **options,
    )


def ends_per_reader(loader):
    """``{reader: (index of its last batch in a whole pass, its batches)}``."""
    last = {}
    for i, b in enumerate(loader):
        last[b.meta.worker] = (i, last.get(b.meta.worker, (0, 0))[1] + 1)
    return last


@pytest.mark.parametrize(
    "num_workers", [1, 2, pytest.param(3, marks=pytest.mark.slow), 4, pytest.param(5, marks=pytest.mark.slow), 6]
)
def test_every_cut_in_the_tail_of_a_finite_pass(make_sources, num_workers):
    """After a reader has ended, the others go on in the round robin without it: a resumed loader
    must continue in that order, not in a rotation counted from the batches handed out. At 3
    workers each state comes from a loader stopped at its cut instead (the others: from one pass
    that goes on)."""
    mix = tail_mixture(make_sources)
    ends = ends_per_reader(mixer.make_loader(mix, num_workers=num_workers))
    reference = assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=num_workers),
        cuts=[],
        window=1,
        tail=tail_cuts(num_workers),
        view=batch_view,
        saved="a run per cut" if num_workers == 3 else "in one pass",
    )
    n = len(reference)
    if num_workers >= 3:  # the case that went wrong: a reader ended inside the tail while two or more go on
        assert any(n - tail_cuts(num_workers) <= e < n - 2 for e, _ in ends.values()), ends
        assert len({e for e, _ in ends.values()}) == num_workers, ends


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"persistent_workers": True}, {"device": "cpu"}, {"mix": "sample"}],
    ids=["persistent", "device", "mix-sample"],
)
def test_tail_cuts_with_persistent_workers_the_device_feed_and_sample_mixing(make_sources, options):
    mix_options = {k: v for k, v in options.items() if k == "mix"}
    loader_options = {k: v for k, v in options.items() if k != "mix"}
    mix = tail_mixture(make_sources, **mix_options)
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=4, **loader_options),
        cuts=[],
        window=1,
        tail=tail_cuts(4),
        view=batch_view,
    )


@pytest.mark.slow
def test_tail_cuts_through_the_elastic_entry_point_with_the_same_shape(make_sources):
    """A list of one state per rank with the saved shape resumes batch for batch (mixer.mixing.elastic)."""
    mix = tail_mixture(make_sources)
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=4),
        cuts=[],
        window=1,
        tail=tail_cuts(4),
        view=batch_view,
        load=lambda loader, state: loader.load_state_dict([state]),
    )


@pytest.mark.parametrize("num_workers", [3, 6])
def test_tail_cuts_with_readers_that_have_no_work_or_end_after_one_batch(make_sources, num_workers):
    mix = tail_mixture(make_sources, SPARSE_SOURCES)
    ends = ends_per_reader(mixer.make_loader(mix, num_workers=num_workers))
    if num_workers == 6:
        # some readers hand out nothing, one ends with its first batch
        assert len(ends) < 6 and any(count == 1 for _, count in ends.values()), ends
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=num_workers),
        cuts=[],
        window=1,
        tail=tail_cuts(num_workers),
        view=batch_view,
    )


def test_the_turn_is_read_from_the_readers_counts():
    """Resume.turn on hand-made reader states: the reader after the highest one that handed out the most."""
    from mixer.state.checkpoint import Resume

    def readers(*counts):
        return [{"snapshot": None, "replay": c, "skips": []} for c in counts]

    assert Resume(0, readers(0, 0, 0)).turn == 0
    assert Resume(4, readers(2, 1, 1)).turn == 1  # all running: delivered % n
    assert Resume(6, readers(2, 2, 2)).turn == 0
    assert Resume(9, readers(4, 4, 1)).turn == 2  # reader 2 ended after 1: its turn comes, it is skipped
    assert Resume(8, readers(4, 1, 3)).turn == 1  # round 3 held readers 0 and 2; reader 0 handed out last
    assert Resume(8, readers(5, 1, 2)).turn == 1
    assert Resume(7, readers(3, 0, 4)).turn == 0
    with_snapshot = [
        {"snapshot": {"batches": 3}, "replay": 2, "skips": []},
        {"snapshot": None, "replay": 5, "skips": []},
    ]
    assert Resume(10, with_snapshot).turn == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_after_a_resumed_one_starts_afresh_with_persistent_workers(make_sources, num_workers):
    """Persistent workers keep their copy of the dataset across passes: the resume is for one pass."""
    mix = tail_mixture(make_sources)
    full = [batch_view(b) for b in mixer.make_loader(mix, num_workers=num_workers)]
    first = mixer.make_loader(mix, num_workers=num_workers)
    take(first, 20)
    resumed = mixer.make_loader(mix, num_workers=num_workers, persistent_workers=True)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    rest, again = [batch_view(b) for b in resumed], [batch_view(b) for b in resumed]
    assert len(rest) == len(full) - 20 and all(oracle_equal(a, b) for a, b in zip(full[20:], rest))
    assert len(again) == len(full) and all(oracle_equal(a, b) for a, b in zip(full, again))


def test_each_state_shape_has_one_builder_that_declares_its_fields(shards):
    """The loader state, a reader's state, a reader snapshot and a stream's state are built only by
    their owners' builders; the elastic re-split's stream state has exactly a stream's fields."""
    from mixer.state import checkpoint
    from mixer.stream.source_stream import SourceStream

    mix = mixture(shards)
    loader = mixer.make_loader(mix)
    take(loader, 9)
    state = loader.state_dict()
    assert tuple(state) == checkpoint.LOADER_KEYS
    assert all(tuple(r) == checkpoint.READER_KEYS for r in state["readers"])
    assert tuple(state["readers"][0]["snapshot"]) == checkpoint.SNAPSHOT_KEYS
    reader = mix.reader(mixer.plan.world.World())
    stream_state = reader.streams[0].state_dict()
    inheriting = SourceStream.inheriting_state(epoch=3, buffer_size=8, buffer=[(1, 512)], inherit=[])
    assert tuple(inheriting) == tuple(stream_state) and set(inheriting) == set(SourceStream.STATE_DEPTHS)
    reader.streams[0].load_state_dict(inheriting)  # a stream takes it as its own
