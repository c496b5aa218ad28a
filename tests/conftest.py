"""Session-wide shard fixtures (written once with `webdataset.ShardWriter`; treat them as read-only)."""

from __future__ import annotations

import pytest

from shardutil import key_lengths, lognormal_lengths, split_evenly, write_token_shards

# name: (shards, samples, lognormal median, sigma, lo, hi): clearly different length distributions.
THREE_SOURCES = {
    "web": (8, 512, 200, 0.7, 8, 2048),
    "code": (4, 192, 600, 1.0, 16, 8192),
    "books": (2, 24, 4000, 0.4, 1024, 16384),
}


@pytest.fixture(scope="session")
def three_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, int]]]:
    """``{name: (brace pattern, {key: length})}``; tokens are `shardutil.expected_tokens(key, length)`."""
    folder = tmp_path_factory.mktemp("three_sources")
    sources = {}
    for seed, (name, (shards, n, median, sigma, lo, hi)) in enumerate(THREE_SOURCES.items()):
        lengths = lognormal_lengths(n, median=median, sigma=sigma, lo=lo, hi=hi, seed=seed)
        per_shard = split_evenly(lengths, shards)
        sources[name] = (write_token_shards(folder, name, per_shard), key_lengths(name, per_shard))
    return sources


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`mixer.demo.ensure_demo_shards()` in a private cache folder: ``{source: brace pattern}``."""
    from mixer.demo import ensure_demo_shards  # here, so a broken `mixer` import fails tests, not collection

    return ensure_demo_shards(tmp_path_factory.mktemp("demo_cache"))
