"""`ShardList`: a source's shard URLs held compactly, equal item for item to the list it came from."""

from __future__ import annotations

import pickle

import pytest

import mixer
from mixer.spec.source import ListedSource
from mixer.storage import ShardList, expand_urls


@pytest.mark.parametrize(
    "urls",
    [
        [f"s3://bucket/web/shard-{i:06d}.tar" for i in range(1000)],  # a brace range: kept as a run
        [f"http://host/a-{i}.tar" for i in range(8, 13)],  # unpadded numbers crossing a width: not a run
        ["s3://b/x-000001.tar", "s3://b/x-000003.tar", "s3://b/x-000010.tar"],  # gaps
        ["/data/web/part-a.tar", "/data/web/part-b.tar.gz", "/data/web/zz.tgz"],  # no numbers at all
        ["/data/only-one.tar"],
        ["/d/x-0099.tar", "/d/x-0100.tar", "/d/x-0101.tar"],  # the prefix eats the shared digits
        [],
    ],
)
def test_equals_the_list_it_was_built_from(urls):
    shards = ShardList(urls)
    assert len(shards) == len(urls) and list(shards) == urls and shards == urls
    assert [shards[i] for i in range(-len(urls), len(urls))] == urls + urls
    assert shards[1:4] == urls[1:4] and shards[::-2] == urls[::-2]
    again = pickle.loads(pickle.dumps(shards))
    assert again == shards and list(again) == urls and hash(again) == hash(shards)
    with pytest.raises(IndexError, match="out of range"):
        shards[len(urls)]


def test_a_brace_range_costs_nothing_per_shard_and_a_listing_a_few_bytes():
    n = 100_000
    brace = [f"s3://bucket/lang=sw/shard-{i:06d}.tar" for i in range(n)]
    run = ShardList(brace)
    assert run.nbytes() < 100 and len(pickle.dumps(run)) < 1000  # vs ~4 MB as a pickled tuple
    assert len(pickle.dumps(tuple(brace))) > 3_000_000
    listed = [u for i, u in enumerate(brace) if i % 7]  # a listing with holes: no run
    parts = ShardList(listed)
    assert parts.nbytes() <= 16 * len(listed) and list(parts) == listed


def test_a_mixture_lists_its_shards_compactly_and_fingerprints_the_same_urls(make_sources):
    from shardutil import LogNormal

    sources = make_sources({"web": LogNormal(shards=12, samples=60, median=50, sigma=0.5, seed=4)})
    pattern = sources["web"][0]
    mix = mixer.Mixture([mixer.Source("web", pattern)], batching=mixer.TokenBudget(1024), seed=0)
    listed = mix.listed[0]
    assert isinstance(listed.shards, ShardList) and listed.shards._width > 0  # kept as a run
    urls = [u for u, _ in expand_urls(pattern)]
    assert list(listed.shards) == urls
    # The fingerprint sees the same URLs as a plain tuple gives (checkpoints of before still load).
    plain = ListedSource(listed.source, tuple(urls), listed.shard_bytes)
    assert plain.describe() == listed.describe()
