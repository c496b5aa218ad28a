"""End-to-end mixture behaviour on real shards written with webdataset.ShardWriter."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import shardutil
from shardutil import (
    LogNormal,
    expected_tokens,
    npy_bytes,
    write_tar_members,
    write_token_shards,
)

import mixer

WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}


def sources_from(three_sources, **kwargs):
    return [mixer.Source(name, three_sources[name][0], weight=w, **kwargs) for name, w in WEIGHTS.items()]


def collect(loader, limit=None):
    """(key, source index, tokens) of every sample delivered, checking each batch's invariants."""
    out = []
    for n, batch in enumerate(loader):
        if limit is not None and n >= limit:
            break
        lengths = batch.lengths.tolist()
        assert batch.tokens.shape == (len(lengths), max(lengths))
        for row, (key, src, length) in enumerate(zip(batch.keys, batch.source.tolist(), lengths)):
            assert (batch.tokens[row, length:] == 0).all()
            out.append((key, src, batch.tokens[row, :length].numpy().copy()))
    return out


@pytest.fixture(scope="module")
def small_sources(make_sources):
    """Two sources: 'few' has 2 shards (fewer than most reader counts), 'many' has 5."""
    return make_sources(
        {
            "few": LogNormal(shards=2, samples=37, median=40, sigma=0.6, lo=2, hi=400, seed=1),
            "many": LogNormal(shards=5, samples=61, median=40, sigma=0.6, lo=2, hi=400, seed=2),
        }
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_every_sample_exactly_once_per_source_epoch(small_sources, world_size, num_workers):
    # Invariant: with stop="all_exhausted" the union over all ranks and workers of one pass is every
    # sample of every source, each exactly once, with its exact tokens; also when a source has fewer
    # shards than readers (then readers split samples inside shards).
    seen = Counter()
    for rank in range(world_size):
        srcs = [mixer.Source(name, pattern) for name, (pattern, _) in small_sources.items()]
        mix = mixer.Mixture(
            srcs,
            batching=mixer.TokenBudget(max_tokens=1024),
            stop="all_exhausted",
            seed=5,
            rank=rank,
            world_size=world_size,
            shuffle_buffer=8,
        )
        for key, src, tokens in collect(mixer.make_loader(mix, num_workers=num_workers)):
            name = mix.names[src]
            assert key.startswith(name)
            np.testing.assert_array_equal(tokens, expected_tokens(key, small_sources[name][1][key]))
            seen[key] += 1
    expected = {k for _, kl in small_sources.values() for k in kl}
    assert set(seen) == expected
    assert max(seen.values()) == 1


def token_share(mix, batches=2000):
    """Realized token share per source over the first ``batches`` batches."""
    tokens = np.zeros(len(mix.sources))
    for batch, _ in zip(mixer.make_loader(mix), range(batches)):
        tokens += np.bincount(batch.source.numpy(), weights=batch.lengths.numpy(), minlength=len(tokens))
    return tokens / tokens.sum()


def test_deficit_tracks_token_share_within_one_point(three_sources):
    mix = mixer.Mixture(
        sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=4096, max_length=4096), seed=0
    )
    share = token_share(mix)
    assert np.abs(share - np.array(list(WEIGHTS.values()))).max() <= 0.01, share


def test_random_selector_hits_token_share_in_expectation(three_sources):
    # Random picks are independent: over 2,000 batches the token share of a source with share p
    # and roughly equal batch sizes has standard deviation about sqrt(p(1-p)/2000) <= 0.011; four
    # sigmas bound it, and a selector that ignored batch size or weights would miss by far more.
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=4096, max_length=4096),
        selector="random",
        seed=3,
    )
    share = token_share(mix)
    assert np.abs(share - np.array(list(WEIGHTS.values()))).max() <= 0.045, share


def test_round_robin_alternates_sources(three_sources):
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=4096, max_length=4096),
        selector="round_robin",
    )
    firsts = [int(b.source[0]) for _, b in zip(range(9), mixer.make_loader(mix))]
    assert firsts == [0, 1, 2] * 3


def test_padding_efficiency_on_lognormal_mix(make_sources):
    # Long-tailed lengths (sigma 1.0-1.2) where count quantiles waste 15-25%.
    srcs = make_sources(
        {
            "a": LogNormal(shards=4, samples=6000, median=120, sigma=1.0, lo=1, hi=16384, seed=0),
            "b": LogNormal(shards=4, samples=6000, median=900, sigma=1.2, lo=1, hi=16384, seed=1),
        }
    )
    mix = shardutil.mixture(
        srcs, weights={"a": None, "b": None}, batching=mixer.TokenBudget(max_tokens=16384), stop="all_exhausted"
    )
    real = slots = 0
    for batch in mixer.make_loader(mix):
        assert batch.batch_size * batch.seq_len <= 16384
        real += batch.num_tokens
        slots += batch.batch_size * batch.seq_len
    assert real / slots >= 0.90


def test_same_seed_same_batches_other_seed_other_order(three_sources):
    def keys(seed, workers=0):
        mix = mixer.Mixture(
            sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=4096, max_length=4096), seed=seed
        )
        return [k for b, _ in zip(mixer.make_loader(mix, num_workers=workers), range(40)) for k in b.keys]

    a = keys(0)
    assert a == keys(0)
    assert a != keys(1)
    assert keys(0, workers=2) == keys(0, workers=2)


def test_zero_and_two_workers_give_the_same_multiset(three_sources):
    def delivered(workers):
        mix = mixer.Mixture(
            sources_from(three_sources),
            batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
            stop="all_exhausted",
        )
        return Counter(k for k, _, _ in collect(mixer.make_loader(mix, num_workers=workers)))

    zero, two = delivered(0), delivered(2)
    assert zero == two
    assert set(zero.values()) == {1}
    assert len(zero) == sum(len(kl) for _, kl in three_sources.values())


def test_never_restarts_sources_with_a_new_reshuffled_epoch(small_sources):
    # Invariant at the source level: with stop="never" a reader's stream of one source is its
    # epochs back to back, each one exactly once, each in a new order.
    from mixer.plan.profiling import list_source
    from mixer.plan.world import World
    from mixer.read.counters import Counters
    from mixer.stream.source_stream import SourceStream

    # shuffle_buffer=0 so that epochs do not overlap in the output; the order then changes only
    # through the per-epoch shard order, hence the 5-shard source.
    source = list_source(mixer.Source("many", small_sources["many"][0]))
    stream = SourceStream(
        source,
        World(),
        seed=1,
        budget=mixer.TokenBudget(max_tokens=512),
        shuffle_buffer=0,
        finite=False,
        counters=Counters(),
    )
    keys = [next(stream).key for _ in range(3 * 61)]
    epochs = [keys[i * 61 : (i + 1) * 61] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(small_sources["many"][1])
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert stream.counters.epochs >= 2


def test_never_keeps_delivering_every_sample(small_sources):
    # End to end, bucket buffers may hold a rare-length sample back for a few epochs, but over many
    # epochs every sample keeps coming back and none runs ahead of the epochs read.
    srcs = [mixer.Source(name, pattern) for name, (pattern, _) in small_sources.items()]
    # A shuffle buffer larger than an epoch would mix ~27 epochs of 'few': keep it small here.
    mix = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=512, max_wait=8), seed=1, shuffle_buffer=8)
    few = Counter()
    for batch in mixer.make_loader(mix):
        few.update(k for k, s in zip(batch.keys, batch.source.tolist()) if s == 0)
        if sum(few.values()) >= 12 * 37:
            break
    assert set(few) == set(small_sources["few"][1])
    # 12 epochs delivered; the shuffle and bucket buffers let reading run ahead by a little.
    assert min(few.values()) >= 10 and max(few.values()) <= 14


def test_first_exhausted_stops_at_the_first_finished_source(small_sources):
    srcs = [mixer.Source(name, pattern, weight=w) for (name, (pattern, _)), w in zip(small_sources.items(), (0.9, 0.1))]
    mix = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=512), stop="first_exhausted")
    got = collect(mixer.make_loader(mix))
    by_source = Counter(src for _, src, _ in got)
    assert by_source[0] == 37  # 'few' is drawn 90% of the time and finishes its pass first
    assert by_source[1] < 61
    assert len({k for k, _, _ in got}) == len(got)


def test_sample_mix_mixes_within_batches_and_keeps_exactly_once(three_sources):
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
        mix="sample",
        stop="all_exhausted",
    )
    got = collect(mixer.make_loader(mix))
    assert Counter(k for k, _, _ in got) == Counter({k: 1 for _, kl in three_sources.values() for k in kl})
    mix2 = mixer.Mixture(
        sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=8192, max_length=8192), mix="sample"
    )
    mixed = sum(len(set(b.source.tolist())) > 1 for b, _ in zip(mixer.make_loader(mix2), range(50)))
    assert mixed > 10


def test_sample_unit_balances_sample_counts(three_sources):
    mix = mixer.Mixture(
        sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=4096, max_length=4096), unit="samples"
    )
    counts = np.zeros(3)
    for batch, _ in zip(mixer.make_loader(mix), range(600)):
        counts += np.bincount(batch.source.numpy(), minlength=3)
    share = counts / counts.sum()
    # Sample shares track the weights within a batch's worth of samples.
    assert np.abs(share - np.array(list(WEIGHTS.values()))).max() <= 0.02, share


def test_temperature_uses_source_sizes(three_sources):
    srcs = sources_from(three_sources)
    t1 = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=16384), schedule=mixer.Temperature(1.0))
    sizes = np.array(list(t1.sizes.values()))
    np.testing.assert_allclose(t1.target_at(0, 0), sizes / sizes.sum())
    t_big = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=16384), schedule=mixer.Temperature(1e6))
    np.testing.assert_allclose(t_big.target_at(0, 0), np.full(3, 1 / 3), atol=1e-4)


def test_size_estimate_is_close_and_reported(three_sources):
    mix = mixer.Mixture(sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=16384))
    for name, (_, kl) in three_sources.items():
        true = sum(kl.values())
        assert 0.8 * true <= mix.sizes[name] <= 1.25 * true, (name, mix.sizes[name], true)
    given = mixer.Mixture(
        [mixer.Source("web", three_sources["web"][0], size=123.0)],
        batching=mixer.TokenBudget(max_tokens=4096, max_length=4096),
    )
    assert given.sizes == {"web": 123.0}


def test_overlong_samples_are_truncated_or_dropped_and_counted(tmp_path):
    pattern = write_token_shards(tmp_path, "s", [[10, 500, 20, 700]])
    for overlong, lengths in (("truncate", [10, 100, 20, 100]), ("drop", [10, 20])):
        mix = mixer.Mixture(
            [mixer.Source("s", pattern)],
            batching=mixer.TokenBudget(max_tokens=400, max_length=100, overlong=overlong),
            stop="all_exhausted",
        )
        loader = mixer.make_loader(mix)
        got = sorted(len(t) for _, _, t in collect(loader))
        assert got == sorted(lengths)
        c = loader.counters()["s"]
        assert (c["truncated"], c["dropped"]) == ((2, 0) if overlong == "truncate" else (0, 2))


# ---- bad input: clear errors naming the thing and the rule -------------------------------------


def test_error_empty_sources():
    with pytest.raises(mixer.ConfigError, match="at least one Source"):
        mixer.Mixture([], batching=mixer.TokenBudget(max_tokens=10))


@pytest.mark.parametrize("weight", [-1, float("nan"), float("inf")])
def test_error_bad_weight(three_sources, weight):
    with pytest.raises(mixer.ConfigError, match=r"^Source\('web'\)\.weight: must be (>= 0|finite), got "):
        mixer.Source("web", three_sources["web"][0], weight=weight)


def test_error_all_zero_weights(three_sources):
    srcs = [mixer.Source(n, three_sources[n][0], weight=0) for n in WEIGHTS]
    with pytest.raises(mixer.ConfigError, match="positive finite sum"):
        mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=16384))


def test_error_duplicate_names(three_sources):
    srcs = [mixer.Source("web", three_sources["web"][0]), mixer.Source("web", three_sources["code"][0])]
    with pytest.raises(mixer.ConfigError, match=r"duplicate source names \['web'\]"):
        mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=16384))


def test_error_pattern_matches_nothing(tmp_path):
    # Shards are listed when the mixture is built (a Source does no I/O), and the error names the source.
    budget = mixer.TokenBudget(max_tokens=10)
    with pytest.raises(mixer.MixerError, match=r"source 'ghost'.*nope-000\.tar.*No such file"):
        mixer.Mixture([mixer.Source("ghost", str(tmp_path / "nope-{000..003}.tar"))], batching=budget)
    with pytest.raises(mixer.MixerError, match="source 'ghost'"):
        mixer.Mixture([mixer.Source("ghost", str(tmp_path / "*.tar"))], batching=budget)


def test_error_sample_without_tokens_names_shard_and_key(tmp_path):
    good = npy_bytes(np.arange(1, 6, dtype=np.int32))
    path = write_tar_members(
        tmp_path / "bad-000000.tar", [("a.tokens.npy", good), ("b.json", b"{}"), ("c.tokens.npy", good)]
    )
    # The up-front profile already reads the shard: the error surfaces at construction.
    with pytest.raises(mixer.SampleError, match=r"bad-000000\.tar.*'b'"):
        mixer.Mixture([mixer.Source("bad", path)], batching=mixer.TokenBudget(max_tokens=64))
    # With on_error="skip" the sample is skipped and counted, the others delivered.
    with pytest.warns(RuntimeWarning, match=r"skipping bad sample.*'b': no token member.*while profiling"):
        mix = mixer.Mixture(
            [mixer.Source("bad", path, on_error="skip")],
            batching=mixer.TokenBudget(max_tokens=64),
            stop="all_exhausted",
        )
    assert mix.profiles[0].skipped == 1
    loader = mixer.make_loader(mix)
    with pytest.warns(RuntimeWarning, match="skipping bad sample"):
        keys = sorted(k for k, _, _ in collect(loader))
    assert keys == ["a", "c"]
    assert loader.counters()["bad"]["skipped_samples"] == 1


# One judge of length for the up-front profile and for the readers (issue 12, item 5): the same
# error, naming source, shard and key, and the same on_error policy.
OVERLONG = (
    r"source '{}': shard \S*{}-000000\.tar, key '{}': length {} exceeds max_tokens=512; set "
    r"TokenBudget\(max_length=\.\.\. to truncate or drop"
)


def test_error_sample_longer_than_budget_found_while_profiling(tmp_path):
    # the 6th sample of the only shard is too long: the profile (which reads the first 2,048) meets it
    pattern = write_token_shards(tmp_path, "early", [[10] * 5 + [900] + [10] * 5])
    with pytest.raises(mixer.SampleError, match=OVERLONG.format("early", "early", "early-000000-000005", 900)):
        mixer.Mixture([mixer.Source("early", pattern)], batching=mixer.TokenBudget(max_tokens=512))


def test_a_sample_longer_than_budget_found_while_profiling_is_skipped_and_counted(tmp_path):
    pattern = write_token_shards(tmp_path, "early", [[10] * 5 + [900] + [10] * 5])
    with pytest.warns(
        RuntimeWarning,
        match=r"skipping bad sample\(s\) in shard .*early-000000\.tar.*'early-000000-000005': length 900 "
        r"exceeds.*while profiling",
    ):
        mix = mixer.Mixture(
            [mixer.Source("early", pattern, on_error="skip")],
            batching=mixer.TokenBudget(max_tokens=512),
            stop="all_exhausted",
        )
    assert mix.profiles[0].skipped == 1
    assert sorted(mix.profiles[0].lengths.tolist()) == [10] * 10  # the skipped sample measures nothing
    # the readers meet it again, skip it again and count it; everything else is delivered
    loader = mixer.make_loader(mix)
    with pytest.warns(
        RuntimeWarning, match=r"skipping bad sample.*'early-000000-000005': length 900 exceeds max_tokens=512"
    ):
        keys = sorted(k for k, _, _ in collect(loader))
    assert keys == [f"early-000000-{i:06d}" for i in range(11) if i != 5]
    assert loader.counters()["early"]["skipped_samples"] == 1
    # a sample the budget truncates is no error, up front or later
    mix = mixer.Mixture(
        [mixer.Source("early", pattern)],
        batching=mixer.TokenBudget(max_tokens=512, max_length=512),
        stop="all_exhausted",
    )
    assert mix.profiles[0].skipped == 0 and 900 in mix.profiles[0].lengths.tolist()  # measured before the cut
    loader = mixer.make_loader(mix)
    assert len(collect(loader)) == 11 and loader.counters()["early"]["truncated"] == 1


def test_error_sample_longer_than_budget_found_while_streaming(tmp_path):
    # The profile reads a prefix only; a long sample found later is an error naming shard and key.
    lengths = [[10] * 3000 + [900]]
    pattern = write_token_shards(tmp_path, "late", lengths)
    mix = mixer.Mixture(
        [mixer.Source("late", pattern)],
        batching=mixer.TokenBudget(max_tokens=512),
        stop="all_exhausted",
        shuffle_buffer=0,
    )
    with pytest.raises(mixer.SampleError, match=OVERLONG.format("late", "late", "late-000000-003000", 900)):
        collect(mixer.make_loader(mix))


def test_error_bad_enums(three_sources):
    srcs = sources_from(three_sources)
    budget = mixer.TokenBudget(max_tokens=16384)
    for kwargs, msg in (
        ({"selector": "greedy"}, "Mixture.selector: must be one of"),
        ({"stop": "sometimes"}, "Mixture.stop: must be one of"),
        ({"mix": "token"}, "Mixture.mix: must be"),
        ({"unit": "bytes"}, "Mixture.unit: must be"),
        ({"dtype": "float32"}, "Mixture.dtype: must be one of"),
    ):
        with pytest.raises(mixer.ConfigError, match=msg):
            mixer.Mixture(srcs, batching=budget, **kwargs)


def test_shuffle_buffer_never_spans_several_epochs_of_a_small_source(small_sources):
    # 'few' has 37 samples, far fewer than the buffer: the buffer hands out all of an epoch before
    # it reads the next, so every 37 samples in a row are the whole source once, and the stream
    # says when it turns (on_epoch) before it hands out the new epoch's first sample.
    from mixer.plan.profiling import list_source
    from mixer.plan.world import World
    from mixer.read.counters import Counters
    from mixer.stream.source_stream import SourceStream

    stream = SourceStream(
        list_source(mixer.Source("few", small_sources["few"][0])),
        World(),
        seed=0,
        budget=mixer.TokenBudget(max_tokens=512),
        shuffle_buffer=1000,
        finite=False,
        counters=Counters(),
    )
    turns, keys = [], []
    stream.on_epoch = lambda: turns.append((len(keys), stream.epoch))
    for _ in range(10 * 37):
        keys.append(next(stream).key)
    assert turns == [(37 * e, e) for e in range(1, 10)]
    assert stream.epoch == 9 and stream.buffer_size == 1000 and stream.counters.epochs == 9
    for e in range(10):
        assert len(set(keys[37 * e : 37 * (e + 1)])) == 37
    assert len(set(keys[:37])) == len(set(small_sources["few"][1])) == 37
    # shuffled anew each epoch
    assert keys[:37] != keys[37:74]


def test_fewer_shards_than_readers_warns_that_io_is_amplified(small_sources, caplog):
    srcs = [mixer.Source(name, pattern) for name, (pattern, _) in small_sources.items()]
    mix = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=1024), stop="all_exhausted", rank=0, world_size=3)
    with caplog.at_level("WARNING", logger="mixer.mixing.mixture"):
        collect(mixer.make_loader(mix))
    amplified = [r.getMessage() for r in caplog.records if "I/O amplified" in r.getMessage()]
    assert len(amplified) == 1 and "source 'few' has 2 shard(s) for 3 readers" in amplified[0]  # 'many' has 5


def test_a_plain_dataloader_over_the_mixture_works(three_sources):
    # The Mixture is an IterableDataset on its own: batch_size=None, workers, pinning all work
    # without make_loader (batches then cross by value).
    from torch.utils.data import DataLoader

    mix = mixer.Mixture(
        sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=8192, max_length=8192), stop="all_exhausted"
    )
    plain = Counter(k for b in DataLoader(mix, batch_size=None, num_workers=2) for k in b.keys)
    ours = Counter(k for k, _, _ in collect(mixer.make_loader(mix, num_workers=2)))
    assert plain == ours and set(plain.values()) == {1}


@pytest.mark.slow
def test_a_rare_source_reads_about_what_it_delivers(make_sources):
    """Issue 12, item 9: a source at a 0.5% share used to fill its whole shuffle buffer and nearly
    every bucket (about num_buckets batches of tokens, several of its epochs when small) to hand
    out a batch now and then. What it holds ahead is now sized by its share: its shuffle buffer
    keeps MIN_SHUFFLE samples, its buckets about 2 batches of padded tokens."""
    from mixer.mixing.holding import HOLD_MIN_BATCHES, MIN_SHUFFLE
    from mixer.plan.world import World

    srcs = make_sources(
        {
            "common": LogNormal(shards=4, samples=6000, median=30, sigma=0.7, lo=2, hi=400, seed=0),
            "rare": LogNormal(shards=4, samples=6000, median=30, sigma=0.7, lo=2, hi=400, seed=1),
        }
    )
    budget = mixer.TokenBudget(max_tokens=4096)
    mix = shardutil.mixture(
        srcs, weights={"common": 0.995, "rare": 0.005}, batching=budget, shuffle_buffer=1000, seed=3
    )
    reader = mix.reader(World(rank=0, world_size=1, worker=0, num_workers=1))
    rare, bucketer, stream = reader.counters[1], reader.batchers[1], reader.streams[1]
    hold = int(HOLD_MIN_BATCHES * budget.max_tokens)
    most_held = 0
    for batch, _ in zip(reader, range(400)):
        most_held = max(most_held, bucketer.held)
        assert len(stream.buffer) <= MIN_SHUFFLE
        # nothing read is lost: it was delivered or it waits in a buffer
        assert rare.read - rare.samples == len(stream.buffer) + len(bucketer)
    assert reader._holds[1] == hold
    assert rare.batches >= 2  # it was read, and released batches before its buckets filled up
    assert hold / 2 < most_held <= hold + max(mix.edges[1])
    held_samples = rare.read - rare.samples
    assert held_samples <= MIN_SHUFFLE + (hold + max(mix.edges[1])) // min(mix.edges[1])
    # the common source is not capped: its buckets hold what they naturally do
    assert reader._holds[0] == len(mix.edges[0]) * budget.max_tokens
