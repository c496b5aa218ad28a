"""The I/O layer against real servers on 127.0.0.1: exact bytes, exact resume points, clear errors.

The invariant every streaming test checks: the bytes a stream delivers are exactly the file's bytes from
``start_offset`` on, whatever the server does in between (no byte lost, none repeated), and a resume asks
for the first byte the client had not received (the server's request log shows the Range).
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers
from servers import FaultyHTTPServer, make_bucket, s3_server, s3_storage_options

from mixer import storage as mio
from mixer.errors import ConfigError, ShardError
from mixer.storage.filesystems import close_filesystems

SIZE = 300_007  # not a multiple of any block or chunk size used below
# Retries wait ~10 ms. Reads time out after 30 s, so that a machine loaded by parallel jobs never
# makes a healthy response look stalled (retries are counted exactly); tests that make the server
# stall or not answer use STALLS, which detects it after 0.5 s.
FAST = {"timeout": 30.0, "backoff": 0.01}
STALLS = {"timeout": 0.5, "backoff": 0.01}


def _payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _read_all(stream: Any, chunk: int) -> bytes:
    parts = []
    while True:
        data = stream.read(chunk)
        if not data:
            return b"".join(parts)
        assert len(data) == chunk or not stream.read(1), "read(n) returned short before the end"
        parts.append(data)


def _ranges(server: FaultyHTTPServer, path: str) -> list[tuple[int | None, int]]:
    """(Range start, status) of every GET of ``path``: None = no Range header (from byte 0)."""
    return [(r.start, r.status) for r in server.requests(path)]


def _served(server: FaultyHTTPServer, path: str) -> list[str]:
    """The faults the server served the GETs of ``path``, in order."""
    return [r.fault for r in server.served(path)]


def _retried(server: FaultyHTTPServer, path: str) -> int:
    """The retries a lone stream of ``path`` made as the server saw them: its GETs that asked again
    after a retriable fault the server served. A GET that asked again after a healthy answer would be
    a false timeout (none: what a test expects of the stream's retries is taken from what it was served)."""
    seen = servers.resends(server.requests(path))
    assert seen.after_healthy == 0, [(r.start, r.status, r.fault) for r in server.requests(path)]
    return seen.after_fault


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def loopback() -> Iterator[None]:
    """Fail any attempt to connect anywhere but 127.0.0.1 / ::1 (e.g. the EC2 metadata service)."""
    with servers.loopback_only():
        yield


CONTENT = {
    "data/a.tar": _payload(1, SIZE),
    "data/b.tar": _payload(2, 5_000),
    "data/c.tar": _payload(3, 1),
    "data/notes.txt": b"not a shard",
    "data/sub/d.tar": _payload(4, 10),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with `CONTENT` (``data/`` holds a.tar, b.tar, c.tar, a .txt and a subfolder) and ``empty/``."""
    folder = tmp_path_factory.mktemp("io_root")
    for rel, data in CONTENT.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    (folder / "empty").mkdir()
    return folder


@pytest.fixture(scope="module")
def files(root: Path) -> dict[str, bytes]:
    return CONTENT


@pytest.fixture(scope="module")
def http_server(root: Path) -> Iterator[FaultyHTTPServer]:
    before = {t.ident for t in threading.enumerate()}
    with FaultyHTTPServer(root) as server:
        yield server
        close_filesystems()
    assert not _new_threads(before), f"threads left running: {_new_threads(before)}"


def _new_threads(before: set[int | None]) -> list[threading.Thread]:
    # fsspec's I/O loop thread and the idle workers of that loop's default executor live as long as the
    # process, by design (daemon threads); anything else started by a test must be gone.
    return [
        t
        for t in threading.enumerate()
        if t.ident not in before and not (t.daemon and (t.name == "fsspecIO" or t.name.startswith("asyncio_")))
    ]


@pytest.fixture
def http(http_server: FaultyHTTPServer) -> FaultyHTTPServer:
    http_server.clear()
    return http_server


@pytest.fixture(scope="module")
def aws_env() -> Iterator[None]:
    """No real AWS configuration may leak in (profiles, endpoints, the metadata service)."""
    with pytest.MonkeyPatch.context() as mp:
        for key in list(os.environ):
            if key.startswith("AWS_"):
                mp.delenv(key)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        yield


@pytest.fixture(scope="module")
def s3(aws_env: None, root: Path, files: dict[str, bytes]) -> Iterator[dict[str, Any]]:
    """moto with bucket ``shards``: ``data/...`` as in `files`; yields storage_options for it."""
    pytest.importorskip("moto.server", reason="the S3 tests need the test extra (moto[server])")
    before = {t.ident for t in threading.enumerate()}
    with s3_server() as endpoint:
        make_bucket(endpoint, "shards", {k: v for k, v in files.items()})
        yield s3_storage_options(endpoint)
        close_filesystems()
    deadline = time.monotonic() + 5
    while True:  # moto's handler threads end once their (closed) connections are done
        if not _new_threads(before) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not _new_threads(before), f"threads left running: {_new_threads(before)}"


@pytest.fixture(scope="module")
def fake_s3_server(aws_env: None, root: Path) -> Iterator[FaultyHTTPServer]:
    """The faulty HTTP server posing as an S3 endpoint: GetObject is a GET of /bucket/key (path
    style), so faults reach the real botocore/aiobotocore stack. The bucket is the folder ``data``."""
    with FaultyHTTPServer(root) as server:
        yield server
        close_filesystems()


@pytest.fixture
def fake_s3(fake_s3_server: FaultyHTTPServer) -> FaultyHTTPServer:
    fake_s3_server.clear()
    return fake_s3_server


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _connects_to(port: int, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every connection attempt this process makes to 127.0.0.1:``port`` from now on, whichever library
    makes it (aiohttp for http, and for s3 under aiobotocore: each attempt is one ``socket.connect``). A
    refused port has no server to count requests, so the attempts are counted where they are made."""
    attempts: list[Any] = []
    connect = socket.socket.connect

    def counted(sock: socket.socket, address: Any) -> None:
        if isinstance(address, tuple) and address[1] == port:
            attempts.append(address)
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    return attempts


# ---------------------------------------------------------------------------------- redact / check


@pytest.mark.parametrize(
    "url, expected",
    [
        ("https://user:secret@host:8443/a/b.tar?X-Amz-Signature=abc&t=1#frag", "https://host:8443/a/b.tar"),
        ("s3://bucket/key.tar?versionId=3", "s3://bucket/key.tar"),
        ("s3://AKIA:topsecret@bucket/k.tar", "s3://bucket/k.tar"),
        ("http://u:p?w@host/x.tar", "http://host/x.tar"),  # "?" inside an unencoded password
        ("http://host/dir/", "http://host/dir/"),
        ("/data/shard-000.tar", "/data/shard-000.tar"),
        ("file:///data/a.tar", "file:///data/a.tar"),
        ("pipe:curl -s 'https://u:pw@h/a.tar?sig=1' | cat", "pipe:curl -s 'https://h/a.tar' | cat"),
    ],
)
def test_redact(url: str, expected: str) -> None:
    assert mio.redact(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "/x/a-{0..3}.tar",
        "rel/a.tar",
        "file:///x/a.tar",
        "s3://b/k.tar",
        "http://h/a.tar",
        "https://h/a.tar",
        "memory://x/a.tar",
    ],
)
def test_check_url_accepts(url: str) -> None:
    assert mio.check_url(url) == url


@pytest.mark.parametrize(
    "url, allow_pipe, needles",
    [
        ("pipe:curl -s https://h/a.tar", False, ["shell command", "allow_pipe=True"]),
        ("foo://h/a.tar", False, ["unsupported URL scheme 'foo'"]),
        ("simplecache::s3://b/k.tar", False, ["chained"]),
        ("s3://", False, ["needs a bucket"]),
        ("https:///a.tar", False, ["needs a host"]),
        ("gs://b/k.tar", False, ["'gs'", "not installed"]),  # gcsfs is not installed here
        ("", False, ["non-empty"]),
    ],
)
def test_check_url_refuses(url: str, allow_pipe: bool, needles: list[str]) -> None:
    if url.startswith("gs:") and importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(ConfigError) as info:
        mio.check_url(url, allow_pipe=allow_pipe)
    for needle in needles:
        assert needle in str(info.value)


def test_check_url_pipe_allowed_only_in_code() -> None:
    assert mio.check_url("pipe:cat a.tar", allow_pipe=True) == "pipe:cat a.tar"
    with pytest.raises(ConfigError):
        mio.open_shard("pipe:cat a.tar")


@pytest.mark.parametrize("scheme, module, extra", [("s3", "s3fs", "s3"), ("https", "aiohttp", "http")])
def test_missing_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch, scheme: str, module: str, extra: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ConfigError) as info:
        mio.check_url(f"{scheme}://bucket/k.tar")
    assert f"pip install 'wds-mixer[{extra}]'" in str(info.value)
    assert module in str(info.value)


# ------------------------------------------------------------------------------------ expand_urls


def test_expand_local_brace_folder_glob(root: Path, files: dict[str, bytes]) -> None:
    d = root / "data"
    size = {name: len(files[f"data/{name}"]) for name in ("a.tar", "b.tar", "c.tar")}
    expected = [(str(d / n), size[n]) for n in ("a.tar", "b.tar", "c.tar")]
    assert mio.expand_urls(str(d / "{a,b,c}.tar")) == expected
    assert mio.expand_urls(str(d)) == expected  # a folder: its *.tar files, not notes.txt, not sub/
    assert mio.expand_urls(str(d) + "/") == expected
    assert mio.expand_urls(str(d / "?.tar")) == expected
    # several patterns: merged, de-duplicated, sorted by URL
    assert mio.expand_urls([str(d / "c.tar"), str(d / "[ab].tar"), str(d / "a.tar")]) == expected
    assert mio.expand_urls("file://" + str(d / "{b,c}.tar")) == [("file://" + u, n) for u, n in expected[1:]]


def test_expand_local_nothing_matches(root: Path) -> None:
    with pytest.raises(ShardError, match=r"a-1\.tar"):
        mio.expand_urls(str(root / "data" / "a{,-1}.tar"))  # a.tar exists, a-1.tar does not
    with pytest.raises(ShardError, match="no shards match"):
        mio.expand_urls(str(root / "data" / "*.tgz"))
    with pytest.raises(
        ShardError,
        match=r"holds no shards \(\*\.tar, \*\.tar\.gz, \*\.tgz, \*\.tar\.xz, \*\.tar\.bz2, .*\*\.tar\.zst, \*\.tzst\)",
    ):
        mio.expand_urls(str(root / "empty"))


def test_expand_remote_braces_without_listing(http: FaultyHTTPServer) -> None:
    got = mio.expand_urls(["s3://nowhere/x-{00..02}.tar", http.url("data/x-{1..2}.tar"), "s3://nowhere/x-01.tar"])
    assert got == sorted(
        [(f"s3://nowhere/x-{i:02d}.tar", None) for i in range(3)]
        + [(http.url(f"data/x-{i}.tar"), None) for i in (1, 2)]
    )
    assert http.requests(method=None) == []  # nothing was contacted


def test_expand_s3_prefix(s3: dict[str, Any], files: dict[str, bytes]) -> None:
    got = mio.expand_urls("s3://shards/data/", storage_options=s3)
    assert got == [(f"s3://shards/data/{n}", len(files[f"data/{n}"])) for n in ("a.tar", "b.tar", "c.tar")]
    with pytest.raises(ShardError, match=r"no shards match 's3://shards/nothing/'"):
        mio.expand_urls("s3://shards/nothing/", storage_options=s3)


def test_expand_http_prefix(http: FaultyHTTPServer) -> None:
    got = mio.expand_urls(http.url("data/"))
    assert [u for u, _ in got] == [http.url(f"data/{n}") for n in ("a.tar", "b.tar", "c.tar")]
    assert len(http.requests("data", method=None)) == 1  # listed once
    secret = http.url("empty/").replace("http://", "http://user:pw@") + "?token=t0ps3cret"
    with pytest.raises(ShardError) as info:
        mio.expand_urls(secret)
    assert "pw" not in str(info.value) and "t0ps3cret" not in str(info.value)
    assert http.url("empty/") in str(info.value)


# ---------------------------------------------------------------------------------- exact bytes


@pytest.mark.parametrize("chunk", [1, 511, 65536, SIZE + 1])
@pytest.mark.parametrize("start", [0, 1, 123_457, SIZE - 1, SIZE])
def test_local_exact(root: Path, files: dict[str, bytes], chunk: int, start: int) -> None:
    data = files["data/a.tar"] if chunk > 1 else files["data/b.tar"]
    path = root / "data" / ("a.tar" if chunk > 1 else "b.tar")
    start = min(start, len(data))
    with mio.open_shard(str(path), start_offset=start) as stream:
        assert _read_all(stream, chunk) == data[start:]
        assert stream.retries == 0  # type: ignore[attr-defined]


def test_local_errors(root: Path) -> None:
    with pytest.raises(ShardError, match="missing.tar"):
        mio.open_shard(str(root / "missing.tar"))
    with pytest.raises(ShardError, match="past its end"):
        mio.open_shard(str(root / "data" / "c.tar"), start_offset=2)
    with pytest.raises(ConfigError):
        mio.open_shard(str(root / "data" / "c.tar"), start_offset=-1)


@pytest.mark.parametrize("chunk", [1, 511, 65536, SIZE + 1])
@pytest.mark.parametrize("start", [0, 1, 123_457, SIZE - 1, SIZE])
def test_http_exact(http: FaultyHTTPServer, files: dict[str, bytes], chunk: int, start: int) -> None:
    name = "data/a.tar" if chunk > 1 else "data/b.tar"  # byte-by-byte reads on the small file
    data = files[name]
    start = min(start, len(data))
    # A small block size: many reads, a read-ahead queue that fills up and drains.
    with mio.open_shard(http.url(name), start_offset=start, block_size=8192) as stream:
        assert stream.tell() == start
        assert _read_all(stream, chunk) == data[start:]
        assert stream.tell() == len(data)
        assert stream.retries == 0  # type: ignore[attr-defined]
    # One GET; from the end of the file it is answered 416, which is the end of the stream.
    assert _ranges(http, name) == [(start or None, 206 if start else 200) if start < len(data) else (start, 416)]


@pytest.mark.parametrize("chunk", [1, 4096, SIZE + 1])
@pytest.mark.parametrize("start", [0, 99_999, SIZE])
def test_s3_exact(s3: dict[str, Any], files: dict[str, bytes], chunk: int, start: int) -> None:
    name = "data/a.tar" if chunk > 1 else "data/b.tar"
    data = files[name]
    start = min(start, len(data))
    with mio.open_shard(f"s3://shards/{name}", start_offset=start, storage_options=s3, block_size=8192) as stream:
        assert _read_all(stream, chunk) == data[start:]
        assert stream.retries == 0  # type: ignore[attr-defined]


def test_s3_endpoint_from_environment(
    s3: dict[str, Any], files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mio.open_shard("s3://shards/data/b.tar") as stream:
        assert stream.read() == files["data/b.tar"]
    assert mio.expand_urls("s3://shards/data/")[0] == ("s3://shards/data/a.tar", SIZE)


def test_s3_errors(s3: dict[str, Any]) -> None:
    with pytest.raises(ShardError, match=r"s3://shards/data/zz\.tar at byte 0: not found"):
        mio.open_shard("s3://shards/data/zz.tar", storage_options=s3)
    with pytest.raises(ShardError, match=r"byte 11 is past the end of the shard \(10 bytes\)"):
        mio.open_shard("s3://shards/data/sub/d.tar", start_offset=11, storage_options=s3)
    with pytest.raises(ShardError, match="not found: NoSuchBucket"):
        mio.open_shard("s3://no-such-bucket/a.tar", storage_options=s3)


def test_other_fsspec_protocol(files: dict[str, bytes]) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("memory://io-test/a.tar", files["data/a.tar"])
    try:
        with mio.open_shard("memory://io-test/a.tar", start_offset=7, block_size=10_000) as stream:
            assert _read_all(stream, 4096) == files["data/a.tar"][7:]
        with pytest.raises(ShardError, match="not found"):
            mio.open_shard("memory://io-test/zz.tar")
    finally:
        fs.rm("memory://io-test", recursive=True)


def test_stream_protocol(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    data = files["data/b.tar"]
    stream = mio.open_shard(http.url("data/b.tar"), block_size=1000)
    assert stream.readable() and not stream.seekable()
    assert stream.read(0) == b""
    buf = bytearray(1500)
    assert stream.readinto(buf) == 1500 and bytes(buf) == data[:1500]
    got = stream.read1(5000)  # what is buffered (at most one block), no waiting for more
    assert 0 < len(got) <= 1000 and got == data[1500 : 1500 + len(got)]
    assert stream.read() == data[1500 + len(got) :]
    assert stream.read() == b"" and stream.read(10) == b""
    stream.close()
    stream.close()
    with pytest.raises(ValueError):
        stream.read(1)


def test_pipe(root: Path, files: dict[str, bytes]) -> None:
    with mio.open_shard(f"pipe:cat '{root / 'data' / 'b.tar'}'", allow_pipe=True) as stream:
        assert stream.read() == files["data/b.tar"]
    with pytest.raises(ShardError, match="exited with status"):
        with mio.open_shard(f"pipe:cat '{root / 'missing.tar'}' 2>/dev/null", allow_pipe=True) as stream:
            stream.read()


# ----------------------------------------------------------------------------------- HTTP faults

K = 100_003  # where faults cut the body


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429, 408])
def test_http_transient_status_then_ok(http: FaultyHTTPServer, files: dict[str, bytes], status: int) -> None:
    http.fail("data/a.tar", "status", status=status, times=2)
    with mio.open_shard(http.url("data/a.tar"), **FAST) as stream:
        assert stream.read() == files["data/a.tar"]
    assert _ranges(http, "data/a.tar") == [(None, status), (None, status), (None, 200)]
    assert _served(http, "data/a.tar") == [f"status {status}"] * 2
    assert stream.retries == _retried(http, "data/a.tar") == 2  # type: ignore[attr-defined]


def test_http_retry_after_is_honoured(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    http.fail("data/b.tar", "status", status=429, headers={"Retry-After": "1"})
    t0 = time.monotonic()
    with mio.open_shard(http.url("data/b.tar"), **FAST) as stream:
        assert stream.read() == files["data/b.tar"]
    assert time.monotonic() - t0 >= 1.0


@pytest.mark.parametrize("kind", ["reset", "close"])
@pytest.mark.parametrize("start", [0, 54_321])
def test_http_cut_mid_body_resumes_at_that_byte(
    http: FaultyHTTPServer, files: dict[str, bytes], kind: str, start: int
) -> None:
    # The server sends K bytes of the body, waits until the client has them, then resets (RST) or
    # closes (FIN: an incomplete body); the resume must ask for byte start + K, not 0, not earlier.
    http.fail("data/a.tar", kind, after=K, pause=0.1)
    with mio.open_shard(http.url("data/a.tar"), start_offset=start, block_size=16384, **FAST) as stream:
        assert _read_all(stream, 10_000) == files["data/a.tar"][start:]
    assert _ranges(http, "data/a.tar") == [(start or None, 206 if start else 200), (start + K, 206)]
    assert _served(http, "data/a.tar") == [kind]
    assert stream.retries == _retried(http, "data/a.tar") == 1  # type: ignore[attr-defined]


def test_http_reset_without_pause(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # An immediate RST makes the client's kernel drop what the client had not read yet: the resume may
    # start before K, never after it, and the bytes are still exact.
    http.fail("data/a.tar", "reset", after=K)
    with mio.open_shard(http.url("data/a.tar"), **FAST) as stream:
        assert stream.read() == files["data/a.tar"]
    (first, _), (resume, status) = _ranges(http, "data/a.tar")
    assert first is None and (resume or 0) <= K and status in (200, 206)


def test_http_stall_resumes_after_timeout(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    http.fail("data/a.tar", "stall", after=K, seconds=5)
    t0 = time.monotonic()
    with mio.open_shard(http.url("data/a.tar"), block_size=16384, **STALLS) as stream:
        assert stream.read() == files["data/a.tar"]
    assert 0.5 <= time.monotonic() - t0 < 3.0
    assert _ranges(http, "data/a.tar") == [(None, 200), (K, 206)]
    assert _served(http, "data/a.tar") == ["stall"]
    assert stream.retries == _retried(http, "data/a.tar") == 1  # type: ignore[attr-defined]


def test_http_no_response_times_out(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    http.fail("data/b.tar", "hang", seconds=5)
    with mio.open_shard(http.url("data/b.tar"), **STALLS) as stream:
        assert stream.read() == files["data/b.tar"]
    assert [s for _, s in _ranges(http, "data/b.tar")] == [0, 200]


def test_http_several_faults_in_one_shard(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # Each fault applies to the next request, so "after" counts from that request's first byte.
    http.fail("data/a.tar", "close", after=10_000, pause=0.05)
    http.fail("data/a.tar", "status", status=503)
    http.fail("data/a.tar", "stall", after=20_000, seconds=5)
    http.fail("data/a.tar", "close", after=1, pause=0.05)
    with mio.open_shard(http.url("data/a.tar"), block_size=4096, **STALLS) as stream:
        assert _read_all(stream, 3333) == files["data/a.tar"]
    assert _ranges(http, "data/a.tar") == [(None, 200), (10_000, 503), (10_000, 206), (30_000, 206), (30_001, 206)]
    assert _served(http, "data/a.tar") == ["close", "status 503", "stall", "close"]
    assert stream.retries == _retried(http, "data/a.tar") == 4  # type: ignore[attr-defined]


def test_http_server_ignoring_range(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    http.fail("data/a.tar", "close", after=K, pause=0.05)
    http.fail("data/a.tar", "ignore_range")  # the resume gets the whole file: the client skips K bytes
    with mio.open_shard(http.url("data/a.tar"), **FAST) as stream:
        assert stream.read() == files["data/a.tar"]
    assert _ranges(http, "data/a.tar") == [(None, 200), (K, 200)]


@pytest.mark.parametrize(
    "status, words", [(404, "not found (HTTP 404)"), (410, "not found"), (403, "access denied"), (400, "HTTP 400")]
)
def test_http_permanent_status(http: FaultyHTTPServer, status: int, words: str) -> None:
    http.fail("data/a.tar", "status", status=status, times=None)
    url = http.url("data/a.tar").replace("http://", "http://alice:s3cr3t@") + "?X-Amz-Signature=deadbeef"
    with pytest.raises(ShardError) as info:
        mio.open_shard(url, **FAST)
    message = str(info.value)
    assert f"shard {http.url('data/a.tar')} at byte 0: {words}" in message
    assert len(http.requests("data/a.tar")) == 1  # no retry
    _assert_no_secret(info.value, ["s3cr3t", "deadbeef"])


def _assert_no_secret(exc: BaseException, secrets: list[str]) -> None:
    node: BaseException | None = exc
    while node is not None:
        for secret in secrets:
            assert secret not in str(node) and secret not in repr(node), f"{secret!r} leaked in {node!r}"
        node = node.__cause__ or node.__context__


def test_http_not_found_mid_shard_names_the_byte(http: FaultyHTTPServer) -> None:
    http.fail("data/a.tar", "close", after=K, pause=0.05)
    http.fail("data/a.tar", "status", status=404, times=None)
    with mio.open_shard(http.url("data/a.tar"), **FAST) as stream:
        with pytest.raises(ShardError, match=f"at byte {K}: not found"):
            stream.read()


def test_reading_on_after_an_error_skips_nothing(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # read() fails after K bytes arrived; a caller that goes on reading still gets every byte, once.
    http.fail("data/a.tar", "close", after=K, pause=0.05)
    http.fail("data/a.tar", "status", status=503, times=None)
    with mio.open_shard(http.url("data/a.tar"), retries=1, **FAST) as stream:
        with pytest.raises(ShardError, match=f"at byte {K}: HTTP 503; gave up"):
            stream.read(SIZE)
        assert stream.tell() == 0
        http.clear()
        assert stream.read(7) == files["data/a.tar"][:7]
        assert stream.read() == files["data/a.tar"][7:]
    assert _ranges(http, "data/a.tar") == [(K, 206)]


def test_http_shard_replaced_while_read(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # The resume carries If-Match with the first response's ETag: a changed file is an error, never
    # a splice of two versions.
    http.fail("data/b.tar", "close", after=1000, pause=0.05)
    with mio.open_shard(http.url("data/b.tar"), **FAST) as stream:
        http.replace("data/b.tar", files["data/b.tar"][::-1])
        with pytest.raises(ShardError, match="changed"):
            stream.read()
    resume = http.requests("data/b.tar")[-1]
    assert resume.start == 1000 and resume.headers.get("If-Match") and resume.status == 412


@pytest.mark.parametrize("kind", ["truncate", "corrupt"])
def test_http_serves_a_broken_version_as_is(http: FaultyHTTPServer, files: dict[str, bytes], kind: str) -> None:
    # The I/O layer delivers what the server serves, byte for byte; judging tar structure is tario's job.
    data = files["data/a.tar"]
    if kind == "truncate":
        http.truncate("data/a.tar", 70_000)
        served = data[:70_000]
    else:
        http.corrupt("data/a.tar", 1024, b"\x00" * 512)
        served = data[:1024] + b"\x00" * 512 + data[1536:]
    with mio.open_shard(http.url("data/a.tar"), **FAST) as stream:
        assert stream.read() == served
        assert stream.size == len(served)  # type: ignore[attr-defined]


def test_http_retries_exhausted(http: FaultyHTTPServer) -> None:
    http.fail("data/a.tar", "status", status=503, times=None)
    with pytest.raises(ShardError, match=r"HTTP 503; gave up after 3 retries") as info:
        mio.open_shard(http.url("data/a.tar"), retries=3, **FAST)
    assert info.value.__cause__ is not None
    assert len(http.requests("data/a.tar")) == 4


def test_http_retries_exhausted_mid_shard(http: FaultyHTTPServer) -> None:
    http.fail("data/a.tar", "close", after=K, pause=0.05)
    http.fail("data/a.tar", "status", status=502, times=None)
    stream = mio.open_shard(http.url("data/a.tar"), retries=2, **FAST)
    with stream, pytest.raises(ShardError, match=f"at byte {K}: HTTP 502; gave up after 2 retries"):
        stream.read()
    # The cut and the 502s are one streak without progress: retry 1 after the cut, retry 2 after
    # the first 502, and the second 502 ends it.
    assert _ranges(http, "data/a.tar") == [(None, 200), (K, 502), (K, 502)]
    assert _served(http, "data/a.tar") == ["close", "status 502", "status 502"]
    assert stream.retries == _retried(http, "data/a.tar") == 2  # type: ignore[attr-defined]


def test_connection_refused(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    aiohttp = pytest.importorskip("aiohttp")
    port = _closed_port()
    attempts = _connects_to(port, monkeypatch)
    with pytest.raises(ShardError, match="gave up after 2 retries") as info:
        mio.open_shard(f"http://127.0.0.1:{port}/a.tar", retries=2, **FAST)
    assert isinstance(info.value.__cause__, aiohttp.ClientConnectorError)
    assert len(attempts) == 3  # the first attempt and our 2 retries, none underneath
    botocore_exceptions = pytest.importorskip("botocore.exceptions")
    options = s3_storage_options(f"http://127.0.0.1:{port}")
    attempts.clear()
    with pytest.raises(ShardError, match="gave up after 2 retries") as info:
        mio.open_shard("s3://bucket/a.tar", storage_options=options, retries=2, **FAST)
    assert isinstance(info.value.__cause__, botocore_exceptions.EndpointConnectionError)
    # No hidden botocore / s3fs retry loop underneath ours: counted, not timed (a busy machine is slow).
    assert len(attempts) == 3


def test_retries_use_no_global_rng(
    http: FaultyHTTPServer, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the global random generator was used")

    for name in ("random", "uniform", "randint", "choice", "shuffle", "getrandbits"):
        monkeypatch.setattr(random, name, forbidden)
    http.fail("data/b.tar", "status", status=503, times=2)
    with mio.open_shard(http.url("data/b.tar"), **FAST) as stream:
        assert stream.read() == files["data/b.tar"]


def test_real_shard_over_faulty_http(http: FaultyHTTPServer, root: Path) -> None:
    # A real WebDataset shard read through tario: a reset, a 503 and a stall in the middle of it change
    # nothing in the samples (same keys, same bytes, same offsets as from local disk).
    from shardutil import write_token_shards

    from mixer.read.tario import read_samples

    write_token_shards(root / "real", "web", [[300] * 40])
    path = root / "real" / "web-000000.tar"
    size = path.stat().st_size
    http.fail("real/web-000000.tar", "reset", after=size // 3, pause=0.05)
    http.fail("real/web-000000.tar", "status", status=503)
    http.fail("real/web-000000.tar", "stall", after=size // 3, seconds=5)
    url = http.url("real/web-000000.tar")

    def samples(stream: Any) -> list[tuple[Any, ...]]:
        return [tuple(sorted((k, v) for k, v in s.items() if k != "__url__")) for s in read_samples(stream, url=url)]

    with mio.open_shard(str(path)) as local, mio.open_shard(url, block_size=4096, **STALLS) as remote:
        expected, got = samples(local), samples(remote)
    assert len(expected) == 40 and got == expected
    assert _served(http, "real/web-000000.tar") == ["reset", "status 503", "stall"]
    assert remote.retries == _retried(http, "real/web-000000.tar") == 3  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ S3 faults


@pytest.mark.parametrize(
    "kind, kwargs, resume",
    [
        ("status", {"status": 503, "times": 2}, [(None, 503), (None, 503), (None, 200)]),
        ("status", {"status": 500}, [(None, 500), (None, 200)]),
        ("reset", {"after": K, "pause": 0.1}, [(None, 200), (K, 206)]),
        ("close", {"after": K, "pause": 0.05}, [(None, 200), (K, 206)]),
        ("stall", {"after": K, "seconds": 5}, [(None, 200), (K, 206)]),
    ],
)
def test_s3_faults(
    fake_s3: FaultyHTTPServer, files: dict[str, bytes], kind: str, kwargs: dict[str, Any], resume: list[Any]
) -> None:
    fake_s3.fail("data/a.tar", kind, **kwargs)
    options = s3_storage_options(fake_s3.url().rstrip("/"))
    with mio.open_shard(
        "s3://data/a.tar", storage_options=options, block_size=16384, **(STALLS if kind == "stall" else FAST)
    ) as stream:
        assert stream.read() == files["data/a.tar"]
    assert _ranges(fake_s3, "data/a.tar") == resume
    fault = f"status {kwargs['status']}" if kind == "status" else kind
    assert _served(fake_s3, "data/a.tar") == [fault] * (len(resume) - 1)
    assert stream.retries == _retried(fake_s3, "data/a.tar") == len(resume) - 1  # type: ignore[attr-defined]


def test_s3_permanent(fake_s3: FaultyHTTPServer) -> None:
    options = s3_storage_options(fake_s3.url().rstrip("/"))
    for status, words in [(404, "not found"), (403, "access denied")]:
        fake_s3.clear()
        fake_s3.fail("data/a.tar", "status", status=status, times=None)
        with pytest.raises(ShardError, match=f"s3://data/a.tar at byte 0: {words}"):
            mio.open_shard("s3://data/a.tar", storage_options=options, **FAST)
        assert len(fake_s3.requests("data/a.tar")) == 1


# ------------------------------------------------------------------------------------ read-ahead

SHARDS = ["data/a.tar", "data/b.tar", "data/c.tar", "data/sub/d.tar"]


def _wait_for(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_read_ahead_opens_the_next_shards_early(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # Opening shard k sends the requests of shards k+1 and k+2 (read_ahead=2) without waiting for them;
    # opening those later uses those very responses (one GET per shard), and every byte is exact.
    urls = [http.url(p) for p in SHARDS]
    ahead = mio.ReadAhead(options={"read_ahead": 2, "block_size": 16384, "timeout": 10})  # no fault to time
    for k, url in enumerate(urls):
        stream = ahead.open(url, 0, iter(urls[k + 1 :]))
        # the next two are requested while this one is still unread
        assert _wait_for(lambda: all(http.requests(p) for p in SHARDS[k + 1 : k + 3]))
        assert [len(http.requests(p)) for p in SHARDS] == [1] * min(k + 3, 4) + [0] * max(4 - k - 3, 0)
        assert _read_all(stream, 7001) == files[SHARDS[k]]
        stream.close()
    assert [_ranges(http, p) for p in SHARDS] == [[(None, 200)]] * 4
    ahead.close()


def test_read_ahead_is_bounded(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # a.tar (300 kB) begun ahead with 16 kB blocks holds at most one block in its queue (plus at most
    # two in aiohttp's buffer) until it is opened: the rest waits, flow-controlled, in the network.
    ahead = mio.ReadAhead(options={"read_ahead": 1, "block_size": 16384, "timeout": 10})
    with ahead.open(http.url("data/b.tar"), 0, [http.url("data/a.tar")]) as first:
        begun = ahead._begun[http.url("data/a.tar")]
        pump = begun._remote._pump  # type: ignore[attr-defined]
        assert _wait_for(lambda: pump._queued >= 16384)
        time.sleep(0.2)  # time to overfill, were it unbounded
        assert pump._queued <= 16384 + 16384  # the last chunk may land on a queue just under the bound
        assert first.read() == files["data/b.tar"]
    with ahead.open(http.url("data/a.tar")) as second:
        assert _read_all(second, 65536) == files["data/a.tar"]
    assert _ranges(http, "data/a.tar") == [(None, 200)]


def test_read_ahead_faults_surface_at_their_turn(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    a, b, c = (http.url(p) for p in SHARDS[:3])
    http.fail("data/b.tar", "status", status=404, times=None)
    http.fail("data/c.tar", "status", status=503, times=2)
    ahead = mio.ReadAhead(options={"read_ahead": 2, **FAST})
    with ahead.open(a, 0, [b, c]) as stream:  # b's 404 is not a's problem
        assert stream.read() == files["data/a.tar"]
    with pytest.raises(ShardError, match=r"data/b\.tar at byte 0: not found \(HTTP 404\)") as info:
        ahead.open(b, 0, [c])
    assert info.value.retries == 0 and _served(http, "data/b.tar") == ["status 404"]  # type: ignore[attr-defined]
    with ahead.open(c) as stream:  # the 503s of the request begun ahead are retried at c's turn
        assert stream.read() == files["data/c.tar"]
    assert _ranges(http, "data/c.tar") == [(None, 503), (None, 503), (None, 200)]
    assert stream.retries == _retried(http, "data/c.tar") == 2  # type: ignore[attr-defined]
    # a shard that gives up after retries says how many it made (the last 503 is not retried)
    http.clear()
    http.fail("data/a.tar", "status", status=503, times=None)
    with pytest.raises(ShardError, match="gave up after 2 retries") as info:
        mio.ReadAhead(options={**FAST, "retries": 2}).open(a)
    assert _served(http, "data/a.tar") == ["status 503"] * 3
    assert info.value.retries == _retried(http, "data/a.tar") == 2  # type: ignore[attr-defined]


def test_read_ahead_drops_what_is_no_longer_next(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    a, b, c, d = (http.url(p) for p in SHARDS)
    ahead = mio.ReadAhead(options={"read_ahead": 2, **FAST})
    with ahead.open(a, 0, [b, c]):
        assert sorted(ahead._begun) == sorted([b, c])
    with ahead.open(d, 0, []):  # b and c are not next any more: dropped
        assert ahead._begun == {}
    with ahead.open(a, 0, [b]):
        pass
    with ahead.open(b, 1000) as stream:  # begun from byte 0, wanted from 1000: a fresh ranged GET
        assert stream.read() == files["data/b.tar"][1000:]
    assert _ranges(http, "data/b.tar")[-1] == (1000, 206)
    # read_ahead=0 begins nothing; local files are opened on demand
    none = mio.ReadAhead(options={"read_ahead": 0})
    with none.open(a, 0, [b, c]):
        assert none._begun == {}


def test_read_ahead_local_files(root: Path, files: dict[str, bytes]) -> None:
    paths = [str(root / p) for p in SHARDS]
    ahead = mio.ReadAhead()
    for k, path in enumerate(paths):
        with ahead.open(path, 0, paths[k + 1 :]) as stream:
            assert ahead._begun == {} and stream.read() == files[SHARDS[k]]
    with pytest.raises(ShardError, match="cannot open shard"):
        ahead.open(str(root / "missing.tar"))


def test_no_false_timeout_after_an_idle_pause(http: FaultyHTTPServer, files: dict[str, bytes]) -> None:
    # aiohttp 3.14.0-3.14.5 re-arms its read timer on a keep-alive connection released to the pool
    # while the body is drained (aio-libs/aiohttp#12953): the next request on that connection, a
    # timeout later, failed at once with a false "timed out" (a spurious retry). Responses are not
    # pooled, so a pause longer than the timeout between two shards costs nothing.
    with mio.open_shard(http.url("data/a.tar"), **STALLS) as stream:
        assert stream.read() == files["data/a.tar"]
    time.sleep(0.8)
    with mio.open_shard(http.url("data/b.tar"), **STALLS) as stream:
        assert stream.read() == files["data/b.tar"]
        assert stream.retries == 0  # type: ignore[attr-defined]
