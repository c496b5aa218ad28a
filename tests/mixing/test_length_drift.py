"""No length drift inside a source under ``stop="never"``: each reader delivers every sample of its
part of a source-epoch once before any sample of the next (a small source of short and long
documents, whose long buckets fill first), at padding >= 0.96, and resumes exactly across the turn."""

from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np
import pytest
import shardutil
from resume_oracle import assert_resumes_exactly, batch_view, take

import mixer
from mixer.read.counters import Counters

SMALL, BIG = "small", "big"


@pytest.fixture(scope="module")
def drift_sources(tmp_path_factory):
    """'small': 192 samples in 2 shards, half of 40-90 tokens, half of 600-1000, shuffled; 'big':
    log-normal lengths, 2,000 samples."""
    rng = np.random.default_rng(5)
    small = rng.permutation(np.concatenate([rng.integers(40, 90, 96), rng.integers(600, 1000, 96)])).tolist()
    big = np.clip(np.round(rng.lognormal(np.log(250), 0.8, 2000)), 8, 2000).astype(int).tolist()
    folder = tmp_path_factory.mktemp("drift")
    out = {}
    for name, lengths, shards in ((SMALL, small, 2), (BIG, big, 4)):
        per_shard = shardutil.split_evenly(lengths, shards)
        out[name] = (shardutil.write_token_shards(folder, name, per_shard), shardutil.key_lengths(name, per_shard))
    return out


mixture = functools.partial(
    shardutil.mixture,
    weights={SMALL: 0.3, BIG: 0.7},
    batching=mixer.TokenBudget(max_tokens=8192),
    stop="never",
    state_every=4,
)


def per_reader(batches):
    """Each reader's deliveries of the small source, in order: ``{worker: [key, ...]}``."""
    keys = defaultdict(list)
    for b in batches:
        keys[b.meta.worker] += [k for k, s in zip(b.keys, b.source.tolist()) if s == 0]
    return keys


def assert_whole_epochs(keys, epochs):
    """The reader's deliveries, cut into runs of its part's size, are each its whole part once."""
    part = set(keys)
    n = len(part)
    assert len(keys) >= epochs * n, (len(keys), n)
    for e in range(epochs):
        run = keys[e * n : (e + 1) * n]
        assert len(set(run)) == n, f"epoch {e}: {n - len(set(run))} of {n} samples delivered twice before all once"


@pytest.mark.parametrize(("mix_mode", "num_workers"), [("batch", 0), ("batch", 2), ("sample", 0)])
def test_no_sample_twice_before_all_once_within_a_source_epoch(drift_sources, mix_mode, num_workers):
    if mix_mode == "batch":
        mix = mixture(drift_sources)
        batches = take(mixer.make_loader(mix, num_workers=num_workers), 260 if num_workers else 200)
    else:
        # The shared buckets close a source's epochs only while closes are rare (closing_sources):
        # here at a tenth of the tokens in batches of 2048 (at 8192 the small source turns its
        # epoch every ~30 shared batches, too often to be closed).
        mix = mixture(drift_sources, mix="sample", weights={SMALL: 0.1, BIG: 0.9}, batching=mixer.TokenBudget(2048))
        assert all(mix.reader(mixer.plan.world.World())._closes)
        batches = take(mixer.make_loader(mix, num_workers=num_workers), 1800)
    keys = per_reader(batches)
    assert len(keys) == max(num_workers, 1)
    everything = set(drift_sources[SMALL][1])
    assert set().union(*map(set, keys.values())) == everything
    for reader_keys in keys.values():
        assert_whole_epochs(reader_keys, 3)
    real = sum(int(b.lengths.sum()) for b in batches)
    padded = sum(b.tokens.numel() for b in batches)
    assert real / padded >= 0.96


def first_half_epoch(mix: mixer.Mixture, lengths: dict[str, int]) -> tuple[int, int, float]:
    """Stream until the small source (source 0, of these lengths by key) delivered half of its
    epoch's tokens: how many of its samples were short (under 100 tokens), of how many, and the
    padding efficiency of all the batches."""
    total = sum(lengths.values())
    delivered, short, n, real, padded = 0, 0, 0, 0, 0
    for b in mixer.make_loader(mix):
        real, padded = real + int(b.lengths.sum()), padded + b.tokens.numel()
        for k, s in zip(b.keys, b.source.tolist()):
            if s == 0:
                delivered += lengths[k]
                short += lengths[k] < 100
                n += 1
        if delivered >= total / 2:
            break
    return short, n, real / padded


def test_the_small_source_is_unbiased_within_its_epoch(drift_sources):
    """Over the first half of its first epoch's tokens, the small source's short documents are
    about their share of its samples (half), not held back behind the long ones (they were a
    fifth, or none, before its buckets' wait was bounded by its epoch)."""
    short, n, _ = first_half_epoch(mixture(drift_sources), drift_sources[SMALL][1])
    assert 0.35 <= short / n <= 0.65, (short, n)


@pytest.mark.parametrize("mix_mode", ["batch", "sample"])
def test_resume_across_the_turn_of_a_source_epoch_is_exact(drift_sources, mix_mode):
    mix = mixture(drift_sources, mix=mix_mode)
    epochs = [b.meta.counters[0][Counters.FIELDS.index("epochs")] for b in take(mixer.make_loader(mix), 120)]
    turns = [i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]][:3]
    assert turns, "the small source should turn over its epoch"
    cuts = sorted({c for t in turns for c in (t - 1, t, t + 1)})
    assert_resumes_exactly(lambda: mixer.make_loader(mix), cuts=cuts, window=8, view=batch_view)


def test_the_small_source_is_unbiased_within_its_epoch_in_shared_buckets(drift_sources):
    """The same with one bucketer shared by the sources (mix="sample"): the small source's short
    documents share buckets with the big source's, which fill them slowly; they were none of what it
    delivered in the first half of its epoch's tokens before the shared buckets holding its samples
    had its epoch's wait bound (those holding none of them are left to fill)."""
    mix = mixture(drift_sources, mix="sample", weights={SMALL: 0.1, BIG: 0.9}, batching=mixer.TokenBudget(4096))
    short, n, padding = first_half_epoch(mix, drift_sources[SMALL][1])
    assert 0.35 <= short / n <= 0.65, (short, n)
    assert padding >= 0.96
    bounded = mix.reader(mixer.plan.world.World()).batchers[0].bounded
    assert bounded == {0: 52}  # (the big source's epochs are not closed)


def test_resume_while_shared_buckets_leave_by_a_small_source_bound_is_exact(drift_sources):
    """The shared bucketer's bound (mix="sample") decides which buckets leave from the ages in its
    state: a resume before, amid and after the batches the bound lets out (at batches 53 to 58
    here) goes on with the same batches."""
    mix = mixture(drift_sources, mix="sample", weights={SMALL: 0.1, BIG: 0.9}, batching=mixer.TokenBudget(4096))
    assert mix.reader(mixer.plan.world.World()).batchers[0].bounded  # the bound is in force here
    assert_resumes_exactly(lambda: mixer.make_loader(mix), cuts=[17, 50, 55, 60], window=8, view=batch_view)
