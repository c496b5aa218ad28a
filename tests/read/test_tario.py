"""`mixer.read.tario` against webdataset/tarfile on real shards, and its failure modes (with and
without the compiled core: the `reader` fixture runs each test both ways).

Parity: on every shard here `read_samples` must give exactly what `webdataset.WebDataset(url,
shardshuffle=False)` gives (same keys in the same order, same bytes per extension), and
`iter_members` exactly what `tarfile` lists (names, header offsets, data). Where webdataset/tarfile
end silently (a cut or a corrupt header mid-shard), we must raise a `ShardError` naming url and offset.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import random
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from mixer.errors import ConfigError, SampleError, ShardError
from mixer.read import tario
from mixer.read.tario import TarDamage, group_samples, iter_members, read_samples

MTIME = 1_700_000_000
OURS_ONLY = {"__key__", "__url__", "__offset__", "__end__", "__local_path__"}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, params=["compiled", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs against both readers: `read_samples` with the compiled core (the
    default where it was built) and with the pure-Python one (`mixer.read.tario.NATIVE = False`)."""
    if request.param == "compiled" and tario._tarwalk is None:
        pytest.skip("mixer._native._tarwalk was not built (no C compiler at install)")
    monkeypatch.setattr(tario, "NATIVE", request.param == "compiled")
    return str(request.param)


def ours(path: Path, **kw: Any) -> list[dict[str, Any]]:
    with open(path, "rb") as stream:
        return list(read_samples(stream, url=str(path), **kw))


def theirs(path: Path) -> list[dict[str, Any]]:
    return list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))


def payload(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sample.items() if k not in OURS_ONLY}


def assert_same_as_webdataset(path: Path) -> list[dict[str, Any]]:
    got, want = ours(path), theirs(path)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    for a, b in zip(got, want):
        assert payload(a) == payload(b), a["__key__"]
        assert all(type(v) is bytes for v in payload(a).values())
        assert a["__url__"] == str(path)
    return got


def tarfile_members(path: Path) -> list[tuple[str, int, bytes]]:
    """What tarfile itself lists: (name, offset of the first header block, data) of regular members."""
    with tarfile.open(path) as tf:
        return [(m.name, m.offset, tf.extractfile(m).read()) for m in tf.getmembers() if m.isreg()]


def our_members(path: Path, **kw: Any) -> list[tuple[str, int, bytes]]:
    with open(path, "rb") as stream:
        return list(iter_members(stream, url=str(path), **kw))


def write_tar(path: Path, members: Sequence[tuple[str, bytes | str]], fmt: int, **tar_kw: Any) -> Path:
    """Write members with tarfile directly (TarWriter ignores its `format`). A str value is a
    non-regular member: "dir" or "symlink:target"."""
    with tarfile.open(path, "w", format=fmt, **tar_kw) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime = MTIME
            if data == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data.split(":", 1)[1]
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def write_samples(path: Path, samples: Sequence[dict[str, Any]], **writer_kw: Any) -> Path:
    with wds.TarWriter(str(path), **writer_kw) as writer:
        for sample in samples:
            writer.write(dict(sample))
    return path


def token_samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "__key__": f"{i:06d}",
            "tokens.npy": rng.integers(0, 30000, int(rng.integers(1, 700)), dtype=np.int32),
            "txt": f"t{i}",
        }
        for i in range(n)
    ]


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def header(
    name: str, size: int, *, type: bytes = tarfile.REGTYPE, fmt: int = tarfile.USTAR_FORMAT, **attrs: Any
) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mtime = size, type, MTIME
    for k, v in attrs.items():
        setattr(info, k, v)
    return info.tobuf(fmt, "utf-8", "surrogateescape")


def raw_member(name: str, data: bytes, **kw: Any) -> bytes:
    return header(name, len(data), **kw) + pad(data)


def set_checksum(block: bytes, value: int) -> bytes:
    return block[:148] + b"%06o\0 " % value + block[156:]


END = bytes(1024)

# Members that exercise webdataset's rules: skipped metadata, names without an extension, a hidden
# file, non-consecutive keys, directories, links, upper-case and multi-dot extensions, deep and long
# and non-ASCII paths, empty data, a member bigger than several blocks.
TRICKY = [
    ("a.txt", b"1"),
    ("a.cls", b"2"),
    ("__meta__", b"skipped: __x__ without a slash"),
    ("__dir__/x.txt", b"skipped: __x__/ prefix"),
    ("README", b"skipped: no extension"),
    ("a.seg.0.TXT", b"3"),  # still sample "a": the skipped members did not split it
    ("__meta__.json", b"{}"),  # not skipped: a sample keyed "__meta__"
    ("b.TXT", b"4"),
    ("b.Tokens.Npy", b"5"),
    (".hidden", b"skipped: no key"),
    ("dir/.hidden.txt", b"key 'dir/' by the regex"),
    ("somedir", "dir"),
    ("c.txt", b""),
    ("c.lnk", "symlink:c.txt"),
    ("a.json", b"6"),  # key "a" again: a new sample, as in webdataset
    ("d.o.t/s.t.x.t", b"7"),
    ("x" * 120 + "/deep/" + "y" * 90 + ".npy", b"8" * 3000),
    ("ünï/cödé.txt", b"unicode"),
    ("sp ace/k ey.txt", b"9"),
]


# --------------------------------------------------------------------------- parity with webdataset


def test_pax_shard_float_mtime_long_and_unicode_keys(tmp_path: Path) -> None:
    # TarWriter's default float mtime makes tarfile write a PAX header before every member.
    samples = token_samples(20)
    samples[3]["__key__"] = "long/" + "k" * 150  # > 100 chars: PAX path
    samples[4]["__key__"] = "ключ/значение"  # non-ASCII: PAX path
    samples[5]["__key__"] = "k.with.dots"  # webdataset splits at the first dot: key "k"
    samples[6]["__key__"] = "line\nbreak"
    path = write_samples(tmp_path / "pax.tar", samples)
    with open(path, "rb") as f:
        assert b"PaxHeader" in f.read(1024)
    got = assert_same_as_webdataset(path)
    assert len(got) == 20 and got[3]["__key__"] == "long/" + "k" * 150 and got[5]["__key__"] == "k"
    assert our_members(path) == tarfile_members(path)


def test_integer_mtime_shard_multi_member_subdirs_uppercase(tmp_path: Path) -> None:
    samples = token_samples(30, seed=1)
    samples[1].update({"__key__": "dir/sub/s1", "JSON": b'{"a": 1}', "Cls": b"7"})
    samples[2].update({"__key__": "d.o.t/s2", "seg.0.txt": b"a", "seg.1.txt": b"b", "empty.bin": b""})
    samples[3]["__key__"] = "__meta__"  # member "__meta__.json"-style: a normal key for webdataset
    path = write_samples(tmp_path / "int.tar", samples, mtime=MTIME)
    got = assert_same_as_webdataset(path)
    assert sorted(payload(got[1])) == ["cls", "json", "tokens.npy", "txt"]
    assert sorted(payload(got[2])) == ["empty.bin", "seg.0.txt", "seg.1.txt", "tokens.npy", "txt"]
    assert our_members(path) == tarfile_members(path)


@pytest.mark.parametrize(
    "fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT], ids=["pax", "gnu", "ustar"]
)
def test_tricky_names(tmp_path: Path, fmt: int) -> None:
    path = write_tar(tmp_path / "tricky.tar", TRICKY, fmt)
    if fmt == tarfile.GNU_FORMAT:
        with open(path, "rb") as f:
            assert b"././@LongLink" in f.read()  # really GNU 'L' long names
    got = assert_same_as_webdataset(path)
    assert [s["__key__"] for s in got] == [
        "a",
        "__meta__",
        "b",
        "dir/",
        "c",
        "a",
        "d.o.t/s",
        "x" * 120 + "/deep/" + "y" * 90,
        "ünï/cödé",
        "sp ace/k ey",
    ]
    assert payload(got[0]) == {"txt": b"1", "cls": b"2", "seg.0.txt": b"3"}
    assert payload(got[2]) == {"txt": b"4", "tokens.npy": b"5"}
    assert our_members(path) == tarfile_members(path)


def test_random_names_group_like_webdataset() -> None:
    # One single-member tar per random name, through webdataset's own expander + grouper.
    rng = random.Random(0)
    alphabet = "ab._/_\nAé"
    names = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(1500)}
    names |= {
        "__a__",
        "__a__/b.c",
        "x/__a__/b.c",
        "__a__.b",
        "__a_.b",
        "a/.b",
        "a//b.c",
        "/a.b",
        "a.",
        ".",
        "a/b.",
        "_.__",
    }
    for name in sorted(names):
        if name.endswith("/"):
            continue  # tarfile would write a directory-looking name; covered in test_tricky_names
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
        data = buf.getvalue()
        want = [
            {k: v for k, v in s.items() if k != "__url__"}
            for s in group_by_keys(tar_file_expander([{"url": "u", "stream": io.BytesIO(data)}]))
        ]
        got = [payload(s) | {"__key__": s["__key__"]} for s in read_samples(io.BytesIO(data), url="u")]
        assert got == want, repr(name)


def test_duplicate_extension_raises_like_webdataset(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "dup.tar", [("a.txt", b"1"), ("a.TXT", b"2")], tarfile.PAX_FORMAT)
    with pytest.raises(ValueError, match="duplicate"):
        theirs(path)
    with pytest.raises(SampleError, match=r"duplicate extension 'txt' in sample 'a'.*offset 1024") as err:
        ours(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("ext", ["__key__", "__offset__", "__end__"])
def test_reserved_extension_raises(ext: str) -> None:
    with pytest.raises(SampleError, match=f"reserved extension '{ext}'"):
        list(group_samples([("k.txt", 0, b""), (f"k.{ext}", 512, b"")], url="u"))


def test_empty_shard_and_trailing_junk(tmp_path: Path) -> None:
    empty = write_samples(tmp_path / "empty.tar", [], mtime=MTIME)
    assert ours(empty) == theirs(empty) == []
    # tarfile stops at the first zero block; so do we, whatever follows it
    path = write_samples(tmp_path / "full.tar", token_samples(3), mtime=MTIME)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(path.read_bytes() + b"garbage" * 100)
    assert [payload(s) for s in ours(junk)] == [payload(s) for s in ours(path)]


def test_pax_global_header_and_size_record(tmp_path: Path) -> None:
    # A global header (as `git archive` writes) and a PAX 'size' record that overrides a wrong
    # ustar size field: tarfile honours both, so must we.
    gpax = tarfile.TarInfo("pax_global_header")
    gpax.type = tarfile.XGLTYPE
    records = b"26 comment=hello, global\n"
    size_record = b"9 size=5\n"
    raw = (
        header("pax_global_header", len(records), type=tarfile.XGLTYPE)
        + pad(records)
        + raw_member("a.txt", b"first")
        + header("PaxHeader/b.txt", len(size_record), type=tarfile.XHDTYPE)
        + pad(size_record)
        + header("b.txt", 0)
        + pad(b"12345")
        + raw_member("c.txt", b"third")
        + END
    )
    path = tmp_path / "global.tar"
    path.write_bytes(raw)
    got = assert_same_as_webdataset(path)
    assert [payload(s) for s in got] == [{"txt": b"first"}, {"txt": b"12345"}, {"txt": b"third"}]
    # the member offset is its first header block: the global header for "a", the 'x' one for "b"
    assert [s["__offset__"] for s in got] == [0, 2048, 4096]
    assert [m[1] for m in tarfile_members(path)] == [1024, 2048, 4096]  # tarfile skips the 'g' here


def test_global_pax_path_applies_to_later_members(tmp_path: Path) -> None:
    records = b"14 path=g.txt\n"
    path = tmp_path / "gpath.tar"
    path.write_bytes(header("g", len(records), type=tarfile.XGLTYPE) + pad(records) + raw_member("a.cls", b"1") + END)
    assert our_members(path) == [("g.txt", 0, b"1")]
    assert [m[0] for m in tarfile_members(path)] == ["g.txt"]


def test_old_and_odd_member_types(tmp_path: Path) -> None:
    # tarfile skips the data of unknown types but not of links/devices/directories, treats a
    # V7 regular file whose name ends in "/" as a directory, and '7' (contiguous) as regular.
    raw = (
        raw_member("a.txt", b"1")
        + header("olddir/", 0, type=tarfile.AREGTYPE)
        + header("a.lnk", 1000, type=tarfile.LNKTYPE, linkname="a.txt")  # no data blocks follow
        + raw_member("b.txt", b"2", type=tarfile.CONTTYPE)
        + header("b.chr", 0, type=tarfile.CHRTYPE)
        + header("b.fifo", 0, type=tarfile.FIFOTYPE)
        + header("b.vol", 700, type=b"V")
        + pad(b"v" * 700)
        + raw_member("c.txt", b"3", type=tarfile.AREGTYPE)
        + END
    )
    path = tmp_path / "odd.tar"
    path.write_bytes(raw)
    assert our_members(path) == tarfile_members(path)
    assert [m[0] for m in our_members(path)] == ["a.txt", "b.txt", "c.txt"]
    assert [payload(s) for s in assert_same_as_webdataset(path)] == [{"txt": b"1"}, {"txt": b"2"}, {"txt": b"3"}]


def test_signed_checksum_and_base256_size(tmp_path: Path) -> None:
    # Old Sun/NeXT tars sum header bytes as signed chars; GNU tar writes huge sizes in base-256.
    name = "é-signed.txt"  # UTF-8 bytes >= 0x80 make the two sums differ
    block = header(name, 3, fmt=tarfile.GNU_FORMAT)
    signed = 256 + sum(b - 256 if b >= 128 else b for b in block[:148] + block[156:])
    assert signed != int(block[148:154], 8)
    block = set_checksum(block, signed)
    big = header("b256.txt", 0, fmt=tarfile.GNU_FORMAT)
    big = big[:124] + b"\x80" + (4).to_bytes(11, "big") + big[136:]
    big = set_checksum(big, 256 + sum(big[:148] + big[156:]))
    path = tmp_path / "old.tar"
    path.write_bytes(block + pad(b"abc") + big + pad(b"wxyz") + END)
    assert our_members(path) == tarfile_members(path) == [(name, 0, b"abc"), ("b256.txt", 1024, b"wxyz")]


def test_short_reads_small_chunks_and_big_members(tmp_path: Path) -> None:
    samples = token_samples(40, seed=2)
    samples[7]["big.bin"] = os.urandom(3 << 20)  # bigger than the default chunk
    path = write_samples(tmp_path / "big.tar", samples)

    class Dribble(io.RawIOBase):  # a network stream: reads return fewer bytes than asked
        def __init__(self, data: bytes) -> None:
            self.data, self.pos, self.rng = data, 0, random.Random(1)

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            n = min(n, self.rng.randint(1, 5000))
            out = self.data[self.pos : self.pos + n]
            self.pos += len(out)
            return out

    want = tarfile_members(path)
    for chunk_size in (512, 4096, 1 << 20):
        got = list(iter_members(Dribble(path.read_bytes()), url="u", chunk_size=chunk_size))
        assert got == want, chunk_size


# --------------------------------------------------------------------------- offsets and resume


@pytest.fixture
def mixed_shard(tmp_path: Path) -> Path:
    """Samples of 1..3 members with PAX headers on some (long keys) and not others."""
    samples = token_samples(25, seed=3)
    for i in range(0, 25, 4):
        samples[i]["__key__"] = f"{i:06d}-" + "L" * 110
    for i in range(0, 25, 3):
        samples[i]["json"] = b"{}"
    for i in range(1, 25, 5):
        del samples[i]["txt"]
    return write_samples(tmp_path / "mixed.tar", samples, mtime=MTIME)


def test_end_is_next_offset_and_last_end_is_the_archive_end(mixed_shard: Path) -> None:
    got = assert_same_as_webdataset(mixed_shard)
    for a, b in zip(got, got[1:]):
        assert a["__end__"] == b["__offset__"] > a["__offset__"]
    with tarfile.open(mixed_shard) as tf:
        last = tf.getmembers()[-1]
    assert got[-1]["__end__"] == last.offset_data + (-(-last.size // 512)) * 512
    assert got[0]["__offset__"] == 0


def test_resume_at_every_sample_offset(mixed_shard: Path) -> None:
    full = ours(mixed_shard)
    for i, sample in enumerate(full + [None]):
        offset = sample["__offset__"] if sample else full[-1]["__end__"]
        with open(mixed_shard, "rb") as stream:
            stream.seek(offset)
            tail = list(read_samples(stream, url=str(mixed_shard), start_offset=offset))
        assert tail == full[i:], i


def test_group_samples_without_iter_members_estimates_last_end() -> None:
    got = list(group_samples([("a.txt", 0, b"x"), ("a.cls", 1024, b""), ("b.txt", 1536, b"y" * 513)], url="u"))
    assert [(s["__key__"], s["__offset__"], s["__end__"]) for s in got] == [
        ("a", 0, 1536),
        ("b", 1536, 1536 + 512 + 1024),
    ]


@pytest.mark.parametrize("kw", [{"start_offset": 100}, {"start_offset": -512}, {"chunk_size": 100}])
def test_bad_arguments(kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        list(iter_members(io.BytesIO(END), url="u", **kw))


# --------------------------------------------------------------------------- truncation and corruption


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    path = write_samples(tmp_path / "good.tar", token_samples(6, seed=4), mtime=MTIME)
    return path, ours(path)


def read_damaged(path: Path, data: bytes) -> tuple[list[str], TarDamage]:
    """Keys yielded before the error, and the error."""
    bad = path.with_name("bad.tar")
    bad.write_bytes(data)
    keys = []
    with pytest.raises(TarDamage) as err, open(bad, "rb") as stream:
        for sample in read_samples(stream, url=str(bad)):
            keys.append(sample["__key__"])
    assert str(bad) in str(err.value)
    return keys, err.value


def test_an_archive_without_its_end_blocks_ends_after_its_last_complete_member(
    shard: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # Streaming writers may leave out the end-of-archive blocks. Bytes that stop exactly at a member
    # boundary read as an archive ending there, as tarfile and webdataset read them: the last sample,
    # all of whose members came before the boundary, is delivered, and nothing is reported damaged.
    path, good = shard
    cut = good[3]["__offset__"]
    short = tmp_path / "no-end.tar"
    short.write_bytes(path.read_bytes()[:cut])
    with open(short, "rb") as stream:
        got = list(read_samples(stream, url=str(short)))
    assert [s["__key__"] for s in got] == ["000000", "000001", "000002"]
    assert got[-1]["__end__"] == cut
    theirs = list(wds.WebDataset(str(short), shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in theirs] == [s["__key__"] for s in got]
    assert all(a["tokens.npy"] == b["tokens.npy"] for a, b in zip(got, theirs))


def test_cut_inside_member_data(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, good = shard
    cut = good[3]["__offset__"] + 512 + 100
    keys, err = read_damaged(path, path.read_bytes()[:cut])
    # sample 3's first header was read whole: sample 2 (all of whose members came before it) is
    # complete and delivered, ending where sample 3 starts; sample 3 is the one the cut lost
    assert keys == ["000000", "000001", "000002"]
    assert "truncated" in str(err) and f"at byte {cut}" in str(err) and f"offset {good[3]['__offset__']}" in str(err)
    assert (err.offset, err.member, err.truncated, err.lost) == (
        good[3]["__offset__"],
        "000003.tokens.npy",
        True,
        ["000003"],
    )
    got = []
    with pytest.raises(TarDamage):
        for sample in read_samples(io.BytesIO(path.read_bytes()[:cut]), url="u"):
            got.append(sample)
    assert got == [g | {"__url__": "u"} for g in good[:3]]  # the same bytes and the same __end__


def test_cut_inside_the_second_member_of_a_sample(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    # each sample is tokens.npy then txt: a cut inside sample 3's txt data loses sample 3 (its
    # tokens.npy arrived whole, its txt did not) and keeps every sample before it
    path, good = shard
    txt = [off for name, off, _ in our_members(path) if name == "000003.txt"][0]
    keys, err = read_damaged(path, path.read_bytes()[: txt + 512 + 1])
    assert keys == ["000000", "000001", "000002"]
    assert (err.offset, err.member, err.lost) == (txt, "000003.txt", ["000003"])


def test_cut_inside_a_header(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, good = shard
    cut = good[4]["__offset__"] + 100
    keys, err = read_damaged(path, path.read_bytes()[:cut])
    # a header cut short names no member: sample 3 might have had more members there, so it is held back
    assert keys == ["000000", "000001", "000002"]
    assert "truncated" in str(err) and f"offset {good[4]['__offset__']}" in str(err)
    assert (err.member, err.lost) == (None, ["000003"])


@pytest.mark.parametrize("extra", [0, 100, 511])
def test_cut_before_or_inside_the_end_block(shard: tuple[Path, list[dict[str, Any]]], extra: int) -> None:
    # no end block, or one cut short (zeros only): every sample is whole, the archive ends there
    path, good = shard
    path.write_bytes(path.read_bytes()[: good[-1]["__end__"] + extra])
    assert ours(path) == [s | {"__url__": str(path)} for s in good]


def test_a_header_cut_short_after_the_last_member_is_still_damage(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    # a partial block that is not zeros is the start of another header: whether it belonged to the
    # last sample nobody knows, so that sample is held back and counted lost
    path, good = shard
    cut = good[3]["__offset__"]
    keys, err = read_damaged(path, path.read_bytes()[: cut + 100])
    assert keys == ["000000", "000001"]
    assert "truncated" in str(err) and f"offset {cut}" in str(err)
    assert (err.offset, err.member, err.truncated, err.lost) == (cut, None, True, ["000002"])


def test_one_end_block_is_enough(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, good = shard
    path.write_bytes(path.read_bytes()[: good[-1]["__end__"] + 512])
    assert ours(path) == [s | {"__url__": str(path)} for s in good]


def test_empty_file() -> None:
    with pytest.raises(TarDamage, match=r"^u: empty file \(0 bytes\), not a tar shard$"):
        list(read_samples(io.BytesIO(b""), url="u"))


@pytest.mark.parametrize("where", [0, 50, 124, 150, 156, 300, 511], ids=lambda b: f"byte{b}")
def test_flipped_header_byte(shard: tuple[Path, list[dict[str, Any]]], where: int) -> None:
    path, good = shard
    target = our_members(path)[5][1]  # the header of sample 2's second member (txt)
    assert target > good[2]["__offset__"]
    data = bytearray(path.read_bytes())
    data[target + where] ^= 0x04
    keys, err = read_damaged(path, bytes(data))
    assert keys == ["000000", "000001"]
    assert "corrupt header" in str(err) and f"offset {target}" in str(err)


def test_flipped_byte_in_a_pax_header_block(tmp_path: Path) -> None:
    samples = token_samples(4)
    samples[2]["__key__"] = "p" * 150
    path = write_samples(tmp_path / "pax.tar", samples, mtime=MTIME)
    offset = ours(path)[2]["__offset__"]
    data = bytearray(path.read_bytes())
    assert data[offset + 156] == ord("x")
    data[offset + 10] ^= 1
    keys, err = read_damaged(path, bytes(data))
    assert keys == ["000000"] and "corrupt header" in str(err) and f"offset {offset}" in str(err)


def test_not_a_tar(tmp_path: Path) -> None:
    data = np.random.default_rng(0).bytes(4096)
    keys, err = read_damaged(tmp_path / "x.tar", data)
    assert keys == [] and str(err) == f"{tmp_path / 'bad.tar'}: not a tar file (starts with {data[:16]!r}, 4096 bytes)"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"hello\n", r"not a tar file \(starts with b'hello\\n', 6 bytes\)$"),
        (b"<html>\x00\xff" + bytes(600), r"not a tar file \(starts with b'<html>\\x00\\xff\\x00.*', 608 bytes\)$"),
        (
            gzip.compress(b"x" * 2000, mtime=0),
            r"not a tar file \(starts with b'\\x1f\\x8b.*; gzip-compressed data: name the shard \.tar\.gz or \.tgz$",
        ),
        (
            lzma.compress(b"x" * 2000),
            r"not a tar file \(starts with b'\\xfd7zXZ.*; xz-compressed data: name the shard \.tar\.xz$",
        ),
        (
            bz2.compress(b"x" * 2000),
            r"not a tar file \(starts with b'BZh9.*; bzip2-compressed data: name the shard \.tar\.bz2 or \.tbz2 or "
            r"\.tbz$",
        ),
        (
            b"\x28\xb5\x2f\xfd" + bytes(600),
            r"not a tar file \(starts with b'\(\\xb5/\\xfd.*; zstd-compressed data: name the shard \.tar\.zst or "
            r"\.tzst$",
        ),
    ],
    ids=["text", "html", "gzip", "xz", "bzip2", "zstd"],
)
def test_not_a_tar_says_what_it_starts_with(data: bytes, says: str) -> None:
    with pytest.raises(TarDamage, match=r"^u: " + says):
        list(read_samples(io.BytesIO(data), url="u"))


def test_first_header_corrupt_is_still_a_corrupt_header(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    # a ustar-tagged first block with a bad checksum is a damaged tar, not "not a tar"
    path, _ = shard
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    keys, err = read_damaged(path, bytes(data))
    assert keys == [] and "corrupt header at offset 0: bad checksum" in str(err)


def test_short_file_with_a_few_zero_bytes_is_truncated() -> None:
    # fewer than 512 zero bytes: the start of an end-of-archive block, cut short (not "not a tar")
    with pytest.raises(TarDamage, match=r"^u: shard is truncated at byte 100: expected a tar header or end block"):
        list(read_samples(io.BytesIO(bytes(100)), url="u"))


@pytest.mark.parametrize(
    ("field", "why"), [(b"-0000000001\0", "negative size"), (b"12z45\0     ", "invalid number field")]
)
def test_bad_size_field_with_a_valid_checksum(tmp_path: Path, field: bytes, why: str) -> None:
    block = header("b.txt", 0)
    block = block[:124] + field + block[136:]
    block = set_checksum(block, 256 + sum(block[:148] + block[156:]))
    path = tmp_path / "badsize.tar"
    path.write_bytes(raw_member("a.txt", b"1") + block + END)
    with pytest.raises(ShardError, match=f"corrupt header at offset 1024: {why}"):
        ours(path)


def test_unsupported_sparse_member(tmp_path: Path) -> None:
    path = tmp_path / "sparse.tar"
    path.write_bytes(
        raw_member("a.txt", b"x") + header("s.bin", 0, type=tarfile.GNUTYPE_SPARSE, fmt=tarfile.GNU_FORMAT) + END
    )
    with pytest.raises(ShardError, match="member 's.bin' at offset 1024 is a GNU sparse file, which mixer does not"):
        ours(path)


@pytest.mark.parametrize("fmt", ["gnu", "pax"])
def test_sparse_files_written_by_gnu_tar_are_refused_by_name(tmp_path: Path, fmt: str) -> None:
    # a real `tar --sparse` archive: the old GNU 'S' member, or PAX's GNU.sparse.* records
    if (
        shutil.which("tar") is None
        or "GNU" not in subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout
    ):
        pytest.skip("needs GNU tar")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"hello")
    with open(src / "a.bin", "wb") as f:  # 1 MiB with a hole in the middle
        f.write(b"x" * 4096)
        f.seek(1 << 20)
        f.write(b"y" * 4096)
    path = tmp_path / f"{fmt}.tar"
    subprocess.run(
        ["tar", f"--format={fmt}", "--sparse", "-cf", str(path), "-C", str(src), "a.txt", "a.bin"], check=True
    )
    with pytest.raises(ShardError, match=r"member '(\./)?a\.bin' at offset \d+ is a GNU sparse file"):
        ours(path)


def test_extension_header_without_member(tmp_path: Path) -> None:
    longname = b"n" * 200 + b"\0"
    path = tmp_path / "dangling.tar"
    path.write_bytes(
        header("././@LongLink", len(longname), type=tarfile.GNUTYPE_LONGNAME, fmt=tarfile.GNU_FORMAT)
        + pad(longname)
        + END
    )
    with pytest.raises(ShardError, match="corrupt header at offset 0"):
        ours(path)


def test_generator_returns_end_offset(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, good = shard

    def drain(it: Iterator[Any]) -> Any:
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value

    with open(path, "rb") as stream:
        assert drain(iter_members(stream, url="u")) == good[-1]["__end__"]
