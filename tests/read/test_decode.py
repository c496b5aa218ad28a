"""`mixer.read.decode`: the fast .npy parser against numpy's own reader, and every `SampleError`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from mixer.errors import SampleError
from mixer.read import decode
from mixer.read.decode import Sample, decode_npy, default_tokens
from mixer.read.tario import read_samples

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def npy(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=False)
    return buf.getvalue()


def with_header(header: str, payload: bytes = b"", major: int = 1) -> bytes:
    """A .npy file with a hand-written header dict (padded as numpy pads)."""
    text = header.encode("latin1")
    width = 2 if major == 1 else 4
    total = 6 + 2 + width + len(text) + 1
    text += b" " * (-total % 64) + b"\n"
    return b"\x93NUMPY" + bytes([major, 0]) + len(text).to_bytes(width, "little") + text + payload


def same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


class SpyLoad:
    """Counts calls to np.load (the fallback) while delegating to it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.real = np.load
        monkeypatch.setattr(decode.np, "load", self)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kw)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)], ids=lambda v: f"v{v[0]}")
@pytest.mark.parametrize("length", [0, 1, 1000])
@pytest.mark.parametrize("dtype", INT_DTYPES + [">i4", ">u2", ">i8", "<f4", "bool"])
def test_round_trip_1d_fast_path(
    monkeypatch: pytest.MonkeyPatch, dtype: str, length: int, version: tuple[int, int]
) -> None:
    spy = SpyLoad(monkeypatch)
    want = (np.arange(length) * 7919 % 251).astype(dtype)
    got = decode_npy(npy(want, version))
    same(got, want)
    assert spy.calls == 0  # canonical headers never need np.load
    assert not got.flags.writeable  # a view of the member bytes, not a copy


@pytest.mark.parametrize("shape", [(), (0, 3), (3, 4), (2, 3, 4), (1, 1)])
@pytest.mark.parametrize("order", ["C", "F"])
def test_round_trip_any_shape_and_order(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], order: str) -> None:
    spy = SpyLoad(monkeypatch)
    want = np.asarray(np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape), order=order)
    data = npy(want)
    assert (b"'fortran_order': True" in data) == (order == "F" and want.ndim > 1 and not want.flags.c_contiguous)
    same(decode_npy(data), want)
    assert spy.calls == 0


def test_header_cache_is_keyed_without_the_shape() -> None:
    decode._HEADER_CACHE.clear()
    for n in range(50):
        decode_npy(npy(np.zeros(n, np.int32)))
    decode_npy(npy(np.zeros(3, np.int64)))
    assert len(decode._HEADER_CACHE) == 2
    for k in range(200):  # many distinct dtypes: the cache stays bounded
        decode_npy(npy(np.zeros(2, dtype=f"S{k + 1}")))
    assert len(decode._HEADER_CACHE) <= decode._HEADER_CACHE_MAX


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),  # structured: a list descr
        np.zeros(4, dtype="<U3"),
    ],
    ids=["structured", "unicode"],
)
def test_unusual_arrays(monkeypatch: pytest.MonkeyPatch, array: np.ndarray) -> None:
    same(decode_npy(npy(array)), array)


@pytest.mark.parametrize(
    "header",
    [
        "{'shape': (3,), 'fortran_order': False, 'descr': '<i4', }",  # keys in another order
        "{'descr': '<i4', 'fortran_order': False, 'shape': (3,)}",  # no trailing ", "
        "{'descr': '<i4', 'fortran_order': False, 'shape': (0x3,), }",  # a literal int() refuses
        "{'descr': '<i4', 'fortran_order': False, 'shape': (3,),\t}",
    ],
)
def test_fallback_for_non_canonical_headers(monkeypatch: pytest.MonkeyPatch, header: str) -> None:
    spy = SpyLoad(monkeypatch)
    want = np.array([5, 6, 7], dtype="<i4")
    same(decode_npy(with_header(header, want.tobytes())), want)
    assert spy.calls == 1


def test_bytes_like_input_and_trailing_bytes() -> None:
    want = np.arange(5, dtype=np.uint16)
    same(decode_npy(bytearray(npy(want))), want)
    same(decode_npy(memoryview(npy(want))), want)
    same(decode_npy(npy(want) + b"junk"), want)  # np.load ignores trailing bytes too


# --------------------------------------------------------------------------- decode_npy errors


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"PK\x03\x04not npy at all", "not a .npy array"),
        (b"", "not a .npy array"),
        (b"\x93NUMPY\x04\x00" + bytes(60), "cannot read .npy member"),  # unknown major version
        (with_header("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", bytes(16)), "object dtype"),
        (with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (5,), }", bytes(12)), "truncated"),
        (with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 5), }", bytes(12)), "truncated"),
        (with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (-2,), }"), "negative shape"),
        (with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (2, -5), }"), "negative shape"),
        (with_header("{'descr': 'nonsense', 'fortran_order': False, 'shape': (2,), }"), "cannot read .npy member"),
        (with_header("{'descr': '<i4', 'fortran_order': 'no', 'shape': (2,), }", bytes(8)), "cannot read .npy member"),
        (
            with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (2.5,), }", bytes(8)),
            "cannot read .npy member",
        ),
        (with_header("not a dict at all"), "cannot read .npy member"),
        (with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), } junk", bytes(12)), "cannot read .npy"),
        (with_header("{'descr': '<i4', 'fortran_order': False, 'shape': (3), }", bytes(12)), "cannot read .npy member"),
        (npy(np.arange(4))[:9], "cannot read .npy member"),  # cut inside the header length
        (npy(np.arange(40))[:40], "cannot read .npy member"),  # cut inside the header
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_decode_npy_errors_name_where(data: bytes, message: str) -> None:
    with pytest.raises(SampleError, match=message) as err:
        decode_npy(data, where="shard s.tar, key 'k'")
    assert str(err.value).startswith("shard s.tar, key 'k': ")


def test_object_arrays_are_refused_on_both_paths() -> None:
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(SampleError, match="object dtype"):
        decode_npy(pickled.getvalue())
    odd = with_header("{'fortran_order': False, 'shape': (1,), 'descr': '|O'}", pickled.getvalue()[-20:])
    with pytest.raises(SampleError, match="allow_pickle"):  # via np.load(allow_pickle=False)
        decode_npy(odd)


# --------------------------------------------------------------------------- default_tokens


def raw(**members: Any) -> dict[str, Any]:
    return {"__key__": "k1", "__url__": "/data/s-000.tar", **members}


def test_member_preference() -> None:
    a, b = np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int64)
    same(default_tokens(raw(**{"tokens.npy": npy(a), "input_ids.npy": npy(b), "txt": b"xy"})), a)
    same(default_tokens(raw(**{"input_ids.npy": npy(b), "txt": b"xy"})), b)
    same(default_tokens(raw(txt="héllo".encode())), np.frombuffer("héllo".encode(), np.uint8))
    same(default_tokens(raw(txt="héllo")), np.frombuffer("héllo".encode(), np.uint8))
    same(default_tokens(raw(txt=b"")), np.zeros(0, np.uint8))


def test_big_endian_tokens_come_back_native() -> None:
    want = np.array([1, 300, 70000], dtype=">i4")
    got = default_tokens(raw(**{"tokens.npy": npy(want)}))
    assert got.dtype == np.dtype("int32") and got.dtype.isnative
    assert got.tolist() == [1, 300, 70000]


def test_no_token_member() -> None:
    with pytest.raises(SampleError) as err:
        default_tokens(raw(**{"jpg": b"", "json": b"{}"}))
    message = str(err.value)
    assert "/data/s-000.tar" in message and "'k1'" in message and "['jpg', 'json']" in message


@pytest.mark.parametrize(
    ("array", "shown"),
    [
        (np.zeros((2, 3), np.int32), "(2, 3)"),
        (np.zeros((), np.int32), "()"),
        (np.zeros(3, np.float32), "float32"),
        (np.zeros(3, bool), "bool"),
    ],
)
@pytest.mark.parametrize("member", ["tokens.npy", "input_ids.npy"])
def test_tokens_must_be_1d_integers(array: np.ndarray, shown: str, member: str) -> None:
    with pytest.raises(SampleError, match="1-D integer") as err:
        default_tokens(raw(**{member: npy(array)}))
    message = str(err.value)
    assert "/data/s-000.tar" in message and "'k1'" in message and repr(member) in message and shown in message


def test_undecodable_token_member() -> None:
    with pytest.raises(SampleError) as err:
        default_tokens(raw(**{"tokens.npy": b"\x93NUMPY garbage"}))
    message = str(err.value)
    assert "/data/s-000.tar" in message and "'k1'" in message and "'tokens.npy'" in message


def test_sample_fields() -> None:
    # The mixture's collate transposes samples by position (key, tokens, length first).
    tokens = np.arange(7, dtype=np.int32)
    sample = Sample("k", tokens, 7, 3, 1024)
    assert (sample.key, sample.length, sample.shard, sample.offset) == ("k", 7, 3, 1024)
    assert Sample._fields == ("key", "tokens", "length", "shard", "offset")


def test_shards_written_by_webdataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    want = {f"{i:04d}": rng.integers(1, 30000, int(rng.integers(0, 500)), dtype=np.int32) for i in range(200)}
    path = str(tmp_path / "tok.tar")
    with wds.TarWriter(path, mtime=1_700_000_000) as writer:
        for key, tokens in want.items():
            writer.write({"__key__": key, "tokens.npy": tokens})
    with open(path, "rb") as stream:
        got = {s["__key__"]: default_tokens(s) for s in read_samples(stream, url=path)}
    assert list(got) == list(want)
    for key in want:
        same(got[key], want[key])
