"""Remote sources end to end: a `Mixture` over ``http://`` and ``s3://`` shards, through `make_loader`
with 0 and 2 workers, while the servers on 127.0.0.1 misbehave.

The invariant every fault test checks: the run finishes; every delivered sample is delivered once,
with exactly its tokens; the only samples missing are those of the permanently broken shard or
member, worked out below from the tar layout (never by running the reader); and the loader's
counters say what was skipped and retried.

Two facts fix where the expectations come from:

* the source reads a few samples up front, in the main process, from shards 0, 2 and 3 of 4 (see
  `mixer.plan.profiling.profile_sources`), so the streaming faults hit shard 1 and are armed after the `Mixture` is
  built; `test_fault_during_profiling` arms them before;
* the retries the loader counts are those the server saw: every fault the server serves is recorded
  (`FaultyHTTPServer.served`), and a reader GETs a shard again only to retry it (`readers_resends`),
  so the expected count is taken from the server's log, never from how long anything took;
* the tar reader yields a sample once the next sample's first header has arrived (or at the
  end-of-archive block), so a shard cut inside the data of member ``j`` (one member per sample here)
  delivers samples ``0 .. j-1`` and loses ``j`` (counted: its header was read) and whatever the cut
  removed; a corrupt header ``j`` names no member, so ``j-1`` (which might have had more members
  there) is lost with it, counted, and the rest of the shard is counted in bytes only.
"""

from __future__ import annotations

import logging
import re
import tarfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from servers import (  # noqa: F401 (remote_guard: a module-wide autouse fixture)
    FaultyHTTPServer,
    Request,
    Resends,
    make_bucket,
    remote_guard,
    resends,
    s3_client,
    s3_server,
    s3_storage_options,
)
from shardutil import expected_tokens, token_key, write_token_shards

import mixer
from mixer import storage as mio
from mixer.errors import ConfigError, SampleError, ShardError
from mixer.storage.filesystems import close_filesystems

log = logging.getLogger(__name__)

SHARDS = 4
PER_SHARD = 10
FAULTY = 1  # not among the shards the profile reads (0, 2, 3), so its faults hit while streaming
# Retries wait ~10 ms. Reads time out only after 30 s, so that a machine loaded by parallel jobs
# never makes a healthy response look stalled; the cases that inject a stall (5 s) add STALLS, which
# counts it after 1 s, short enough that a healthy answer slowed by load may time out too: those
# cases count such a retry where the server saw it (`readers_resends`), and only there.
FAST = {"timeout": 30.0, "retries": 3, "backoff": 0.01}
STALLS = {"timeout": 1.0}
NAME = f"bucket/x-{FAULTY:06d}.tar"
PATTERN = "bucket/x-{000000..000003}.tar"


class Member(NamedTuple):
    key: str
    header: int  # offset of its tar header
    data: int  # offset of its data
    size: int


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bucket/x-00000{0..3}.tar``: 10 samples each, lengths 16..400 (a folder the HTTP server serves,
    and a bucket of the same name when that server poses as S3)."""
    folder = tmp_path_factory.mktemp("remote_mixture")
    rng = np.random.default_rng(5)
    lengths = [rng.integers(16, 400, PER_SHARD).tolist() for _ in range(SHARDS)]
    write_token_shards(folder / "bucket", "x", lengths)
    return folder


@pytest.fixture(scope="module")
def layout(root: Path) -> dict[int, list[Member]]:
    """Every shard's members as Python's tarfile reads the intact files."""
    out = {}
    for shard in range(SHARDS):
        with tarfile.open(root / "bucket" / f"x-{shard:06d}.tar") as tar:
            out[shard] = [Member(m.name.split(".", 1)[0], m.offset, m.offset_data, m.size) for m in tar.getmembers()]
        assert [m.key for m in out[shard]] == [token_key("x", shard, i) for i in range(PER_SHARD)]
    return out


@pytest.fixture(scope="module")
def everything(layout: dict[int, list[Member]]) -> set[str]:
    return {m.key for members in layout.values() for m in members}


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(root) as s:
        yield s
        close_filesystems()


@pytest.fixture
def http(server: FaultyHTTPServer) -> FaultyHTTPServer:
    server.clear()
    return server


def where(http: FaultyHTTPServer, transport: str) -> tuple[str, dict[str, Any] | None]:
    """The source's URL pattern and storage_options: the faulty server as itself, or posing as an S3
    endpoint (a GetObject is a GET of /bucket/key, so its faults reach the real botocore stack)."""
    if transport == "http":
        return http.url(PATTERN), None
    return f"s3://{PATTERN}", s3_storage_options(http.url().rstrip("/"))


def run(
    urls: str,
    *,
    workers: int,
    on_error: str = "skip",
    storage_options: dict[str, Any] | None = None,
    arm: Callable[[], None] | None = None,
    io_options: dict[str, Any] | None = None,
) -> tuple[list[str], dict[str, int]]:
    """One pass (stop="all_exhausted") through make_loader: the delivered keys, in order, each checked
    against its exact tokens, and the source's counters. ``arm`` runs after the Mixture is built."""
    source = mixer.Source(
        "x",
        urls,
        on_error=on_error,
        storage_options=storage_options,
        io_options={**FAST, **(io_options or {})},  # type: ignore[arg-type]
    )
    mix = mixer.Mixture([source], batching=mixer.TokenBudget(max_tokens=2048), stop="all_exhausted", seed=0)
    if arm is not None:
        arm()
    loader = mixer.make_loader(mix, num_workers=workers)
    keys = []
    try:
        for batch in loader:
            for b, key in enumerate(batch.keys):
                n = int(batch.lengths[b])
                assert np.array_equal(batch.tokens[b, :n].numpy(), expected_tokens(key, n)), key
                assert not batch.tokens[b, n:].any()
                keys.append(key)
    except Exception as exc:
        # torch re-raises a worker's error from a frame that holds it (a reference cycle through
        # the traceback), which would keep the DataLoader iterator alive until the cyclic GC finds
        # it; shut its workers down now instead.
        traceback.clear_frames(exc.__traceback__)
        raise
    return keys, loader.counters()["x"]


def check(keys: list[str], everything: set[str], missing: set[str]) -> None:
    assert len(keys) == len(set(keys)), "a sample was delivered twice"
    assert missing <= everything
    assert set(keys) == everything - missing


def keys_from(layout: dict[int, list[Member]], shard: int, first: int) -> set[str]:
    return {m.key for m in layout[shard][first:]}


def readers_resends(http: FaultyHTTPServer) -> Resends:
    """The readers' retries as the server saw them: over each shard's reader GETs, in order, those
    that asked again after a retriable fault and those that asked again after a healthy answer. The
    up-front look's GETs carry an end byte, the readers' never; and a reader GETs a shard again only
    to retry (the shards are small and 64 connections plenty: no stream ever gives way), so the
    loader's ``retries`` counter must be the sum of the two."""
    gets: dict[str, list[Request]] = {}
    for r in http.requests():
        if r.end is None:
            gets.setdefault(r.path, []).append(r)
    seen = [resends(g) for g in gets.values()]
    return Resends(sum(s.after_fault for s in seen), sum(s.after_healthy for s in seen))


def check_retries(http: FaultyHTTPServer, counters: dict[str, int], *, short_timeout: bool = False) -> None:
    """The loader's ``retries`` equal what the server saw: one per retriable fault it served a reader
    (each retried once: no shard here gives up), plus, where the read timeout is short, the healthy
    answers a reader gave up on (the server saw each asked for again); with the 30 s timeout none."""
    served = [r for r in http.served() if r.end is None]
    seen = readers_resends(http)
    assert seen.after_fault == sum(r.retriable for r in served), (seen, served)
    if not short_timeout:
        assert seen.after_healthy == 0, [(r.path, r.start, r.status, r.fault) for r in http.requests()]
    elif seen.after_healthy:
        log.warning("%d healthy answer(s) timed out under load and were retried", seen.after_healthy)
    assert counters["retries"] == seen.after_fault + seen.after_healthy, (counters, seen)


# ------------------------------------------------------------------------------------ faults

# (id, arm(server, members of the faulty shard), index of the first lost sample or None, lost member
# or None, expected counters but the retries given the members and the intact shard's size, the faults
# the server must have served, in order: the retries are checked against these by `check_retries`)
Counts = Callable[[list[Member], int], dict[str, int]]
Arm = Callable[[FaultyHTTPServer, list[Member]], None]
FAULTS: list[tuple[str, Arm, int | None, int | None, Counts, list[str]]] = [
    (
        "503_twice",
        lambda s, m: s.fail(NAME, "status", status=503, times=2),
        None,
        None,
        lambda m, size: {},
        ["status 503"] * 2,
    ),
    (
        "reset_mid_shard",
        lambda s, m: s.fail(NAME, "reset", after=m[4].data + 100, pause=0.05),
        None,
        None,
        lambda m, size: {},
        ["reset"],
    ),
    (
        "stall",
        lambda s, m: s.fail(NAME, "stall", after=m[6].data + 7, seconds=5),
        None,
        None,
        lambda m, size: {},
        ["stall"],
    ),
    # the whole shard, uncounted (a brace pattern lists no sizes, and no response told one)
    (
        "404",
        lambda s, m: s.fail(NAME, "status", status=404, times=None),
        0,
        None,
        lambda m, size: {"skipped_shards": 1, "skipped_unknown": 1},
        ["status 404"],
    ),
    # cut inside member 6's data: samples 0..5 arrive (6's header proves 5 complete); 6 is lost,
    # counted exactly, and the shard ends there: the bytes from 6's header to the cut
    (
        "truncated",
        lambda s, m: s.truncate(NAME, m[6].data + 10),
        6,
        None,
        lambda m, size: {"skipped_shards": 1, "skipped_samples": 1, "skipped_bytes": m[6].data + 10 - m[6].header},
        ["truncate"],
    ),
    # the first 8 bytes of member 3's data (the .npy magic) overwritten: that sample alone fails to decode
    (
        "corrupt_member",
        lambda s, m: s.corrupt(NAME, m[3].data),
        None,
        3,
        lambda m, size: {"skipped_samples": 1},
        ["corrupt"],
    ),
    # member 7's tar header overwritten (bad checksum): sample 6 might have continued there, so it is
    # lost with the rest; the rest is unknown in samples, known in bytes (the server told the size)
    (
        "corrupt_header",
        lambda s, m: s.corrupt(NAME, m[7].header),
        6,
        None,
        lambda m, size: {
            "skipped_shards": 1,
            "skipped_samples": 1,
            "skipped_unknown": 1,
            "skipped_bytes": size - m[6].header,
        },
        ["corrupt"],
    ),
]
ZERO = {"skipped_shards": 0, "skipped_samples": 0, "skipped_bytes": 0, "skipped_unknown": 0}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("transport", ["http", "s3"])
@pytest.mark.parametrize("fault, arm, lost_from, lost_member, counts, served", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_while_streaming(
    http: FaultyHTTPServer,
    layout: dict[int, list[Member]],
    everything: set[str],
    transport: str,
    workers: int,
    fault: str,
    arm: Callable[[FaultyHTTPServer, list[Member]], None],
    lost_from: int | None,
    lost_member: int | None,
    counts: Counts,
    served: list[str],
    root: Path,
) -> None:
    urls, options = where(http, transport)
    members = layout[FAULTY]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, counters = run(
            urls,
            workers=workers,
            storage_options=options,
            arm=lambda: arm(http, members),
            io_options=STALLS if fault == "stall" else None,
        )
    missing = set()
    if lost_from is not None:
        missing = keys_from(layout, FAULTY, lost_from)
    if lost_member is not None:
        missing = {members[lost_member].key}
    check(keys, everything, missing)
    size = (root / NAME).stat().st_size
    assert {k: counters[k] for k in ZERO} == {**ZERO, **counts(members, size)}
    assert counters["samples"] == len(everything) - len(missing)
    # The faults a reader met, on the faulty shard, each exactly once (the 404 too: it is not retried).
    assert [(r.path, r.fault or r.version, r.end) for r in http.served()] == [(NAME, f, None) for f in served]
    check_retries(http, counters, short_timeout=fault == "stall")
    if workers == 0 and missing:  # (a worker's warnings stay in the worker)
        skipping = [str(w.message) for w in caught if "skipping" in str(w.message)]
        assert len(skipping) == 1 and f"x-{FAULTY:06d}.tar" in skipping[0], skipping


@pytest.mark.parametrize("workers", [0, 2])
def test_fault_during_profiling(
    http: FaultyHTTPServer, layout: dict[int, list[Member]], everything: set[str], workers: int
) -> None:
    # Shard 0 answers 503 once and shard 2 is gone: the up-front look (main process) retries the first
    # and, under on_error="skip", passes over the second; the readers then skip shard 2 and count it.
    urls, _ = where(http, "http")

    def arm_before() -> None:
        http.fail("bucket/x-000000.tar", "status", status=503)
        http.fail("bucket/x-000002.tar", "status", status=404, times=None)

    arm_before()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, counters = run(urls, workers=workers)
    assert [str(w.message) for w in caught if "profiling" in str(w.message)] == [
        f"source 'x': profiling skips shard {http.url('bucket/x-000002.tar')}: shard {http.url('bucket/x-000002.tar')} "
        "at byte 0: not found (HTTP 404)"
    ]
    check(keys, everything, keys_from(layout, 2, 0))
    # the look's requests are ranged with an end byte (206), the readers' whole (200)
    first = http.requests("bucket/x-000000.tar")
    assert [r.status for r in first][:2] == [503, 206] and first[1].start == 0 and first[1].end is not None
    assert (counters["skipped_shards"], counters["skipped_samples"]) == (1, 0)
    # The look met the 503 and a 404, a reader the other 404 (the look's retry is counted in its
    # profile, not by the readers: they retried nothing, and the server saw them ask nothing twice).
    assert sorted((r.path, r.fault, r.end is None) for r in http.served()) == [
        ("bucket/x-000000.tar", "status 503", False),
        ("bucket/x-000002.tar", "status 404", False),
        ("bucket/x-000002.tar", "status 404", True),
    ]
    check_retries(http, counters)

    # under on_error="raise", building the Mixture fails and names the shard
    with pytest.raises(
        ShardError,
        match=r"^source 'x': shard http://127\.0\.0\.1:\d+/bucket/x-000002\.tar at byte 0: not found \(HTTP 404\)",
    ):
        mixer.Mixture([mixer.Source("x", urls, io_options=FAST)], batching=mixer.TokenBudget(max_tokens=2048))


# ------------------------------------------------------------------------------ on_error="raise"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_raise_names_url_shard_and_byte(http: FaultyHTTPServer, layout: dict[int, list[Member]], workers: int) -> None:
    urls, _ = where(http, "http")
    members = layout[FAULTY]
    url = re.escape(http.url(NAME))
    cut = members[6].data + 10
    cases: list[tuple[Callable[[], None], type[Exception], str, int]] = [
        (
            lambda: http.fail(NAME, "status", status=404, times=None),
            ShardError,
            rf"source 'x': shard {url} at byte 0: not found \(HTTP 404\)",
            3,
        ),
        (lambda: http.truncate(NAME, cut), ShardError, rf"source 'x': {url}: shard is truncated at byte {cut}", 3),
        (
            lambda: http.corrupt(NAME, members[7].header),
            ShardError,
            rf"source 'x': {url}: corrupt header at offset {members[7].header}: bad checksum",
            3,
        ),
        (
            lambda: http.corrupt(NAME, members[3].data),
            SampleError,
            rf"source 'x': shard {url}, key '{members[3].key}' member 'tokens.npy'",
            3,
        ),
        (
            lambda: (  # stalls after member 2's header, then every resume stalls before its first byte
                http.fail(NAME, "stall", after=members[2].data, seconds=5),
                http.fail(NAME, "stall", after=0, seconds=5, times=None),
            ),
            ShardError,
            rf"source 'x': shard {url} at byte {members[2].data}: timed out .*; gave up after 1 retries in a row",
            1,
        ),
    ]
    for arm, kind, pattern, retries in cases:
        http.clear()
        with pytest.raises(kind, match=pattern):
            run(
                urls,
                workers=workers,
                on_error="raise",
                arm=arm,
                io_options={"retries": retries, **(STALLS if "timed out" in pattern else {})},
            )


# ------------------------------------------------------------------------------- real S3 (moto)


@pytest.fixture(scope="module")
def moto(root: Path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("moto.server", reason="the S3 tests need the test extra (moto[server])")
    with s3_server() as endpoint:
        files = {p.name: p for p in sorted((root / "bucket").glob("*.tar"))}
        make_bucket(endpoint, "bucket", files)  # type: ignore[arg-type]
        yield {"endpoint": endpoint, "options": s3_storage_options(endpoint), "files": files}
        close_filesystems()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the skips are counted; their warnings are tested above
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_moto_s3(moto: dict[str, Any], layout: dict[int, list[Member]], everything: set[str], workers: int) -> None:
    urls = "s3://bucket/x-{000000..000003}.tar"
    client = s3_client(moto["endpoint"])
    key = f"x-{FAULTY:06d}.tar"
    original = Path(moto["files"][key]).read_bytes()
    cut = layout[FAULTY][6].data + 10
    try:
        keys, counters = run(urls, workers=workers, storage_options=moto["options"])
        check(keys, everything, set())
        assert counters["retries"] == counters["skipped_shards"] == 0

        # the object is deleted after the source was built: NoSuchKey, a permanent fault
        keys, counters = run(
            urls,
            workers=workers,
            storage_options=moto["options"],
            arm=lambda: client.delete_object(Bucket="bucket", Key=key),
        )
        check(keys, everything, keys_from(layout, FAULTY, 0))
        assert counters["skipped_shards"] == 1
        with pytest.raises(
            ShardError,
            match=r"source 'x': shard s3://bucket/x-000001\.tar at byte 0: not found: NoSuchKey \(HTTP 404\)",
        ):
            run(urls, workers=workers, on_error="raise", storage_options=moto["options"])

        # a truncated object
        client.put_object(Bucket="bucket", Key=key, Body=original[:cut])
        keys, counters = run(urls, workers=workers, storage_options=moto["options"])
        check(keys, everything, keys_from(layout, FAULTY, 6))
        assert (counters["skipped_shards"], counters["skipped_samples"], counters["skipped_unknown"]) == (1, 1, 0)
        assert counters["skipped_bytes"] == cut - layout[FAULTY][6].header
    finally:
        client.put_object(Bucket="bucket", Key=key, Body=original)
        client.close()


# ------------------------------------------------------------------------------------ security

SECRET = "SIGSECRET123"


def _texts(exc: BaseException) -> list[str]:
    return ["".join(traceback.format_exception(exc))] + [repr(exc)]


def test_presigned_urls_never_appear_in_errors_warnings_or_logs(
    http: FaultyHTTPServer,
    layout: dict[int, list[Member]],
    everything: set[str],
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    secret_url = (
        http.url(PATTERN).replace("127.0.0.1", "user:PASSWORD9@127.0.0.1")
        + f"?X-Amz-Credential=AKIA9&X-Amz-Signature={SECRET}"
    )
    members = layout[FAULTY]

    def arm() -> None:
        http.fail("bucket/x-000000.tar", "status", status=503)  # a retry (logged)
        http.fail("bucket/x-000002.tar", "reset", after=members[2].data, pause=0.05)  # a retry mid-shard
        http.fail("bucket/x-000003.tar", "status", status=404, times=None)  # a skipped shard (warned)
        http.corrupt(NAME, members[3].data)  # a skipped sample (warned)

    texts = []
    caplog.set_level(logging.DEBUG, logger="mixer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, counters = run(secret_url, workers=0, arm=arm)
    check(keys, everything, keys_from(layout, 3, 0) | {members[3].key})
    assert (counters["skipped_shards"], counters["skipped_samples"]) == (1, 1)
    assert sorted((r.path, r.fault or r.version) for r in http.served()) == [
        ("bucket/x-000000.tar", "status 503"),
        (NAME, "corrupt"),
        ("bucket/x-000002.tar", "reset"),
        ("bucket/x-000003.tar", "status 404"),
    ]
    check_retries(http, counters)  # the 503 and the reset: 2
    texts += [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert any("x-000003.tar" in t for t in texts) and any("retry" in t for t in texts)

    # errors, in this process and through a worker (whose traceback travels as text)
    for workers, make in [
        (0, lambda: http.truncate(NAME, members[6].data + 10)),
        (2, lambda: http.fail(NAME, "status", status=403, times=None)),
    ]:
        http.clear()
        with pytest.raises(ShardError) as info:
            run(secret_url, workers=workers, on_error="raise", arm=make)
        assert "bucket/x-000001.tar" in str(info.value)
        texts += _texts(info.value)
    with pytest.raises(
        ShardError
    ) as info:  # at the door (listing, when the mixture is built): a prefix that lists nothing
        source = mixer.Source("y", secret_url.split("x-{")[0] + "nope/?X-Amz-Signature=" + SECRET, io_options=FAST)
        mixer.Mixture([source], batching=mixer.TokenBudget(max_tokens=2048))
    texts += _texts(info.value)
    out, err = capfd.readouterr()
    texts += [out, err]
    for text in texts:
        assert SECRET not in text and "PASSWORD9" not in text and "AKIA9" not in text, text


def test_pipe_only_from_code(root: Path, everything: set[str]) -> None:
    pattern = f"pipe:cat {root}/bucket/x-{{000000..000003}}.tar"
    with pytest.raises(
        ConfigError, match=r"^Source\('p'\)\.urls\[0\]: pipe:cat .*'pipe:' URLs run a shell command, .*allow_pipe=True"
    ):
        mixer.Source("p", pattern)
    config = {"sources": [{"name": "x", "urls": pattern}], "batching": {"max_tokens": 2048}, "stop": "all_exhausted"}
    with pytest.raises(ConfigError, match=r"allow_pipe=True"):
        mixer.load_config(config)
    # a config file cannot switch it on ...
    with pytest.raises(
        ConfigError, match=r"^sources\[0\]\.allow_pipe: not a config key: 'pipe:' URLs run shell commands"
    ):
        mixer.parse_config({**config, "sources": [{"name": "x", "urls": pattern, "allow_pipe": True}]})
    # ... the code that loads it can
    loader = mixer.make_loader(mixer.load_config(config, allow_pipe=True))
    keys = [k for batch in loader for k in batch.keys]
    check(keys, everything, set())


def test_io_options_are_validated(http: FaultyHTTPServer) -> None:
    urls, _ = where(http, "http")
    for options, message in [
        ({"timout": 1}, "Source('x').io_options: unknown key 'timout'; did you mean 'timeout'?"),
        ({"timeout": 0}, "Source('x').io_options.timeout: must be > 0, got 0"),
        ({"read_ahead": -1}, "Source('x').io_options.read_ahead: must be >= 0, got -1"),
        ({"retries": True}, "Source('x').io_options.retries: must be an integer, got True"),
        ({"max_connections": 0}, "Source('x').io_options.max_connections: must be >= 1, got 0"),
        ({"max_connections": 2.5}, "Source('x').io_options.max_connections: must be an integer, got 2.5"),
    ]:
        with pytest.raises(ConfigError) as info:
            mixer.Source("x", urls, io_options=options)
        assert str(info.value) == message
    assert mixer.Source("x", urls, io_options={"read_ahead": 0}).io_options == mio.IOOptions(read_ahead=0)


@pytest.mark.slow
def test_remote_benchmark_runs(tmp_path: Path) -> None:
    # `python -m benchmarks remote --quick` end to end (local vs loopback HTTP); no figure is judged
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "remote",
            "--quick",
            "--quiet",
            "--methods",
            "local,http",
            "--bench-dir",
            str(tmp_path),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| remote | mixer over loopback HTTP / local disk, real tokens/s |" in proc.stdout
    result = json.loads((tmp_path / "remote.quick.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    total = sum(s["samples"] for s in result["config"]["sources"])
    assert rows["local"]["status"] == rows["http"]["status"] == "ok"
    assert rows["local"]["samples"] == rows["http"]["samples"] == total
