"""Differential fuzzing of the compiled reader core against the pure-Python reader.

    python -m benchmarks.tar_fuzz [--seconds 60] [--seed 0] [--asan]

Each case is a tar shard built at random (`tarfile` in PAX, GNU and ustar formats, float and
integer mtimes, long and unicode names, directories, links, meta members, duplicate and reserved
extensions, global PAX headers, hand-made PAX records with wrong lengths, odd ``path``/``size``
values and sparse keywords), then damaged at random (truncated anywhere, header bytes overwritten
with or without a re-computed checksum, base-256 and huge sizes, signed checksums, junk blocks),
read through a stream that may return short reads or raise a `ShardError` part way, from offset 0
or a random block offset, with a random chunk size. `mixer.read.tario.read_samples` and
`mixer.read.decode.default_tokens` must give the same for ``native=True`` and ``native=False``: the
same samples (keys, values, order of keys) and tokens, and the same exception (class, message,
cause, and every `TarDamage` field). tests/read/test_tar_fuzz.py runs a fixed number of cases; this runs
for a time and prints how many cases and which kinds it tried. A crash or an out-of-bounds read in
the C code kills the process; ``--asan`` fuzzes a build with ``-fsanitize=address``, which also
catches reads out of bounds that would not crash.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from mixer.errors import ShardError
from mixer.read.decode import default_tokens
from mixer.read.tario import read_samples

BLOCK = 512
URL = "fuzz/shard.tar"


def pick(rng: np.random.Generator, items: Any) -> Any:
    """One of `items`, as it is (numpy's choice turns bytes into NUL-stripped numpy scalars)."""
    items = list(items)
    return items[int(rng.integers(0, len(items)))]


def _npy(rng: np.random.Generator) -> bytes:
    """A .npy member: mostly the canonical 1-D integer case, sometimes anything np.save writes."""
    kind = rng.integers(0, 6)
    n = int(rng.integers(0, 40))
    if kind <= 2:
        dtype = pick(rng, ["<i4", "<i8", "<u2", "|u1", "|i1", "<u8", "<i2"])
        array = rng.integers(0, 100, n).astype(dtype)
    elif kind == 3:
        array = rng.integers(0, 100, n).astype(pick(rng, [">i4", ">u2", "<f4", "<f8", "?"]))
    elif kind == 4:
        array = rng.integers(0, 100, (2, n)).astype("<i4")
        if rng.random() < 0.5:
            array = np.asfortranarray(array)
    else:
        array = np.array(n, dtype="<i4")  # 0-d
    out = io.BytesIO()
    np.save(out, array)
    data = bytearray(out.getvalue())
    if rng.random() < 0.3:  # damage the header or cut the payload
        if rng.random() < 0.5 and len(data) > 10:
            i = int(rng.integers(0, min(len(data), 128)))
            data[i] = int(rng.integers(0, 256))
        else:
            del data[int(rng.integers(0, len(data) + 1)) :]
    return bytes(data)


def _payload(rng: np.random.Generator, ext: str) -> bytes:
    if ext.endswith(".npy"):
        return _npy(rng)
    n = int(pick(rng, [0, 1, 100, 511, 512, 513, int(rng.integers(0, 3000))]))
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def _key(rng: np.random.Generator, i: int) -> str:
    if rng.random() < 0.8:  # mostly keys the compiled core takes itself
        return str(pick(rng, [f"k{i:04d}", f"dir/sub/k{i}", f"ключ{i}", "d" * int(rng.integers(90, 160)) + f"/k{i}"]))
    return str(
        pick(
            rng,
            [
                f"k{i:04d}",
                f"dir/sub/k{i}",
                "d" * int(rng.integers(90, 160)) + f"/k{i}",
                f"ключ{i}",
                f"a.b{i}",
                f"x{i}" * 40,
                f"__meta{i}__",
                f"dir/.hidden{i}",
                f"k{i}\nz",
            ],
        )
    )


def tarfile_shard(rng: np.random.Generator) -> bytes:
    """A shard written by tarfile, with the odd members a real shard may hold."""
    fmt = [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT][int(rng.integers(0, 3))]
    pax: dict[str, str] = {}
    if fmt == tarfile.PAX_FORMAT and rng.random() < 0.2:
        pax = (
            {"comment": "g" * int(rng.integers(0, 300))}
            if rng.random() < 0.7
            else {"path": f"global/k.{rng.integers(0, 3)}"}
        )
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, pax_headers=pax) as tf:
        for i in range(int(rng.integers(0, 12))):
            key = _key(rng, i)
            exts = list(
                rng.permutation(["tokens.npy", "input_ids.npy", "txt", "json", "CLS", "x.y"])[: int(rng.integers(1, 4))]
            )
            if rng.random() < 0.05:  # a duplicate or reserved extension
                exts.append(pick(rng, [exts[0], "__key__", "__end__"]))
            for ext in map(str, exts):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.mtime = 1_700_000_000.5 if rng.random() < 0.6 else 1_700_000_000
                if rng.random() < 0.15:
                    info.pax_headers = {
                        f"note{j}": "v" * int(rng.integers(0, 60)) for j in range(int(rng.integers(1, 30)))
                    }
                r = rng.random()
                try:
                    if r < 0.02:
                        info.type = tarfile.DIRTYPE
                        tf.addfile(info)
                    elif r < 0.04:
                        info.type = tarfile.SYMTYPE
                        info.linkname = "l" * int(rng.integers(1, 200))
                        tf.addfile(info)
                    else:
                        data = _payload(rng, ext)
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
                except ValueError:  # a name ustar cannot hold
                    continue
    return out.getvalue()


def header(name: bytes, size: int, typeflag: bytes, *, size_field: bytes | None = None) -> bytearray:
    h = bytearray(BLOCK)
    h[0 : min(len(name), 100)] = name[:100]
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"%011o\0" % 1_700_000_000
    h[156:157] = typeflag
    h[257:265] = b"ustar\x0000"
    fix_checksum(h)
    return h


def fix_checksum(h: bytearray) -> None:
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)


def member(name: bytes, data: bytes, typeflag: bytes = b"0") -> bytes:
    return bytes(header(name, len(data), typeflag)) + data + bytes(-len(data) % BLOCK)


def pax_record(rng: np.random.Generator, keyword: bytes, value: bytes) -> bytes:
    body = b" " + keyword + b"=" + value + b"\n"
    n = len(body) + len(str(len(body)))
    n += len(str(n)) - len(str(len(body)))
    if rng.random() < 0.3:  # a wrong length: short (even shorter than the keyword), long, zero or absurd
        n = int(pick(rng, [0, int(rng.integers(1, n)), n - 1, n + int(rng.integers(1, 50)), 10**19]))
    return str(n).encode() + body


def handmade_shard(rng: np.random.Generator) -> bytes:
    """Members behind hand-made PAX and GNU long-name headers, with odd records."""
    parts = []
    for i in range(int(rng.integers(1, 6))):
        name = f"s{i // 2}.{pick(rng, ['tokens.npy', 'txt', 'bin', 'TXT', 'Zz.Q'])}".encode()
        data = _payload(rng, name.decode())
        r = rng.random()
        if r < 0.6:
            records = b""
            for _ in range(int(rng.integers(0, 6))):
                keyword = pick(
                    rng,
                    [
                        b"path",
                        b"path",
                        b"path",
                        b"size",
                        b"size",
                        b"mtime",
                        b"GNU.sparse.size",
                        b"comment",
                        b"p=x",
                        b"hdrcharset",
                    ],
                )
                value = {
                    b"path": pick(
                        rng, [name, b"p/" + name, name + b"///", b"", b"__x__", "ü.txt".encode(), b"\xff\xfe.txt"]
                    ),
                    b"size": pick(
                        rng,
                        [str(len(data)).encode(), b" 12", b"-1", b"1_0", b"abc", b"", b"99999999999999999999", b"0"],
                    ),
                }.get(keyword, b"v" * int(rng.integers(0, 40)))
                records += pax_record(rng, keyword, value)
            if rng.random() < 0.1:
                records += rng.integers(0, 256, int(rng.integers(0, 30)), dtype=np.uint8).tobytes()
            typeflag = pick(rng, [b"x", b"X", b"g"])
            parts.append(member(b"././@PaxHeader", records, typeflag))
        elif r < 0.75:
            long = b"L" * int(rng.integers(90, 300)) + b"/" + name
            parts.append(member(b"././@LongLink", long + b"\0", b"L"))
        parts.append(member(name, data, pick(rng, [b"0", b"0", b"\0", b"7", b"5", b"S", b"V"])))
    return b"".join(parts) + bytes(2 * BLOCK)


def damage(rng: np.random.Generator, data: bytes) -> tuple[bytes, str]:
    """`data` damaged in one or two random ways (or not at all), and what was done."""
    buf = bytearray(data)
    done = []
    for _ in range(int(pick(rng, [0, 1, 1, 2]))):
        blocks = max(len(buf) // BLOCK, 1)
        at = int(rng.integers(0, blocks)) * BLOCK
        r = rng.random()
        if r < 0.25 and buf:
            del buf[int(rng.integers(0, len(buf))) if rng.random() < 0.6 else at :]
            done.append("cut")
            continue
        if at + BLOCK > len(buf):
            continue
        h = memoryview(buf)[at : at + BLOCK]
        if r < 0.45:
            i = int(rng.integers(0, BLOCK))
            h[i] = int(rng.integers(0, 256))
            done.append("byte")
        elif r < 0.6:
            h[124:136] = bytes(
                pick(
                    rng,
                    [
                        b"\x80" + bytes(10) + b"\x07",
                        b"\xff" * 12,
                        b"77777777777\0",
                        b" 12 \0       ",
                        b"0o17\0       ",
                        b"\x80" + rng.bytes(11),
                    ],
                )
            )
            done.append("size")
        elif r < 0.7:
            h[156] = int(pick(rng, list(b"0x7gLKS12356VA\0")))
            done.append("type")
        elif r < 0.8:
            h[345] = ord("p")
            done.append("prefix")
        else:
            h.release()
            buf[at:at] = rng.bytes(BLOCK) if rng.random() < 0.5 else bytes(BLOCK)
            done.append("junk")
            continue
        if rng.random() < 0.6:  # let the damage past the checksum
            block = bytearray(h)
            fix_checksum(block)
            if rng.random() < 0.2:  # the signed sum old tars write
                signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 256
                block[148:156] = b"%06o\0 " % (signed & 0o777777)
            h[:] = block
        h.release()
    return bytes(buf), "+".join(done) or "clean"


class Stream:
    """A byte stream that may return short reads and may raise a `ShardError` after `fail_at` bytes."""

    def __init__(self, data: bytes, short: int, fail_at: int | None) -> None:
        self.data, self.pos, self.short, self.fail_at = data, 0, short, fail_at

    def read(self, n: int) -> bytes:
        end = len(self.data) if self.fail_at is None else self.fail_at
        if self.pos >= end and self.fail_at is not None:
            err = ShardError(f"{URL}: connection reset at byte {self.pos}")
            err.truncated = self.pos % 3 == 0  # type: ignore[attr-defined]
            raise err
        take = min(n, self.short or n, end - self.pos)
        out = self.data[self.pos : self.pos + take]
        self.pos += len(out)
        return out


class StreamInto(Stream):
    """The same stream with ``readinto`` (the compiled path then reads into one reused buffer)."""

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _outcome(exc: BaseException) -> tuple[Any, ...]:
    fields = tuple(getattr(exc, f, None) for f in ("offset", "stop", "member", "truncated", "lost"))
    cause = exc.__cause__
    return (
        type(exc).__name__,
        _text(exc),
        fields,
        type(cause).__name__ if cause else None,
        _text(cause) if cause else None,
    )


def _text(exc: BaseException) -> str:
    # numpy's parse errors name an AST node by its address ("<ast.Name object at 0x7f...>")
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x?>", str(exc))


def _tokens(sample: dict[str, Any], native: bool) -> tuple[Any, ...]:
    try:
        t = default_tokens(sample, native=native)
    except Exception as exc:  # compared, not judged
        return _outcome(exc)
    return (t.dtype.str, t.shape, t.flags.writeable, t.tobytes())


def read_all(
    data: bytes, native: bool, opts: dict[str, Any], short: int, fail_at: int | None, into: bool = False
) -> list[Any]:
    got: list[Any] = []
    try:
        for sample in read_samples(
            (StreamInto if into else Stream)(data, short, fail_at), url=URL, native=native, **opts
        ):
            got.append(list(sample.items()))
            got.append(_tokens(sample, native))
    except Exception as exc:  # compared, not judged
        got.append(_outcome(exc))
    return got


def one_case(rng: np.random.Generator) -> str:
    """Build, damage and read one case both ways; AssertionError (with the case) on a difference."""
    data = tarfile_shard(rng) if rng.random() < 0.5 else handmade_shard(rng)
    data, how = damage(rng, data)
    opts: dict[str, Any] = {"chunk_size": int(pick(rng, [512, 1024, 1536, 4096, 1 << 20]))}
    if rng.random() < 0.2:
        opts["start_offset"] = int(rng.integers(0, max(len(data) // BLOCK, 1))) * BLOCK
    short = int(pick(rng, [0, 0, 1, 100, 700]))
    fail_at = int(rng.integers(0, len(data) + 1)) if rng.random() < 0.1 else None
    into = rng.random() < 0.5
    want = read_all(data, False, opts, short, fail_at, into)
    got = read_all(data, True, opts, short, fail_at, into)
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise AssertionError(
            f"compiled and Python readers differ ({how}, {opts}, short={short}, fail_at={fail_at}) at item {i} of "
            f"{len(got)}/{len(want)}:\ncompiled: {str(got[i : i + 1])[:1500]}\npython:   "
            f"{str(want[i : i + 1])[:1500]}\nshard (hex): {data.hex() if len(data) < 20000 else len(data)}"
        )
    return how


def under_asan(seconds: float, seed: int) -> int:
    """Build the C core with AddressSanitizer into a scratch copy of the package and fuzz there.

    Python's small-object allocator would hide a read just past a short ``bytes`` (it is inside
    one of its pools), so the run uses ``PYTHONMALLOC=malloc``: every object is then its own
    malloc block with redzones, and ASan aborts on the first byte read outside one.
    """
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="tar_fuzz-asan-") as scratch:
        for package in ("mixer", "benchmarks"):
            shutil.copytree(
                repo / package, Path(scratch) / package, ignore=shutil.ignore_patterns("*.so", "__pycache__")
            )
        flags = "-fsanitize=address -fno-omit-frame-pointer -O1 -g"
        env = {**os.environ, "CFLAGS": flags, "LDFLAGS": "-fsanitize=address"}
        build = [
            sys.executable,
            str(repo / "setup.py"),
            "-q",
            "build_ext",
            "--build-lib",
            scratch,
            "--build-temp",
            f"{scratch}/tmp",
        ]
        subprocess.run(build, cwd=repo, env=env, check=True)
        libasan = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
        env = {
            **os.environ,
            "LD_PRELOAD": libasan,
            "PYTHONMALLOC": "malloc",
            "ASAN_OPTIONS": "detect_leaks=0",
            "PYTHONPATH": scratch,
        }
        cmd = [sys.executable, "-c", "import mixer._native._tarwalk as t; print('ASan build:', t.__file__)"]
        subprocess.run(cmd, cwd=scratch, env=env, check=True)
        run = [sys.executable, "-m", "benchmarks.tar_fuzz", "--seconds", str(seconds), "--seed", str(seed)]
        return subprocess.run(run, cwd=scratch, env=env).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--asan", action="store_true", help="build the C core with -fsanitize=address and fuzz that build"
    )
    opts = parser.parse_args()
    if opts.asan:
        sys.exit(under_asan(opts.seconds, opts.seed))
    rng = np.random.Generator(np.random.PCG64(opts.seed))
    kinds: Counter[str] = Counter()
    start = time.perf_counter()
    while time.perf_counter() - start < opts.seconds:
        kinds[one_case(rng)] += 1
    total = sum(kinds.values())
    print(
        f"{total} cases in {time.perf_counter() - start:.0f} s, no difference; by damage: {dict(kinds.most_common())}"
    )


if __name__ == "__main__":
    main()
