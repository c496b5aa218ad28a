"""The ``retries`` counter adds up under faults while shards are still being read.

A retry is counted when it is made, not when its shard closes: the counters a batch carries (and so
``loader.counters()``, ``loader.stats()`` and the report made of them) include the retries of the
shards a reader is in the middle of, and so do the states saved then. What is compared: the
retries the loader reports mid-shard with what the loopback server saw (`FaultyHTTPServer`: each
GET that asked again after a retriable fault it served), never with timing.

Set-up: one source of two shards, each far longer than what the test takes from it (so no shard
closes), read without a shuffle buffer and with one bucket (so a batch reads about what it holds),
its size and edges given (so the up-front look reads nothing and the faults reach the readers).
Each shard's first three GETs end cleanly after 16 kB (``close``: an incomplete body, a transient
fault); the reader resumes at the next byte each time, so each shard read makes exactly three
retries, all before the first batch it gives is cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from servers import FaultyHTTPServer, remote_guard, resends  # noqa: F401 (remote_guard: a module-wide autouse fixture)
from shardutil import expected_tokens, write_token_shards

import mixer

SHARDS = 2
PER_SHARD = 600
FAULTS = 3  # per shard
BATCHES = 12  # well inside the shards: 12 samples a batch (one bucket of 320 tokens), 600 a shard


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("retry_counts")
    rng = np.random.default_rng(24)
    write_token_shards(folder / "data", "r", [rng.integers(100, 300, PER_SHARD).tolist() for _ in range(SHARDS)])
    return folder


@pytest.fixture
def http(root: Path) -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(root) as server:
        yield server


@pytest.mark.parametrize("workers", [0, 2])
def test_retries_are_counted_mid_shard_as_the_server_served_them(http: FaultyHTTPServer, workers: int) -> None:
    source = mixer.Source(
        "r",
        http.url(f"data/r-{{000000..{SHARDS - 1:06d}}}.tar"),
        size=1e6,
        io_options={"timeout": 30.0, "retries": 5, "backoff": 0.01, "read_ahead": 0},
    )
    mix = mixer.Mixture(
        [source], batching=mixer.TokenBudget(4096, buckets=[320]), shuffle_buffer=1, stop="all_exhausted"
    )
    assert http.requests() == []  # nothing read up front: every fault below reaches a reader
    paths = [f"data/r-{i:06d}.tar" for i in range(SHARDS)]
    for path in paths:
        http.fail(path, "close", after=16 << 10, times=FAULTS)
    loader = mixer.make_loader(mix, num_workers=workers)
    it = iter(loader)
    try:
        for _ in range(BATCHES):
            batch = next(it)
            for key, row, n in zip(batch.keys, batch.tokens.numpy(), batch.lengths.tolist()):
                assert np.array_equal(row[:n], expected_tokens(key, n)), key  # resumed at the exact byte
        counters = loader.counters()["r"]
        stats = loader.stats()
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    # Mid-shard: no shard has closed, yet every retry made so far is counted. (One reader reads the
    # shards one after the other: in the first; two readers each in its own.)
    opened = counters["shards_opened"]
    assert counters["shards_finished"] == 0 and opened == (1 if workers == 0 else SHARDS), counters
    served = [r for r in http.served() if r.fault]
    asked_again = sum(resends(http.requests(path)).after_fault for path in paths)
    assert len(served) == opened * FAULTS and all(r.fault == "close" for r in served), served
    assert counters["retries"] == asked_again == opened * FAULTS, (counters, asked_again)
    assert stats["sources"]["r"]["total"]["retries"] == opened * FAULTS  # (what `mixer run --report` writes)
