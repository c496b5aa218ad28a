"""Compressed shards (``.tar.gz``, ``.tgz``, ``.tar.xz``, ``.tar.bz2``, ``.tar.zst``): read locally, over
HTTP and S3 on 127.0.0.1, listed in folders and prefixes, resumed mid-shard, and damaged.

The invariant: a compressed shard yields exactly the samples of the same tar uncompressed, with the
same (uncompressed) offsets, so that everything above the byte stream (resume points, ``__end__``,
saved states) cannot tell them apart; and webdataset, which reads such shards natively, agrees.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import servers
import webdataset as wds
import zstandard
from resume_oracle import assert_resumes_exactly, batch_view, take
from servers import FaultyHTTPServer, make_bucket, s3_server, s3_storage_options
from shardutil import expected_tokens, key_lengths, lognormal_lengths, split_evenly, write_token_shards

import mixer
from mixer import storage as mio
from mixer.errors import ShardError
from mixer.read.tario import TarDamage, read_samples
from mixer.storage.compressed import CodecError, DecompressingStream, codec_of
from mixer.storage.filesystems import close_filesystems

SHARDS = 3
OURS = ("__key__", "__offset__", "__end__")
# The codecs other than gzip (which webdataset's ShardWriter writes itself): folder, suffix, compressor.
COMPRESSORS = [
    ("xz", ".tar.xz", lzma.compress),
    ("bz2", ".tar.bz2", bz2.compress),
    ("zst", ".tar.zst", zstandard.ZstdCompressor(level=3).compress),
]
MIXED = ["c-000000.tar", "c-000001.tar.gz", "c-000002.tgz", "c-000003.tar.xz", "c-000004.tar.bz2", "c-000005.tar.zst"]


def samples_of(stream: Any, url: str = "u", start_offset: int = 0) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in s.items() if k != "__url__"} for s in read_samples(stream, url=url, start_offset=start_offset)
    ]


def plain(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return samples_of(f)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def loopback() -> Iterator[None]:
    with servers.remote_test_guard():
        yield


@pytest.fixture(scope="module")
def lengths() -> list[list[int]]:
    return split_evenly(lognormal_lengths(3 * 150, median=300, sigma=0.8, lo=4, hi=4000, seed=11), SHARDS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, lengths: list[list[int]]) -> Path:
    """``tar/``, ``gz/`` (``.tar.gz``), ``tgz/`` and ``xz/`` hold the same three shards, written by
    webdataset's ShardWriter (which gzips a ``.tar.gz``/``.tgz`` name itself); the xz ones are the tars
    compressed with `lzma`. ``mixed/`` holds one of each plus files that are not shards."""
    folder = tmp_path_factory.mktemp("codecs")
    write_token_shards(folder / "tar", "c", lengths)
    write_token_shards(folder / "gz", "c", lengths, suffix=".tar.gz")
    write_token_shards(folder / "tgz", "c", lengths, suffix=".tgz")
    for sub, suffix, compress in COMPRESSORS:
        (folder / sub).mkdir()
        for i in range(SHARDS):
            tar = (folder / "tar" / f"c-{i:06d}.tar").read_bytes()
            (folder / sub / f"c-{i:06d}{suffix}").write_bytes(compress(tar))
    mixed = folder / "mixed"
    mixed.mkdir()
    for name, sub in [("c-000000.tar", "tar"), ("c-000001.tar.gz", "gz"), ("c-000002.tgz", "tgz")]:
        (mixed / name).write_bytes((folder / sub / name).read_bytes())
    (mixed / "c-000003.tar.xz").write_bytes((folder / "xz" / "c-000000.tar.xz").read_bytes())
    (mixed / "c-000004.tar.bz2").write_bytes((folder / "bz2" / "c-000001.tar.bz2").read_bytes())
    (mixed / "c-000005.tar.zst").write_bytes((folder / "zst" / "c-000002.tar.zst").read_bytes())
    (mixed / "notes.gz").write_bytes(gzip.compress(b"not a shard"))
    (mixed / "README.txt").write_bytes(b"not a shard")
    return folder


@pytest.fixture(scope="module")
def http(root: Path) -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(root) as server:
        yield server
        close_filesystems()


@pytest.fixture(scope="module")
def s3(root: Path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("moto.server", reason="the S3 tests need the test extra (moto[server])")
    with s3_server() as endpoint:
        files = {f"{p.parent.name}/{p.name}": p for sub in ("gz", "mixed") for p in sorted((root / sub).iterdir())}
        make_bucket(endpoint, "shards", files)  # type: ignore[arg-type]
        yield s3_storage_options(endpoint)
        close_filesystems()


# ------------------------------------------------------------------------------------ names


@pytest.mark.parametrize(
    ("url", "codec"),
    [
        ("/d/a.tar", None),
        ("/d/a.tar.gz", "gzip"),
        ("/d/A.TGZ", "gzip"),
        ("/d/a.tar.xz", "xz"),
        ("/d/a.tar.bz2", "bzip2"),
        ("/d/a.TBZ2", "bzip2"),
        ("/d/a.tar.zst", "zstd"),
        ("http://h/a.tzst?sig=1", "zstd"),
        ("s3://b/a.tar.gz", "gzip"),
        ("http://h/a.tar.gz?X-Amz-Signature=1", "gzip"),
        ("http://h/a.tar?x=.tgz", None),
        ("/d/a.gz", None),
        ("pipe:cat /d/a.tar.gz", "gzip"),
    ],
)
def test_codec_from_the_name(url: str, codec: str | None) -> None:
    assert codec_of(url) == codec


# ------------------------------------------------------------------------------------ local


@pytest.mark.parametrize(
    "sub, suffix", [("gz", ".tar.gz"), ("tgz", ".tgz"), ("xz", ".tar.xz"), ("bz2", ".tar.bz2"), ("zst", ".tar.zst")]
)
def test_same_samples_and_offsets_as_the_plain_tar(root: Path, sub: str, suffix: str) -> None:
    for i in range(SHARDS):
        want = plain(root / "tar" / f"c-{i:06d}.tar")
        with mio.open_shard(str(root / sub / f"c-{i:06d}{suffix}")) as stream:
            assert isinstance(stream, DecompressingStream)
            assert samples_of(stream) == want
            assert stream.retries == 0 and stream.size is None and 0 < stream.ratio < 1


@pytest.mark.parametrize("name", ["gz/c-000001.tar.gz", "bz2/c-000001.tar.bz2", "xz/c-000001.tar.xz"])
def test_webdataset_reads_the_same(root: Path, name: str) -> None:
    # (webdataset reads what tarfile's "r|*" reads: zstd is not among them before Python 3.14)
    path = root / name
    theirs = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
    with mio.open_shard(str(path)) as stream:
        ours = samples_of(stream)
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in theirs]
    assert all(a["tokens.npy"] == b["tokens.npy"] for a, b in zip(ours, theirs))


def test_open_at_every_sample_offset(root: Path) -> None:
    # a resume point is an uncompressed offset: opening there decompresses and drops what is before
    want = plain(root / "tar" / "c-000002.tar")
    url = str(root / "gz" / "c-000002.tar.gz")
    for k in [0, 1, len(want) // 2, len(want) - 1]:
        start = want[k]["__offset__"]
        with mio.open_shard(url, start_offset=start) as stream:
            assert samples_of(stream, start_offset=start) == want[k:]
            # tell() counts uncompressed bytes: the reader read the whole tar (its 1 MiB chunk covers it)
            assert stream.tell() == (root / "tar" / "c-000002.tar").stat().st_size
    end = want[-1]["__end__"]
    with pytest.raises(
        ShardError, match=r"c-000002\.tar\.gz: start_offset \d+ is past the end of the uncompressed shard"
    ):
        mio.open_shard(url, start_offset=end + 10**6).read(1)


def test_concatenated_members_and_zero_padding(root: Path, tmp_path: Path) -> None:
    # pigz / `cat a.gz b.gz` write several gzip members; tape tools pad with zeros: gzip reads both
    tar = (root / "tar" / "c-000000.tar").read_bytes()
    cuts = [0, 5000, 5001, 20000, len(tar)]
    data = b"".join(gzip.compress(tar[a:b]) for a, b in zip(cuts, cuts[1:])) + bytes(700)
    assert gzip.decompress(data) == tar
    path = tmp_path / "multi.tar.gz"
    path.write_bytes(data)
    with mio.open_shard(str(path)) as stream:
        assert samples_of(stream) == plain(root / "tar" / "c-000000.tar")
    xz = lzma.compress(tar[:30000]) + bytes(8) + lzma.compress(tar[30000:])
    (tmp_path / "multi.tar.xz").write_bytes(xz)
    with mio.open_shard(str(tmp_path / "multi.tar.xz")) as stream:
        assert samples_of(stream) == plain(root / "tar" / "c-000000.tar")
    # pbzip2 and `zstd -T` (and cat) write several streams / frames too
    zst = zstandard.ZstdCompressor()
    for suffix, parts in [
        (".tar.bz2", bz2.compress(tar[:30000]) + bz2.compress(tar[30000:])),
        (".tar.zst", zst.compress(tar[:5000]) + zst.compress(tar[5000:40000]) + zst.compress(tar[40000:]) + bytes(4)),
    ]:
        (tmp_path / f"multi{suffix}").write_bytes(parts)
        with mio.open_shard(str(tmp_path / f"multi{suffix}")) as stream:
            assert samples_of(stream) == plain(root / "tar" / "c-000000.tar")


@pytest.mark.parametrize("codec, sub", [("gzip", "gz"), ("bzip2", "bz2"), ("zstd", "zst")])
def test_memory_stays_bounded_on_highly_compressible_data(codec: str, sub: str) -> None:
    # 64 MiB of zeros compress to almost nothing: one read must not decompress all of it at once
    zeros = bytes(64 << 20)
    data = {"gzip": gzip.compress, "bzip2": bz2.compress, "zstd": zstandard.ZstdCompressor().compress}[codec](zeros)
    stream = DecompressingStream(io.BytesIO(data), url=f"u.{sub}", codec=codec)
    total = 0
    while chunk := stream.read(1 << 20):
        assert len(chunk) <= 1 << 20
        total += len(chunk)
    assert total == len(zeros)


def test_small_reads_and_one_byte_raw_chunks(root: Path) -> None:
    tar = (root / "tar" / "c-000000.tar").read_bytes()
    raw = io.BytesIO((root / "gz" / "c-000000.tar.gz").read_bytes())
    stream = DecompressingStream(raw, url="u", codec="gzip", read_size=1)
    got = b""
    while chunk := stream.read(7):
        assert len(chunk) <= 7
        got += chunk
    assert got == tar and stream.tell() == len(tar)


# ------------------------------------------------------------------------------------ damage


def test_truncated_gzip_delivers_every_sample_before_the_cut(root: Path, tmp_path: Path) -> None:
    # Cut the compressed file in the middle: every sample whose bytes (and the next header) were
    # decompressed before the cut arrives; the damage is a truncation (nothing follows), and names
    # the shard and the codec.
    want = plain(root / "tar" / "c-000001.tar")
    data = (root / "gz" / "c-000001.tar.gz").read_bytes()
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(data[: len(data) // 2])
    # what the cut leaves, decompressed the only way there is: as far as zlib gets
    left = zlib_prefix(data[: len(data) // 2])
    whole = [s for s in want if s["__end__"] + 512 <= len(left)]  # the next header is whole too
    got = []
    with pytest.raises(TarDamage) as err, mio.open_shard(str(path)) as stream:
        for sample in read_samples(stream, url=str(path)):
            got.append({k: v for k, v in sample.items() if k != "__url__"})
    assert got == whole and len(whole) > 10
    assert err.value.truncated and err.value.lost == [want[len(whole)]["__key__"]]
    assert f"{path}: the gzip data ends early, after {len(data) // 2} compressed bytes" in str(err.value)
    assert "the file is truncated" in str(err.value)


def zlib_prefix(data: bytes) -> bytes:
    import zlib

    return zlib.decompressobj(wbits=31).decompress(data)


def test_corrupt_and_mislabelled_data(root: Path, tmp_path: Path) -> None:
    data = bytearray((root / "gz" / "c-000001.tar.gz").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    (tmp_path / "bad.tar.gz").write_bytes(bytes(data))
    with pytest.raises(
        TarDamage,
        match=r"bad\.tar\.gz: corrupt gzip data within the first \d+ compressed bytes \(\d+ bytes into the tar\): "
        r"Error -3",
    ) as err:
        plain_or_gz(tmp_path / "bad.tar.gz")
    assert not err.value.truncated and isinstance(err.value.__cause__, CodecError)

    (tmp_path / "plain.tar.gz").write_bytes((root / "tar" / "c-000000.tar").read_bytes())
    with pytest.raises(
        TarDamage,
        match=r"plain\.tar\.gz: the name says gzip, but this is not gzip data \(it starts with b'c-000000-000000\.'\)$",
    ):
        plain_or_gz(tmp_path / "plain.tar.gz")

    (tmp_path / "empty.tgz").write_bytes(b"")
    with pytest.raises(TarDamage, match=r"empty\.tgz: empty file \(0 bytes\), not a gzip-compressed tar shard$"):
        plain_or_gz(tmp_path / "empty.tgz")

    # junk after the gzip stream: the tar ends before it (as junk after a plain tar's end block is
    # never read), but a stream read to its end says what follows the gzip data
    (tmp_path / "junk.tar.gz").write_bytes((root / "gz" / "c-000000.tar.gz").read_bytes() + b"JUNK")
    assert plain_or_gz(tmp_path / "junk.tar.gz") == plain(root / "tar" / "c-000000.tar")
    with pytest.raises(
        CodecError,
        match=r"junk\.tar\.gz: data after the end of the gzip stream \(\d+ bytes of tar\): it starts with b'JUNK'$",
    ):
        mio.open_shard(str(tmp_path / "junk.tar.gz")).read()

    # a gzip file named .tar says what it is (see mixer.read.tario)
    (tmp_path / "gz.tar").write_bytes((root / "gz" / "c-000000.tar.gz").read_bytes())
    with pytest.raises(
        TarDamage, match=r"gz\.tar: not a tar file .*gzip-compressed data: name the shard \.tar\.gz or \.tgz"
    ):
        plain_or_gz(tmp_path / "gz.tar")


def plain_or_gz(path: Path) -> list[dict[str, Any]]:
    with mio.open_shard(str(path)) as stream:
        return samples_of(stream, url=str(path))


# ------------------------------------------------------------------------------------ listing


def test_folder_and_glob_list_every_kind(root: Path) -> None:
    listed = mio.expand_urls(str(root / "mixed"))
    names = [os.path.basename(u) for u, _ in listed]
    assert names == MIXED
    assert all(size == os.path.getsize(u) for u, size in listed)
    assert [os.path.basename(u) for u, _ in mio.expand_urls(str(root / "mixed" / "*.t*z"))] == [
        "c-000001.tar.gz",
        "c-000002.tgz",
        "c-000003.tar.xz",
    ]


def test_http_and_s3_prefixes_list_compressed_shards(http: FaultyHTTPServer, s3: dict[str, Any]) -> None:
    names = MIXED
    assert [u.rsplit("/", 1)[1] for u, _ in mio.expand_urls(http.url("mixed/"))] == names
    listed = mio.expand_urls("s3://shards/mixed/", storage_options=s3)
    assert [u.rsplit("/", 1)[1] for u, _ in listed] == names and all(size for _, size in listed)


# ------------------------------------------------------------------------------------ remote


def test_http_gzip_with_a_reset_mid_shard(http: FaultyHTTPServer, root: Path) -> None:
    # the compressed bytes come through the resumable remote stream: a reset in the middle of the
    # compressed body is retried from the byte where it broke, and the tar comes out whole
    http.clear()
    size = (root / "gz" / "c-000000.tar.gz").stat().st_size
    http.fail("gz/c-000000.tar.gz", "reset", after=size // 2, pause=0.05)
    with mio.open_shard(
        http.url("gz/c-000000.tar.gz"), timeout=30.0, backoff=0.01
    ) as stream:  # (no stall here: no false timeout under load)
        assert samples_of(stream) == plain(root / "tar" / "c-000000.tar")
    gets = http.requests("gz/c-000000.tar.gz")
    assert gets[0].start is None
    # the retries are those of the faults the server served (the reset), each asked again once
    assert [r.fault for r in http.served("gz/c-000000.tar.gz")] == ["reset"]
    seen = servers.resends(gets)
    assert stream.retries == seen.after_fault == 1 and seen.after_healthy == 0
    # resuming at an uncompressed offset asks the server for the compressed shard from its start
    http.clear()
    want = plain(root / "tar" / "c-000001.tar")
    start = want[40]["__offset__"]
    with mio.open_shard(http.url("gz/c-000001.tar.gz"), start_offset=start) as stream:
        assert samples_of(stream, start_offset=start) == want[40:]
    assert [(r.start, r.status) for r in http.requests("gz/c-000001.tar.gz")] == [(None, 200)]


@pytest.mark.parametrize("where", ["local", "http", "s3"])
@pytest.mark.parametrize("workers", [0, 2])
def test_mixture_over_gzip_shards_delivers_everything_once(
    root: Path, http: FaultyHTTPServer, s3: dict[str, Any], lengths: list[list[int]], where: str, workers: int
) -> None:
    pattern, options = {
        "local": (str(root / "gz"), None),
        "http": (http.url("gz/c-{000000..000002}.tar.gz"), None),
        "s3": ("s3://shards/gz/", s3),
    }[where]
    mix = mixer.Mixture(
        [mixer.Source("c", pattern, storage_options=options)],
        batching=mixer.TokenBudget(max_tokens=8192),
        stop="all_exhausted",
        seed=4,
    )
    # the size estimate works in the listing's units (compressed bytes) as for plain shards
    profile = mix.profiles[0]
    total = sum(sum(x) for x in lengths)
    assert 0.5 * total < profile.size < 2 * total
    loader = mixer.make_loader(mix, num_workers=workers)
    want = key_lengths("c", lengths)
    got = {}
    for batch in loader:
        for row, key in enumerate(batch.keys):
            n = int(batch.lengths[row])
            assert np.array_equal(batch.tokens[row, :n].numpy(), expected_tokens(key, n)), key
            assert key not in got
            got[key] = n
    assert got == want
    counters = loader.counters()["c"]
    assert counters["shards_finished"] == SHARDS and counters["skipped_shards"] == 0


@pytest.mark.parametrize(
    "where, sub, suffix",
    [("local", "gz", ".tar.gz"), ("http", "gz", ".tar.gz"), ("local", "bz2", ".tar.bz2"), ("http", "zst", ".tar.zst")],
)
def test_resume_mid_shard_gives_the_uninterrupted_run(
    root: Path, http: FaultyHTTPServer, where: str, sub: str, suffix: str
) -> None:
    # The shared resume oracle: cut anywhere (mid-shard, with samples in the shuffle and bucket
    # buffers), save, restore into a fresh loader, and the batches that follow are the same.
    pattern = str(root / sub) if where == "local" else http.url(f"{sub}/c-{{000000..000002}}{suffix}")
    mix = mixer.Mixture(
        [mixer.Source("c", pattern)],
        batching=mixer.TokenBudget(max_tokens=4096),
        shuffle_buffer=16,
        state_every=1,
        seed=2,
    )
    loader = mixer.make_loader(mix)
    reference = [batch_view(b) for b in take(loader, 7)]
    stream = mixer.state.checkpoint.readable(loader.state_dict()["readers"][0]["snapshot"])["streams"][0]
    assert stream["next_offset"] > 0 and stream["buffer"], "the cut at 7 should fall mid-shard, with buffered samples"
    reference = [batch_view(b) for b in take(mixer.make_loader(mix), 60)]
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix), cuts=[1, 7, 23, 41], window=12, view=batch_view, reference=reference
    )


def test_read_ahead_reuses_a_begun_download_for_a_resume(http: FaultyHTTPServer, root: Path) -> None:
    # a compressed shard begun ahead (from byte 0) serves an open at any uncompressed offset
    http.clear()
    ahead = mio.ReadAhead(options={"read_ahead": 1})
    try:
        first = ahead.open(http.url("gz/c-000000.tar.gz"), 0, [http.url("gz/c-000001.tar.gz")])
        first.close()
        want = plain(root / "tar" / "c-000001.tar")
        start = want[3]["__offset__"]
        with ahead.open(http.url("gz/c-000001.tar.gz"), start, []) as stream:
            assert samples_of(stream, start_offset=start) == want[3:]
    finally:
        ahead.close()
    assert len(http.requests("gz/c-000001.tar.gz")) == 1
