"""Connections bounded and shared: however many remote sources and streams, one process holds at most
``io_options["max_connections"]`` responses open, a stream beyond them waits its turn instead of timing
out, and a stream that gives its connection away resumes at its next byte.

Connections are counted by the server (`FaultyHTTPServer(count_connections=True)`): one counts from
the accept until the client closes its end, so what the kernel buffered for a client still counts.
The invariant of every test: each stream delivers exactly its file's bytes, each sample exactly once.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultyHTTPServer, remote_guard, s3_storage_options  # noqa: F401 (remote_guard: a module-wide autouse fixture)
from shardutil import expected_tokens, token_key, write_token_shards

import mixer
from mixer import storage as mio
from mixer.errors import ShardError
from mixer.storage.filesystems import close_filesystems
from mixer.storage.options import DEFAULT_MAX_CONNECTIONS

FILES = 12
FILE_SIZE = 150_001


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conns")


@pytest.fixture(scope="module")
def files(folder: Path) -> dict[str, bytes]:
    """``bucket/f00.bin .. f11.bin``: random bytes (a folder the server serves, or a bucket when it poses as S3)."""
    (folder / "bucket").mkdir()
    out = {}
    for i in range(FILES):
        name = f"bucket/f{i:02d}.bin"
        out[name] = random.Random(i).randbytes(FILE_SIZE)
        (folder / name).write_bytes(out[name])
    return out


@pytest.fixture(scope="module")
def server(folder: Path, files: dict[str, bytes]) -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(folder, count_connections=True) as s:
        yield s
        close_filesystems()


def _wait_closed(server: FaultyHTTPServer, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while server.open_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.open_connections == 0, f"{server.open_connections} connection(s) left open"


@pytest.mark.parametrize("transport", ["http", "s3"])
def test_streams_beyond_the_pool_take_turns(server: FaultyHTTPServer, files: dict[str, bytes], transport: str) -> None:
    # 12 shards open at once, read a few KB at a time in turn, with 3 connections for all of them and
    # a 4 KiB block (so a stream not being read fills its buffer and stays idle on its connection):
    # each opening and each read beyond the third stream makes an idle one give its connection up.
    limit = 3
    _wait_closed(server)
    server.clear()
    server.peak_connections = 0
    if transport == "http":
        url, options = server.url, None
    else:
        options = s3_storage_options(server.url().rstrip("/"))
        url = lambda path: f"s3://{path}"  # noqa: E731
    # A 30 s timeout: giving way is not a fault, and a machine loaded by parallel jobs must not make a
    # healthy answer look stalled either (a stream that gave way asks again too, so the server's log
    # cannot tell such a retry from giving way).
    kw: dict[str, Any] = {"timeout": 30.0, "block_size": 4096, "max_connections": limit, "backoff": 0.01}
    names = sorted(files)
    streams = [mio.open_shard(url(name), storage_options=options, **kw) for name in names]
    got: list[list[bytes]] = [[] for _ in names]
    live = list(range(len(names)))
    rng = random.Random(0)
    try:
        while live:
            i = rng.choice(live)
            data = streams[i].read(rng.randrange(1, 20_000))
            if data:
                got[i].append(data)
            else:
                live.remove(i)
    finally:
        for s in streams:
            s.close()
    for i, name in enumerate(names):
        assert b"".join(got[i]) == files[name], name
        # giving way is not a fault: the retries are those of the faults the server served (none)
        assert streams[i].retries == sum(r.retriable for r in server.served(name)) == 0
    assert server.peak_connections <= limit
    # Streams did give way and resume where they were: ranged GETs from inside the files.
    resumed = [r for r in server.requests() if r.start]
    assert resumed, "no stream ever gave its connection up"
    assert all(r.status == 206 for r in resumed)
    close_filesystems()  # (botocore keeps finished connections alive in its own pool)
    _wait_closed(server)


def test_an_idle_stream_lets_its_connection_go(server: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # A stream read a little, then left alone (its source not picked) for longer than its timeout:
    # its connection is closed meanwhile, and reading on resumes at the next byte, exactly.
    _wait_closed(server)
    server.clear()
    name = sorted(files)[0]
    stream = mio.open_shard(server.url(name), timeout=0.3, block_size=4096)
    try:
        head = stream.read(1000)
        assert server.open_connections == 1
        _wait_closed(server, 3.0)  # idle for the timeout: the connection is gone, the stream is not
        rest = stream.read()
    finally:
        stream.close()
    assert head + rest == files[name]
    assert stream.retries == 0
    starts = [r.start for r in server.requests(name)]
    assert starts[0] is None and len(starts) == 2 and starts[1] is not None and starts[1] >= 1000, starts


@pytest.mark.slow
def test_a_wedged_pool_is_a_clear_error(server: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # The only connection is held by a read whose reader waits on it while the server says nothing
    # for 12 s (that read has a 30 s timeout): another read cannot make progress, and says why,
    # after its own timeout + 5 s instead of queueing forever.
    _wait_closed(server)
    server.clear()
    names = sorted(files)
    server.fail(names[0], "hang", seconds=12.0)
    hung: list[BaseException] = []

    def hold() -> None:
        try:
            mio.open_shard(server.url(names[0]), timeout=30.0, retries=0, max_connections=1).close()
        except BaseException as exc:  # noqa: BLE001
            hung.append(exc)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(ShardError) as info:
            mio.open_shard(server.url(names[1]), timeout=0.5, retries=2, max_connections=1)
        waited = time.monotonic() - start
    finally:
        thread.join()
    message = str(info.value)
    assert "no connection free for 6s" in message and "max_connections=1" in message, message
    assert "retries" not in message  # not a fault to retry: said once
    assert 5.0 < waited < 11.0
    server.clear()
    _wait_closed(server, 10.0)


# ----------------------------------------------------------------------------- many sources


def _mixture_pass(
    urls: list[str], workers: int, io_options: dict[str, Any] | None, shuffle_buffer: int = 1000, max_tokens: int = 4096
) -> list[str]:
    sources = [mixer.Source(f"s{i:03d}", u, io_options=io_options) for i, u in enumerate(urls)]
    batching = mixer.TokenBudget(max_tokens=max_tokens)
    mix = mixer.Mixture(sources, batching=batching, stop="all_exhausted", seed=0, shuffle_buffer=shuffle_buffer)
    loader = mixer.make_loader(mix, num_workers=workers)
    keys = []
    try:
        for batch in loader:
            for b, key in enumerate(batch.keys):
                n = int(batch.lengths[b])
                assert np.array_equal(batch.tokens[b, :n].numpy(), expected_tokens(key, n)), key
                keys.append(key)
    except Exception as exc:
        traceback.clear_frames(exc.__traceback__)  # see test_remote_mixture.run
        raise
    return keys


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """200 sources ``m000 .. m199`` of 2 shards of 3 samples each (lengths 8..200)."""
    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(14)
    expected: dict[str, list[str]] = {}
    for i in range(200):
        name = f"m{i:03d}"
        write_token_shards(root / name, name, [rng.integers(8, 200, 3).tolist() for _ in range(2)])
        expected[name] = [token_key(name, s, j) for s in range(2) for j in range(3)]
    return root, expected


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """12 sources ``b00 .. b11`` of one shard of 20 samples of 20000-30000 tokens (~2 MB a shard):
    bigger than the tar reader's 1 MiB reads, so that a source read a little holds its response
    open, its stream idle on a full buffer."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(15)
    expected: dict[str, list[str]] = {}
    for i in range(12):
        name = f"b{i:02d}"
        write_token_shards(root / name, name, [rng.integers(20000, 30000, 20).tolist()])
        expected[name] = [token_key(name, 0, j) for j in range(20)]
    return root, expected


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_200_http_sources_with_default_options(many: tuple[Path, dict[str, list[str]]], workers: int) -> None:
    # Before the pool, each reader held (1 + read_ahead) responses per source on a client pool of
    # 100, and the job failed above ~33 sources. Now: every sample of every source exactly once,
    # and never more connections than the pool per process (the main process's profiling reads
    # are over before the workers start).
    root, expected = many
    names = list(expected)
    with FaultyHTTPServer(root, count_connections=True) as server:
        urls = [server.url(f"{n}/{n}-{{000000..000001}}.tar") for n in names]
        try:
            keys = _mixture_pass(urls, workers, None)
        finally:
            close_filesystems()
        peak = server.peak_connections
    assert len(keys) == len(set(keys)), "a sample was delivered twice"
    assert set(keys) == {k for n in names for k in expected[n]}
    assert 1 <= peak <= DEFAULT_MAX_CONNECTIONS * max(workers, 1), peak


@pytest.mark.parametrize("workers", [0, 2])
def test_idle_streams_give_way(big: tuple[Path, dict[str, list[str]]], workers: int) -> None:
    # 12 sources read a few samples at a time (a shuffle buffer of 2), whose shards outlast the tar
    # reader's reads, 3 connections per process: the streams of the sources not being read idle on
    # full buffers, holding their connections, and must give way, or the mixture would stop.
    root, expected = big
    names = list(expected)
    limit = 3
    with FaultyHTTPServer(root, count_connections=True) as server:
        urls = [server.url(f"{n}/{n}-000000.tar") for n in names]
        try:
            options = {"block_size": 64 << 10, "max_connections": limit, "timeout": 10.0}
            keys = _mixture_pass(urls, workers, options, shuffle_buffer=2, max_tokens=32768)
        finally:
            close_filesystems()
        peak = server.peak_connections
        # A stream that gave way resumes with an open-ended ranged GET; the up-front profile's ranged
        # reads carry an end byte.
        resumed = [r for r in server.requests() if r.start and r.end is None]
        ranged = [r for r in server.requests() if r.start]
    assert len(keys) == len(set(keys)), "a sample was delivered twice"
    assert set(keys) == {k for n in names for k in expected[n]}
    assert peak <= limit * max(workers, 1), peak
    assert resumed and all(r.status == 206 for r in resumed)
    # Nothing asks for an empty range (a stream that gave way right at its end byte is done).
    assert all(r.status == 206 for r in ranged), [(r.start, r.end, r.status) for r in ranged if r.status != 206]
