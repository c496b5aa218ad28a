"""Start-up once per job (`mixer.plan.startup`): listing, index verification and the up-front look made
by one rank and shared, concurrent with a bound, listings cached beside the profiles, and a look that
reads a bounded number of bytes per source.

Requests are counted by the loopback server (`servers.FaultyHTTPServer`): a GET of a folder is a
LIST (its HTML listing), a HEAD is what an index verification sends per remote shard, a GET of a
file is the look reading a shard (or a rank reading an index file).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import FaultyHTTPServer, remote_guard  # noqa: F401 (remote_guard: a module-wide autouse fixture)
from shardutil import write_token_shards

import mixer
from mixer.errors import ShardError
from mixer.plan import profiling
from mixer.plan.profiling import list_source, profile_sources
from mixer.plan.startup import survey

PREFIXES = 6  # sources listed from a remote prefix, 3 shards each
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``prefix/s00..s05/`` (3 shards of 30 samples each), ``idx/`` (3 shards and their index, built
    from the local files) and ``big/b0, b1/`` (3 shards of 1,000 samples each, ~1.3 MB per shard)."""
    folder = tmp_path_factory.mktemp("startup")
    rng = np.random.default_rng(24)
    for i in range(PREFIXES):
        write_token_shards(folder / "prefix" / f"s{i:02d}", f"s{i:02d}", [rng.integers(8, 200, 30).tolist()] * 3)
    pattern = write_token_shards(folder / "idx", "idx", [rng.integers(8, 200, 40).tolist() for _ in range(3)])
    mixer.build_index(pattern)
    for i in range(2):
        write_token_shards(folder / "big" / f"b{i}", f"b{i}", [rng.integers(100, 400, 1000).tolist() for _ in range(3)])
    return folder


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(root) as s:
        yield s


@pytest.fixture
def http(server: FaultyHTTPServer) -> Iterator[FaultyHTTPServer]:
    server.clear()
    server.delay = 0.0
    yield server
    server.delay = 0.0


def _spec_sources(http: FaultyHTTPServer) -> list[dict[str, Any]]:
    prefixes = [{"name": f"s{i:02d}", "urls": http.url(f"prefix/s{i:02d}/")} for i in range(PREFIXES)]
    return [*prefixes, {"name": "idx", "urls": http.url("idx/"), "index": True}]


def _torchrun(nproc: int, spec: dict[str, Any], out: Path, tmp: Path | None = None) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(REPO / "tests" / "support" / "startup_worker.py"),
        str(out / "spec.json"),
        str(out),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    if tmp is not None:  # where the index's mapped twin goes (a remote index file's): fresh per job
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, f"torchrun x{nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


INDEX_FILE = "idx/mixer-index.json.gz"


def _storage_counts(http: FaultyHTTPServer) -> dict[str, int]:
    """`http.counts()` without the requests for the index file itself, which every rank makes (one
    HEAD: which version it is; one GET unless this machine's mapped twin of that version serves)."""
    counts = http.counts()
    for r in http.requests(INDEX_FILE, method=None):
        counts[r.method] -= 1
    return counts


def _index_file_requests(http: FaultyHTTPServer) -> tuple[int, int]:
    return len(http.requests(INDEX_FILE, method="HEAD")), len(http.requests(INDEX_FILE))


# ------------------------------------------------------------------------------------ torchrun


@pytest.mark.slow
def test_a_job_of_four_ranks_sends_the_requests_of_a_job_of_one(http: FaultyHTTPServer, tmp_path: Path) -> None:
    spec = {"sources": _spec_sources(http), "cache": None}
    counts = {}
    results = {}
    index_file = {}
    cached = {**spec, "cache": str(tmp_path / "cache")}
    for nproc in (1, 4):
        http.clear()
        # the job of one also fills a profile cache, empty before it, for the restarted job below:
        # filling it must cost no request
        job = cached if nproc == 1 else spec
        results[nproc] = _torchrun(nproc, job, tmp_path / f"x{nproc}", tmp_path / f"tmp{nproc}")
        counts[nproc] = _storage_counts(http)
        index_file[nproc] = _index_file_requests(http)
    # Once per job: a LIST per prefix (the index source's too), a HEAD per indexed shard (its
    # verification), and the look's GETs of the prefix sources' shards (one each: they are small);
    # only the index file is asked for by every rank (a HEAD each, and a GET where no rank of the
    # machine has mapped it yet: each job here starts with an empty temporary folder).
    expected = {"LIST": PREFIXES + 1, "HEAD": 3, "GET": 3 * PREFIXES}
    assert counts[1] == counts[4] == expected, counts
    assert index_file[1] == (1, 1) and index_file[4][0] == 4 and 1 <= index_file[4][1] <= 4, index_file
    # ... and every rank built the same mixture as the job of one
    assert all("error" not in r for r in results[4]), results[4]
    for r in results[4]:
        assert r == results[1][0]
    assert [p["origin"] for p in results[1][0]["profiles"]] == ["read"] * PREFIXES + ["index"]

    # A restarted job with a profile cache: no LIST and no shard read by any rank (the listings and
    # profiles are cached); the indexed shards are verified again, once, and each rank reads the index.
    http.clear()
    again = _torchrun(4, cached, tmp_path / "again", tmp_path / "tmp1")
    assert _storage_counts(http) == {"LIST": 0, "HEAD": 3, "GET": 0}, http.counts()
    assert _index_file_requests(http) == (4, 0)  # the twin mapped by the first job serves every rank
    for r in again:
        assert {k: v for k, v in r.items() if k != "profiles"} == {
            k: v for k, v in results[1][0].items() if k != "profiles"
        }
        assert [p["origin"] for p in r["profiles"]] == ["cache"] * PREFIXES + ["index"]


@pytest.mark.slow
def test_an_error_on_the_rank_that_lists_is_raised_on_every_rank(http: FaultyHTTPServer, tmp_path: Path) -> None:
    sources = [*_spec_sources(http)[:2], {"name": "gone", "urls": http.url("prefix/nothing-here/")}]
    results = _torchrun(2, {"sources": sources, "cache": None}, tmp_path)
    for r in results:
        kind, message = r["error"]
        assert kind == "ShardError" and message.startswith("source 'gone': no shards match"), message
    # rank 0 listed (the missing prefix is a 404, once); rank 1 asked nothing
    assert http.counts()["LIST"] == 2 and len(http.requests("prefix/nothing-here", method=None)) == 1


# ------------------------------------------------------------------------------------ in-process


def test_listing_is_concurrent_bounded_and_in_source_order(http: FaultyHTTPServer) -> None:
    http.delay = 0.05  # every GET waits: listings overlap only if they run at once
    sources = [mixer.Source(f"s{i:02d}", http.url(f"prefix/s{i:02d}/")) for i in range(PREFIXES)]
    found = survey(sources, concurrency=3)
    assert 1 < http.peak <= 3, http.peak
    for source, f in zip(sources, found):
        one = list_source(source)
        assert (list(f.shards), f.sizes, f.states) == (list(one.shards), one.shard_bytes, None)
    # two prefixes that list nothing: the error is the first in source order, as one at a time
    broken = [
        *sources[:2],
        mixer.Source("bad1", http.url("prefix/no1/")),
        mixer.Source("bad2", http.url("prefix/no2/")),
    ]
    with pytest.raises(ShardError, match=r"^source 'bad1': no shards match"):
        survey(broken, concurrency=4)


def test_index_verification_is_one_head_per_shard_and_can_be_handed_over(
    http: FaultyHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # no mapped twin of the index from earlier runs
    source = mixer.Source("idx", http.url("idx/"), index=True)
    (found,) = survey([source])
    assert http.counts() == {"LIST": 1, "HEAD": 3, "GET": 0}
    assert found.states is not None and len(found.states) == 3
    http.clear()
    # A rank given the states asks the storage for none of them, and gets the index it would have.
    handed = profiling.listed_from(source, found.listing(), found.states)
    # the index file: one HEAD (which version it is) and one GET (no mapped twin of it yet)
    assert http.counts() == {"LIST": 0, "HEAD": 1, "GET": 1}
    own = list_source(source)
    assert list(handed.shards) == list(own.shards) and list(handed.shard_bytes) == list(own.shard_bytes)
    assert list(handed.index.sizes) == list(own.index.sizes)
    assert handed.index.counts.tolist() == own.index.counts.tolist()


def test_a_cached_listing_sends_no_list_and_says_where_it_is(
    http: FaultyHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    sources = [mixer.Source(f"s{i:02d}", http.url(f"prefix/s{i:02d}/")) for i in range(2)]
    first = mixer.Mixture(sources, batching=mixer.TokenBudget(4096), profile_cache=cache)
    assert http.counts()["LIST"] == 2
    listings = sorted(cache.glob("listing-*.json"))
    assert len(listings) == 2
    http.clear()
    with caplog.at_level(logging.INFO, logger="mixer.plan.startup"):
        second = mixer.Mixture(sources, batching=mixer.TokenBudget(4096), profile_cache=cache)
    assert http.counts() == {"LIST": 0, "HEAD": 0, "GET": 0}
    assert [list(ls.shards) for ls in second.listed] == [list(ls.shards) for ls in first.listed]
    assert second.fingerprint == first.fingerprint
    said = [r.getMessage() for r in caplog.records if "from the listing cached in" in r.getMessage()]
    assert len(said) == 2 and str(listings[0]) in " ".join(said)
    # removing an entry lists that source again (a prefix that gained shards is then seen)
    listings[0].unlink()
    mixer.Mixture(sources, batching=mixer.TokenBudget(4096), profile_cache=cache)
    assert http.counts()["LIST"] == 1
    # credentials are not part of the key (a rotated secret still hits), the endpoint is
    from mixer.plan.profile_cache import listing_key

    a = mixer.Source("a", "s3://b/p/", storage_options={"endpoint_url": "http://x", "secret": "1"})
    b = mixer.Source("a", "s3://b/p/", storage_options={"endpoint_url": "http://x", "secret": "2"})
    c = mixer.Source("a", "s3://b/p/", storage_options={"endpoint_url": "http://y", "secret": "1"})
    assert listing_key(a) == listing_key(b) != listing_key(c)


def _asked(http: FaultyHTTPServer, folder: str) -> int:
    """Bytes the look asked the server for (its GETs carry an end byte) under ``folder``."""
    return sum(r.end - r.start + 1 for r in http.requests() if r.path.startswith(folder) and r.end is not None)


def test_the_look_reads_at_most_its_byte_bound_local_and_remote_alike(http: FaultyHTTPServer, root: Path) -> None:
    budget = mixer.TokenBudget(4096)
    remote = [list_source(mixer.Source(f"b{i}", http.url(f"big/b{i}/"))) for i in range(2)]
    local = [list_source(mixer.Source(f"b{i}", str(root / "big" / f"b{i}") + "/")) for i in range(2)]
    shard = (root / "big" / "b0" / "b0-000000.tar").stat().st_size
    unbounded = profile_sources(local, budget, share=False)
    # A bound of 300 kB per source (100 kB per shard, under a tenth of a shard): 2 x 300 kB asked at most.
    bound = 300_000
    looked = profile_sources(remote, budget, share=False, max_bytes=bound)
    assert 0 < _asked(http, "big/b0/") <= bound and 0 < _asked(http, "big/b1/") <= bound
    assert all(r.end is not None for r in http.requests() if r.path.startswith("big/") and not r.listing)
    assert bound // 3 < shard // 10
    same = profile_sources(local, budget, share=False, max_bytes=bound)
    for a, b, u in zip(looked, same, unbounded):
        assert np.array_equal(a.lengths, b.lengths) and a.tokens_per_byte == b.tokens_per_byte  # the same bytes
        assert 0 < a.lengths.size < u.lengths.size
        assert abs(a.size / u.size - 1) < 0.05, (a.size, u.size)  # the estimate moves by under 5% here
    # Beyond 32 sources the total bounds each: 2 sources sharing 300 kB read 150 kB each (2 shards).
    http.clear()
    shared = profile_sources(remote, budget, share=False, max_total_bytes=300_000, max_bytes=1 << 30)
    assert all(p.lengths.size for p in shared)
    assert 0 < _asked(http, "big/b0/") <= 150_000 and 0 < _asked(http, "big/b1/") <= 150_000
    assert len({r.path for r in http.requests() if not r.listing}) == 4  # 150 kB is two 64 kB windows: 2 shards each


def test_a_first_sample_longer_than_the_bound_is_still_read(tmp_path: Path) -> None:
    write_token_shards(tmp_path, "long", [[60_000, 50], [50, 50]])  # ~240 kB, then small ones
    listed = [list_source(mixer.Source("long", str(tmp_path / "long-{000000..000001}.tar")))]
    (p,) = profile_sources(listed, mixer.TokenBudget(1 << 17), share=False, max_bytes=2 * profiling.MIN_WINDOW)
    assert p.lengths.tolist()[:1] == [60_000]


def test_sources_sharing_an_index_file_are_indexed_one_after_the_other(tmp_path: Path) -> None:
    # Both write tmp_path/mixer-index.json.gz: loaded at once, one would drop the other's entries.
    rng = np.random.default_rng(3)
    patterns = [write_token_shards(tmp_path, name, [rng.integers(8, 99, 20).tolist()] * 2) for name in "ab"]
    sources = [mixer.Source(name, p, index=True) for name, p in zip("ab", patterns)]
    mixer.Mixture(sources, batching=mixer.TokenBudget(4096))
    for p in patterns:
        assert mixer.load_index(p, stale="refuse").reindexed == ()  # every entry there, none stale
