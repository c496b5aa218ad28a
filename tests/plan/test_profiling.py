"""The up-front look at the sources (`mixer.plan.profiling`, `mixer.plan.profile_cache`): skipped when nothing
needs it, bounded ranged reads, parallel with bounded concurrency (same result as one at a time),
cached on disk keyed by the shard listing, errors and warnings in source order.

Reads are counted by the loopback HTTP server (`servers.FaultyHTTPServer` records every request
with its byte range, and the most GETs it had in flight at once)."""

from __future__ import annotations

import contextlib
import json
import tarfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultyHTTPServer, loopback_only, no_aws_config, resends, s3_storage_options
from shardutil import write_token_shards

import mixer
import mixer.plan.profiling
from mixer.errors import ConfigError, ShardError
from mixer.plan.profiling import FIRST_WINDOW, MIN_WINDOW
from mixer.storage.filesystems import close_filesystems

SOURCES = 12
BIG_SHARDS, BIG_PER_SHARD = 3, 2400


@pytest.fixture(scope="module", autouse=True)
def guarded() -> Iterator[None]:
    with loopback_only():
        yield
    close_filesystems()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``many/s00..s11-00000{0..2}.tar`` (30 samples each, lengths 8..200) and ``big/big-00000{0..2}.tar``
    (2,400 samples each, lengths 100..300: ~4 MB per shard, three times what the look wants)."""
    folder = tmp_path_factory.mktemp("profiling")
    rng = np.random.default_rng(14)
    for i in range(SOURCES):
        write_token_shards(folder / "many", f"s{i:02d}", [rng.integers(8, 200, 30).tolist() for _ in range(3)])
    write_token_shards(
        folder / "big", "big", [rng.integers(100, 300, BIG_PER_SHARD).tolist() for _ in range(BIG_SHARDS)]
    )
    return folder


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(root) as s:
        yield s
        close_filesystems()


@pytest.fixture
def http(server: FaultyHTTPServer) -> Iterator[FaultyHTTPServer]:
    server.clear()
    server.delay = 0.0
    yield server
    server.delay = 0.0


def many(http: FaultyHTTPServer, n: int = SOURCES, **kwargs: Any) -> list[mixer.Source]:
    return [mixer.Source(f"s{i:02d}", http.url(f"many/s{i:02d}-{{000000..000002}}.tar"), **kwargs) for i in range(n)]


def gets(http: FaultyHTTPServer) -> list[Any]:
    return [r for r in http.requests() if r.path.endswith(".tar")]


# ------------------------------------------------------------------------------------ skipping


def test_no_read_when_size_and_bucket_edges_are_given(http: FaultyHTTPServer) -> None:
    sources = many(http, size=1e6)
    mix = mixer.Mixture(sources, batching=mixer.TokenBudget(4096, buckets=[64, 128, 256]))
    assert gets(http) == []  # not one shard byte: nothing needs a look
    assert [p.origin for p in mix.profiles] == ["given"] * SOURCES and mix.sizes == {s.name: 1e6 for s in sources}
    assert mix.edges == [[64, 128, 256]] * SOURCES
    mixer.Mixture(sources, batching=mixer.Packed(4096))  # packed batches have no edges: no read either
    assert gets(http) == []


def test_size_given_without_edges_reads_lengths_only(http: FaultyHTTPServer) -> None:
    # Automatic edges are a function of the lengths: the look reads them (and keeps the given size).
    mix = mixer.Mixture(many(http, 2, size=5e5), batching=mixer.TokenBudget(4096))
    assert [p.origin for p in mix.profiles] == ["read", "read"] and mix.sizes == {"s00": 5e5, "s01": 5e5}
    assert [p.lengths.size for p in mix.profiles] == [90, 90]  # the three shards of each, every sample
    assert len(gets(http)) == 6


# ------------------------------------------------------------------------------- bounded reads


def _sample_ends(path: Path) -> list[int]:
    """The byte where each sample of a one-member-per-sample shard ends (the next header)."""
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    return [m.offset for m in members[1:]] + [members[-1].offset_data + ((members[-1].size + 511) & -512)]


def test_remote_reads_are_ranged_with_an_end_byte_and_about_what_is_used(http: FaultyHTTPServer, root: Path) -> None:
    mix = mixer.Mixture(
        [mixer.Source("big", http.url("big/big-{000000..000002}.tar"))], batching=mixer.TokenBudget(4096)
    )
    per_shard = mixer.plan.profiling.MAX_SAMPLES // BIG_SHARDS
    assert mix.profiles[0].lengths.size == per_shard * BIG_SHARDS
    requests = gets(http)
    assert requests and all(r.start is not None and r.end is not None and r.status == 206 for r in requests), requests
    # Used: each shard up to the header after its last sample read (the reader needs it to know the
    # sample is whole). Asked for: at most the first window of the first shard plus 15% of the rest
    # plus one least window per request -- not the shards (3 x ~4 MB).
    used = sum(_sample_ends(root / "big" / f"big-{i:06d}.tar")[per_shard] for i in range(BIG_SHARDS))
    asked = sum(r.end - r.start + 1 for r in requests)
    size = sum((root / "big" / f"big-{i:06d}.tar").stat().st_size for i in range(BIG_SHARDS))
    assert used <= asked <= used * mixer.plan.profiling.SLACK + FIRST_WINDOW + MIN_WINDOW * len(requests), (used, asked)
    assert asked < size / 2 and len(requests) <= 2 * BIG_SHARDS
    # The estimate is that of an unbounded look: tokens per byte over the same samples.
    unbounded = mixer.Mixture(
        [mixer.Source("big", str(root / "big" / "big-{000000..000002}.tar"))], batching=mixer.TokenBudget(4096)
    )
    assert np.array_equal(unbounded.profiles[0].lengths, mix.profiles[0].lengths)
    assert unbounded.profiles[0].tokens_per_byte == mix.profiles[0].tokens_per_byte


def test_many_sources_share_a_total_of_lengths(root: Path) -> None:
    # Each source reads min(MAX_SAMPLES, max(MIN_SAMPLES, max_total // sources)) lengths, spread
    # evenly over its 3 picked shards: 4 sources under a total of 2,400 read 600 each (200 a shard);
    # under a total of 400 the floor of 512 holds (170 a shard, 510); one source alone reads 2,048.
    pattern = str(root / "big" / "big-{000000..000002}.tar")
    listed = [mixer.plan.profiling.list_source(mixer.Source(f"b{i}", pattern)) for i in range(4)]
    budget = mixer.TokenBudget(4096)
    assert mixer.plan.profiling.MIN_SAMPLES == 512 and mixer.plan.profiling.MAX_SAMPLES == 2048
    assert [p.lengths.size for p in mixer.plan.profiling.profile_sources(listed, budget, max_total=2400)] == [600] * 4
    assert [p.lengths.size for p in mixer.plan.profiling.profile_sources(listed, budget, max_total=400)] == [510] * 4
    assert [p.lengths.size for p in mixer.plan.profiling.profile_sources(listed[:1], budget)] == [2046]
    # The default total only bites beyond 32 sources.
    assert mixer.plan.profiling.MAX_TOTAL_SAMPLES // 32 == mixer.plan.profiling.MAX_SAMPLES


def test_end_offset_ends_the_stream_and_the_request(http: FaultyHTTPServer, root: Path) -> None:
    path = root / "big" / "big-000000.tar"
    data = path.read_bytes()
    with mixer.storage.open_shard(http.url("big/big-000000.tar"), start_offset=1000, end_offset=5000) as stream:
        assert stream.read() == data[1000:5000]
    (request,) = gets(http)
    assert (request.start, request.end, request.status) == (1000, 4999, 206)
    # The same through S3 (the server posing as an endpoint: a GetObject is a GET of /bucket/key).
    http.clear()
    with (
        no_aws_config(),
        mixer.storage.open_shard(
            "s3://big/big-000000.tar", end_offset=4096, storage_options=s3_storage_options(http.url().rstrip("/"))
        ) as stream,
    ):
        assert stream.read() == data[:4096] and stream.size == len(data)
    (request,) = gets(http)
    assert (request.start, request.end, request.status) == (0, 4095, 206)
    with mixer.storage.open_shard(str(path), start_offset=10, end_offset=20) as stream:
        assert stream.read(100) == data[10:20] and stream.read(1) == b""
    http.clear()
    http.fail("big/big-000000.tar", "ignore_range")  # a server that sends the whole file: cut off at the end byte
    with mixer.storage.open_shard(http.url("big/big-000000.tar"), end_offset=3000) as stream:
        assert stream.read() == data[:3000]
    with pytest.raises(ConfigError, match="end_offset must be >= start_offset"):
        mixer.storage.open_shard(str(path), start_offset=10, end_offset=5)
    with pytest.raises(ConfigError, match="end_offset needs an uncompressed shard"):
        mixer.storage.open_shard(str(root / "x.tar.gz"), end_offset=5)


# ------------------------------------------------------------------------------------ parallel


class _OpenShards:
    """The look's shards open at once, counted where it opens them (the server's count of GETs in
    flight can also hold a ranged response it is still finishing after the client closed it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = self.peak = 0
        self.lock = threading.Lock()
        self.real = mixer.plan.profiling._open
        monkeypatch.setattr(mixer.plan.profiling, "_open", self.open)

    @contextlib.contextmanager
    def open(self, *args: Any) -> Iterator[Any]:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            with self.real(*args) as stream:
                yield stream
        finally:
            with self.lock:
                self.now -= 1


def test_parallel_look_equals_the_sequential_one_and_is_bounded(
    http: FaultyHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    http.delay = 0.05  # every GET waits: the looks overlap only if they run at once
    budget = mixer.TokenBudget(4096, num_buckets=4)
    monkeypatch.setattr(mixer.plan.profiling, "MAX_CONCURRENT", 1)
    opened = _OpenShards(monkeypatch)
    one = mixer.Mixture(many(http, io_options={"read_ahead": 0}), batching=budget, seed=3)
    assert opened.peak == 1 and http.peak >= 1
    http.clear()
    monkeypatch.setattr(mixer.plan.profiling, "MAX_CONCURRENT", 5)
    opened = _OpenShards(monkeypatch)
    par = mixer.Mixture(many(http, io_options={"read_ahead": 0}), batching=budget, seed=3)
    assert 1 < opened.peak <= 5  # bounded: never more sources at once than the knob
    assert http.peak > 1  # (the server saw them overlap)
    for a, b in zip(one.profiles, par.profiles):
        assert np.array_equal(a.lengths, b.lengths) and (a.size, a.tokens_per_byte) == (b.size, b.tokens_per_byte)
    assert one.edges == par.edges and one.sizes == par.sizes
    http.delay = 0.0
    left, right = iter(one), iter(par)
    for _ in range(10):  # same profiles, same edges: the same batches
        a, b = next(left), next(right)
        assert a.keys == b.keys and np.array_equal(a.tokens.numpy(), b.tokens.numpy())
    left.close()  # type: ignore[attr-defined]
    right.close()  # type: ignore[attr-defined]


def test_errors_name_the_first_failing_source_in_order(http: FaultyHTTPServer) -> None:
    # s04 and s09 are broken; the look runs in parallel, yet the error is the one a look one source
    # at a time meets first, naming its source.
    http.fail("many/s09-000000.tar", "status", status=404, times=None)
    http.fail("many/s04-000001.tar", "status", status=404, times=None)
    with pytest.raises(
        ShardError,
        match=r"^source 's04': shard http://127\.0\.0\.1:\d+/many/s04-000001\.tar at byte 0: not found \(HTTP 404\)",
    ):
        mixer.Mixture(many(http), batching=mixer.TokenBudget(4096))


def test_retries_and_skips_of_the_look_are_counted(http: FaultyHTTPServer) -> None:
    http.fail("many/s01-000001.tar", "status", status=503, times=2)  # transient: retried from the same byte
    http.fail("many/s02-000002.tar", "status", status=404, times=None)  # permanent: skipped (on_error="skip")
    with pytest.warns(RuntimeWarning, match="source 's02': profiling skips shard"):
        mix = mixer.Mixture(
            many(http, 3, on_error="skip", io_options={"backoff": 0.01}), batching=mixer.TokenBudget(4096)
        )
    assert [p.lengths.size for p in mix.profiles] == [90, 90, 60]
    # Each source's retries are the retriable faults the server served its shards, each asked again
    # once (and nothing else asked again: the default 60 s timeout takes no healthy answer for a stall).
    assert sorted((r.path, r.fault) for r in http.served()) == [("many/s01-000001.tar", "status 503")] * 2 + [
        ("many/s02-000002.tar", "status 404")
    ]
    seen = [[resends(http.requests(f"many/s{i:02d}-{k:06d}.tar")) for k in range(3)] for i in range(3)]
    assert all(s.after_healthy == 0 for shards in seen for s in shards), seen
    assert [p.retries for p in mix.profiles] == [sum(s.after_fault for s in shards) for shards in seen] == [0, 2, 0]


def test_warnings_come_in_source_order_from_the_callers_line(http: FaultyHTTPServer) -> None:
    for i in (7, 2, 5):
        http.fail(f"many/s{i:02d}-000001.tar", "status", status=404, times=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mix = mixer.Mixture(many(http, on_error="skip"), batching=mixer.TokenBudget(4096))
    skips = [w for w in caught if "profiling skips shard" in str(w.message)]
    assert [str(w.message).split("'")[1] for w in skips] == ["s02", "s05", "s07"]
    assert {Path(w.filename).name for w in skips} == {Path(__file__).name}
    assert [p.lengths.size for p in mix.profiles] == [60 if i in (2, 5, 7) else 90 for i in range(SOURCES)]


# ------------------------------------------------------------------------------------ the cache


def test_cache_hit_reads_nothing_and_gives_the_same_mixture(http: FaultyHTTPServer, tmp_path: Path) -> None:
    cache = tmp_path / "profiles"
    first = mixer.Mixture(many(http), batching=mixer.TokenBudget(4096), profile_cache=str(cache))
    assert len(gets(http)) == 3 * SOURCES and [p.origin for p in first.profiles] == ["read"] * SOURCES
    files = sorted(cache.iterdir())
    assert len(files) == SOURCES and all(
        f.suffix == ".json" and f.stat().st_size < 4096 for f in files
    )  # no temp file left
    entry = json.loads(files[0].read_text())
    assert set(entry) == {"version", "key", "lengths", "tokens_per_byte", "size", "skipped"}
    http.clear()
    second = mixer.Mixture(many(http), batching=mixer.TokenBudget(4096), profile_cache=cache)
    assert gets(http) == []  # a restarted job reads no shard to start
    assert [p.origin for p in second.profiles] == ["cache"] * SOURCES
    for a, b in zip(first.profiles, second.profiles):
        assert np.array_equal(a.lengths, b.lengths) and (a.size, a.tokens_per_byte, a.estimated) == (
            b.size,
            b.tokens_per_byte,
            b.estimated,
        )
    assert first.edges == second.edges and first.sizes == second.sizes
    # A given size still wins over the cached estimate; the lengths come from the cache.
    sized = mixer.Mixture(many(http, 1, size=123.0), batching=mixer.TokenBudget(4096), profile_cache=cache)
    assert gets(http) == [] and sized.sizes == {"s00": 123.0} and sized.profiles[0].origin == "cache"


def test_a_changed_listing_or_policy_misses(http: FaultyHTTPServer, tmp_path: Path) -> None:
    cache = tmp_path / "profiles"
    mixer.Mixture(many(http, 2), batching=mixer.TokenBudget(4096), profile_cache=cache)
    http.clear()
    # s01 gains a shard (listed as {0..2}: one more URL), s00 is unchanged: only s01 is read again.
    sources = [
        many(http, 1)[0],
        mixer.Source("s01", [http.url("many/s01-{000000..000001}.tar"), http.url("many/s02-000000.tar")]),
    ]
    mix = mixer.Mixture(sources, batching=mixer.TokenBudget(4096), profile_cache=cache)
    assert [p.origin for p in mix.profiles] == ["cache", "read"]
    assert {r.path.split("/")[-1] for r in gets(http)} <= {"s01-000000.tar", "s01-000001.tar", "s02-000000.tar"}
    http.clear()
    # Another length policy (max_length) judges samples differently: a miss as well.
    mixer.Mixture(many(http, 1), batching=mixer.TokenBudget(4096, max_length=100), profile_cache=cache)
    assert len(gets(http)) == 3


def test_a_resized_local_shard_misses(tmp_path: Path) -> None:
    cache = tmp_path / "profiles"
    write_token_shards(tmp_path / "d", "a", [[10] * 5, [20] * 5])
    source = mixer.Source("a", str(tmp_path / "d" / "a-{000000..000001}.tar"))
    assert mixer.Mixture([source], batching=mixer.TokenBudget(512), profile_cache=cache).profiles[0].origin == "read"
    assert mixer.Mixture([source], batching=mixer.TokenBudget(512), profile_cache=cache).profiles[0].origin == "cache"
    # Shard 1 rewritten, longer: the listing's sizes change, so the look is made again (of two shards
    # it reads only the first: the picks are round(i * (n - 1) / 2), and round(0.5) is 0).
    write_token_shards(tmp_path / "d", "a", [[10] * 5, [30] * 7])
    again = mixer.Mixture([source], batching=mixer.TokenBudget(512), profile_cache=cache)
    assert again.profiles[0].origin == "read" and again.profiles[0].lengths.tolist() == [10] * 5
    assert len(list(cache.iterdir())) == 2  # the old entry stays (keyed by the old listing), unread


def test_a_decode_without_a_stable_name_is_not_cached(tmp_path: Path) -> None:
    import functools

    write_token_shards(tmp_path / "d", "a", [[10] * 5])
    pattern = str(tmp_path / "d" / "a-000000.tar")

    def decode(sample: dict[str, Any], scale: int) -> np.ndarray:
        return np.zeros(10 * scale, dtype=np.int32)

    cache = tmp_path / "profiles"
    for scale, expected in ((1, "read"), (2, "read")):  # a partial: the same code, other arguments
        src = mixer.Source("a", pattern, decode=functools.partial(decode, scale=scale))
        mix = mixer.Mixture([src], batching=mixer.TokenBudget(512), profile_cache=cache)
        assert mix.profiles[0].origin == expected and mix.profiles[0].lengths.tolist() == [10 * scale] * 5
    assert not cache.exists()


def test_profile_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"profile_cache: must be a directory path or None, got 3 \(int\)"):
        mixer.Mixture([mixer.Source("a", "/nonexistent/a.tar")], batching=mixer.TokenBudget(64), profile_cache=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"profile_share: must be true, false or None, got 'yes' \(str\)"):
        mixer.Mixture([mixer.Source("a", "/nonexistent/a.tar")], batching=mixer.TokenBudget(64), profile_share="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="profile_share=True needs an initialized torch.distributed process group"):
        mixer.plan.profiling._share_group(True, None)


# ------------------------------------------------------------------------------ one look per job


@pytest.mark.slow
def test_under_torchrun_rank_0_looks_and_the_other_ranks_receive(http: FaultyHTTPServer, tmp_path: Path) -> None:
    """2 ranks (gloo): with the look shared (the default under a process group) every profiled shard
    is fetched once per job, and both ranks hold the same profiles; with profile_share=False once
    per rank; rank 0's error reaches every rank, naming the source; a cache written by rank 0 is
    all a restarted job reads."""
    import os
    import socket
    import subprocess
    import sys

    def names(lo: int, hi: int) -> list[list[str]]:
        return [[f"s{i:02d}", http.url(f"many/s{i:02d}-{{000000..000002}}.tar")] for i in range(lo, hi)]

    cache = tmp_path / "cache"
    cases = [
        {"name": "shared", "sources": names(0, 4)},
        {"name": "own", "sources": names(4, 8), "share": False},
        {"name": "fail", "sources": names(8, 10)},
        {"name": "cached", "sources": names(10, 12), "cache": str(cache)},
        {"name": "side", "sources": names(0, 2), "side": True},
    ]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    http.fail("many/s09-000001.tar", "status", status=404, times=None)

    def torchrun() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        repo = Path(__file__).resolve().parents[2]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(repo / "tests" / "support" / "profile_worker.py"),
            str(spec),
            str(tmp_path),
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=repo)
        assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    def result(case: str, rank: int) -> dict[str, Any]:
        return dict(json.loads((tmp_path / f"{case}-rank{rank}.json").read_text()))

    def fetched(lo: int, hi: int) -> int:
        return sum(1 for r in gets(http) if any(r.path.startswith(f"many/s{i:02d}-") for i in range(lo, hi)))

    torchrun()
    # Each source's 3 shards are small: one ranged GET each, per look.
    assert fetched(0, 4) == 3 * 4 + 3 * 2  # once per job (s00 and s01 twice: the "side" case looks again)
    assert fetched(4, 8) == 2 * 3 * 4  # once per rank
    for case in ("shared", "own", "cached", "side"):
        assert result(case, 0) == result(case, 1), case
    single = mixer.Mixture([mixer.Source(n, p) for n, p in names(0, 4)], batching=mixer.TokenBudget(4096))
    assert [p["lengths"] for p in result("shared", 1)["profiles"]] == [p.lengths.tolist() for p in single.profiles]
    assert result("shared", 1)["edges"] == single.edges
    assert result("side", 1)["profiles"] == result("shared", 1)["profiles"][:2]
    # rank 0 met the 404 (s08 was looked at in parallel, s09 fails): both ranks raise it, naming s09
    for rank in (0, 1):
        kind, message = result("fail", rank)["error"]
        assert kind == "ShardError" and message.startswith(
            f"source 's09': shard {http.url('many/s09-000001.tar')} at byte 0: not found (HTTP 404)"
        )
    assert fetched(9, 10) == 2  # s09-000000 and the 404: rank 1 asked nothing
    assert [p["origin"] for p in result("cached", 1)["profiles"]] == ["read", "read"]
    assert len(list(cache.iterdir())) == 2  # written once, by rank 0

    http.clear()
    torchrun()  # the restarted job: the cache answers, no shard is read by any rank
    assert [p["origin"] for p in result("cached", 1)["profiles"]] == ["cache", "cache"]
    assert fetched(10, 12) == 0


def test_the_config_keys_reach_the_mixture(http: FaultyHTTPServer, tmp_path: Path) -> None:
    from mixer.config.mixture_config import build_mixture, parse_config

    raw = {
        "sources": [{"name": "s00", "urls": http.url("many/s00-{000000..000002}.tar")}],
        "batching": {"max_tokens": 4096},
        "profile_cache": str(tmp_path / "c"),
        "profile_share": False,
    }
    config = parse_config(raw)
    assert (config.profile_cache, config.profile_share) == (str(tmp_path / "c"), False)
    assert parse_config(config.to_dict()) == config
    assert build_mixture(config).profiles[0].origin == "read" and build_mixture(config).profiles[0].origin == "cache"
    with pytest.raises(ConfigError, match=r"profile_share: must be true, false or None, got 1 \(int\)"):
        parse_config({**raw, "profile_share": 1})
