"""The per-batch resume handle: ``Loader.state_dict(upto=batch)`` is the state as of that batch, however
many batches were handed out after it (a training loop that fetches ahead saves what it trained)."""

from __future__ import annotations

import functools
import json
import pickle

import pytest
import shardutil
import torch
from resume_oracle import batch_view, take
from shardutil import RESUME_SOURCES

import mixer
from mixer.errors import StateError


@pytest.fixture(scope="module")
def shards(make_sources):
    return make_sources(RESUME_SOURCES)


mixture = functools.partial(
    shardutil.mixture,
    weights={"web": 0.5, "code": 0.3, "tiny": 0.2},
    batching=mixer.TokenBudget(max_tokens=2048),
    state_every=8,
    shuffle_buffer=64,
)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_behind_the_fetch_resumes_at_the_batch_after_it(shards, num_workers):
    """Cut at ``cut`` trained batches while ``ahead`` more were fetched: the resumed stream must be
    the uninterrupted one from batch ``cut`` on (a state as of the last fetched batch would skip
    ``ahead`` batches). Cuts straddle the snapshots taken every 8 batches per reader."""
    mix = mixture(shards)
    reference = [batch_view(b) for b in take(mixer.make_loader(mix, num_workers=num_workers), 40)]
    for cut, ahead in [(1, 1), (7, 1), (8, 2), (9, 3), (17, 1), (24, 5)]:
        loader = mixer.make_loader(mix, num_workers=num_workers)
        metas = [b.meta for b in take(loader, cut + ahead)]
        state = json.loads(json.dumps(loader.state_dict(upto=metas[cut - 1])))
        assert state["delivered"] == cut
        resumed = mixer.make_loader(mix, num_workers=num_workers)
        resumed.load_state_dict(state)
        got = [batch_view(b) for b in take(resumed, 8)]
        assert all(map(_same, got, reference[cut : cut + 8])) and len(got) == 8, (
            f"cut {cut} with {ahead} fetched ahead: the resumed stream is not the uninterrupted one"
        )


def _same(a: tuple, b: tuple) -> bool:
    """Two ``batch_view``s: keys and step equal, every tensor equal."""
    return a[0] == b[0] and a[4] == b[4] and all(torch.equal(x, y) for x, y in zip(a[1:4], b[1:4]))


def test_upto_the_last_batch_is_the_loaders_own_state_and_a_batch_or_its_meta_name_the_same_point(shards):
    loader = mixer.make_loader(mixture(shards))
    batches = take(loader, 11)
    assert loader.state_dict(upto=batches[-1]) == loader.state_dict()
    assert loader.state_dict(upto=batches[4]) == loader.state_dict(upto=batches[4].meta)
    assert loader.state_dict(upto=batches[4]) != loader.state_dict()
    # each batch's position counts the batches handed out up to it
    assert [b.meta.position.delivered for b in batches] == list(range(1, 12))


def test_upto_refuses_what_is_not_a_batch_of_this_loader(shards):
    loader = mixer.make_loader(mixture(shards))
    batch = take(loader, 3)[-1]
    with pytest.raises(StateError, match=r"carries no loader position: .* pickling"):
        loader.state_dict(upto=pickle.loads(pickle.dumps(batch)))  # a pickled batch leaves its position behind
    other = take(mixer.make_loader(mixture(shards, seed=7)), 1)[0]
    with pytest.raises(StateError, match="handed out by a loader of another mixture or with another num_workers"):
        loader.state_dict(upto=other)
    with pytest.raises(StateError, match=r"expected a batch this loader handed out, or its meta \(got dict\)"):
        loader.state_dict(upto={"step": 1})  # type: ignore[arg-type]


def test_under_an_adaptive_schedule_only_the_last_batch_can_be_saved(shards):
    schedule = mixer.Adaptive(mixer.Weights({"web": 0.5, "code": 0.3, "tiny": 0.2}), update_every=4)
    loader = mixer.make_loader(mixture(shards, schedule=schedule))
    batches = take(loader, 5)
    assert loader.state_dict(upto=batches[-1]) == loader.state_dict()
    with pytest.raises(StateError, match="under an Adaptive schedule only the last batch handed out can be saved"):
        loader.state_dict(upto=batches[2])
