"""Default token extraction from raw WebDataset samples, the `Sample` record readers yield, and the
check of a multi-field decode's output.

`decode_npy` is the hot one: `np.load(io.BytesIO(...))` costs tens of µs per small array, most of
it re-parsing a header that, across a source's token arrays, differs only in the shape. So the
header's dtype part is parsed once and cached, the shape is read with `int()`, and the payload is
a zero-copy `np.frombuffer`; anything that does not fit the canonical layout goes to `np.load`.
"""

from __future__ import annotations

import ast
import io
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from mixer import _native
from mixer._warn import warn
from mixer.errors import SampleError

__all__ = ["Sample", "decode_npy", "decoded_fields", "default_tokens", "field_length", "warn_bytes_as_tokens"]


class Sample(NamedTuple):
    """One decoded sample, with where it came from (enough to find it again)."""

    key: str
    tokens: Any  # a 1-D array, or a dict of named 1-D arrays (multi-field, see mixer.batching.collate)
    length: int
    shard: int  # index into the source's sorted shard list
    offset: int  # the raw sample's ``__offset__`` in that shard


_MAGIC = b"\x93NUMPY"
_SHAPE = b"'shape': ("
# Header text before 'shape' -> (dtype, fortran_order, itemsize). A source's token arrays share a
# handful of these; the bound only guards against a pathological stream of distinct dtypes.
_HEADER_CACHE: dict[bytes, tuple[np.dtype[Any], bool, int]] = {}
_HEADER_CACHE_MAX = 64

_TOKEN_MEMBERS = ("tokens.npy", "input_ids.npy")


def decode_npy(data: bytes, *, where: str = "") -> np.ndarray:
    """The array in a ``.npy`` member (format versions 1, 2 and 3), as a read-only view of `data`.

    Headers in numpy's canonical layout (``{'descr': …, 'fortran_order': …, 'shape': (…), }``,
    which `np.save` always writes) take the fast path; any other valid file is read by
    ``np.load(allow_pickle=False)``. Object arrays, bad magic, unsupported versions, malformed
    headers and short payloads are `SampleError`\\ s naming `where`. Byte order is kept as stored.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    if not data.startswith(_MAGIC):
        raise SampleError(f"{_at(where)}not a .npy array (starts with {data[:8]!r})")
    if len(data) < 12:  # shorter than any header: np.load says why
        return _np_load(data, where)
    major = data[6:7]
    if major == b"\x01":
        start = 10
        end = 10 + (data[8] | data[9] << 8)
    elif major == b"\x02" or major == b"\x03":
        start = 12
        end = 12 + int.from_bytes(data[8:12], "little")
    else:
        return _np_load(data, where)
    # Canonical layout: "{'descr': …, 'fortran_order': …, 'shape': (…), }" + spaces + "\n". Checked
    # with searches bounded to the header, so no slice is made for it.
    i = data.find(_SHAPE, start, end)
    close = data.find(b")", i, end)
    if (
        i < 0
        or close < 0
        or not data.startswith(b", }", close + 1)
        or data.count(b" ", close + 4, end - 1) != end - close - 5
        or data[end - 1 : end] != b"\n"
    ):
        return _np_load(data, where)
    head = data[start:i]
    cached = _HEADER_CACHE.get(head)
    if cached is None:
        cached = _parse_head(head, where)
        if cached is None:
            return _np_load(data, where)
        if len(_HEADER_CACHE) >= _HEADER_CACHE_MAX:
            _HEADER_CACHE.clear()
        _HEADER_CACHE[head] = cached
    dtype, fortran, itemsize = cached
    if data[close - 1] == 44:  # "(n,)": the token-array case, one int() and no tuple
        try:
            n = int(data[i + 10 : close - 1])
        except ValueError:
            n = -1
        if n >= 0 and len(data) - end >= n * itemsize:
            return np.frombuffer(data, dtype, n, end)  # positional: keywords cost ~0.5 µs here
    return _any_shape(data, data[i + 10 : close], dtype, fortran, end, where)


def _any_shape(data: bytes, dims: bytes, dtype: np.dtype[Any], fortran: bool, end: int, where: str) -> np.ndarray:
    try:
        shape = _parse_dims(dims)
    except ValueError:  # not a tuple of plain decimal integers: let numpy judge it
        return _np_load(data, where)
    count = 1
    for n in shape:
        if n < 0:
            raise SampleError(f"{_at(where)}.npy header has a negative shape {shape}")
        count *= n
    if len(data) - end < count * dtype.itemsize:
        raise SampleError(
            f"{_at(where)}.npy payload is truncated: shape {shape} of {dtype} needs "
            f"{count * dtype.itemsize} bytes, got {len(data) - end}"
        )
    return np.frombuffer(data, dtype, count, end).reshape(shape, order="F" if fortran else "C")


def _parse_dims(dims: bytes) -> tuple[int, ...]:
    """The inside of a shape tuple literal; ValueError for anything but ``()``, ``(a,)``, ``(a, b…)``."""
    parts = dims.split(b",")
    if len(parts) == 1:
        if parts[0].strip():  # "(3)" is an int, not a tuple
            raise ValueError(dims)
        return ()
    if not parts[-1].strip():  # trailing comma
        parts.pop()
    return tuple(int(p) for p in parts)  # int() refuses empty parts such as "(,)" or "(3,,4)"


def _parse_head(head: bytes, where: str) -> tuple[np.dtype[Any], bool, int] | None:
    """``{'descr': …, 'fortran_order': …, `` → (dtype, fortran_order, itemsize); None for the slow path."""
    try:
        fields = ast.literal_eval(head.decode("latin1") + "}")
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return None
    if not isinstance(fields, dict) or set(fields) != {"descr", "fortran_order"}:
        return None
    descr, fortran = fields["descr"], fields["fortran_order"]
    if not isinstance(descr, str) or not isinstance(fortran, bool):
        return None  # structured dtypes (a list descr) and odd headers: np.load
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        return None
    if dtype.hasobject:
        raise SampleError(f"{_at(where)}.npy arrays of object dtype are refused (descr {descr!r})")
    if dtype.itemsize == 0 or dtype.fields is not None:
        return None
    return dtype, fortran, dtype.itemsize


def _np_load(data: bytes, where: str) -> np.ndarray:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError, TypeError, SyntaxError) as exc:
        raise SampleError(f"{_at(where)}cannot read .npy member: {exc}") from exc
    if not isinstance(array, np.ndarray):  # np.load also reads .npz; never here (magic checked)
        raise SampleError(f"{_at(where)}not a .npy array")
    return array


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def default_tokens(sample: dict[str, Any], *, native: bool | None = None) -> np.ndarray:
    """The sample's tokens: its ``tokens.npy`` member, else ``input_ids.npy`` (a 1-D integer array,
    returned in native byte order), else its ``txt`` member's UTF-8 bytes as ``uint8``.

    No such member, or an array that is not 1-D integer, is a `SampleError` naming the shard, key
    and member. With the compiled core (`NATIVE`; ``native=False`` or ``mixer.read.decode.NATIVE =
    False`` turns it off) a canonical ``np.save`` header of a 1-D native integer array, and a ``txt``
    member, are read in C; every other case, errors included, by the code below: the result is the
    same.
    """
    if _tokens is not None and (NATIVE if native is None else native):
        tokens = _tokens(sample)
        if tokens is not None:
            if tokens.dtype is _U8 and not TXT_WARNED:
                warn_bytes_as_tokens(sample)
            return tokens
    for member in _TOKEN_MEMBERS:
        data = sample.get(member)
        if data is not None:
            try:
                tokens = decode_npy(data)
            except SampleError as exc:
                raise SampleError(f"{_name(sample)} member {member!r}: {exc}") from exc
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise SampleError(
                    f"{_name(sample)} member {member!r}: tokens must be a 1-D integer array "
                    f"(got dtype {tokens.dtype}, shape {tokens.shape})"
                )
            if not tokens.dtype.isnative:  # torch.from_numpy refuses non-native byte order
                tokens = tokens.astype(tokens.dtype.newbyteorder("="))
            return tokens
    text = sample.get("txt")
    if text is not None:
        if isinstance(text, str):
            text = text.encode("utf-8")
        warn_bytes_as_tokens(sample)
        return np.frombuffer(text, np.uint8)
    members = sorted(k for k in sample if not k.startswith("__"))
    raise SampleError(
        f"{_name(sample)}: no token member: expected 'tokens.npy', 'input_ids.npy' or 'txt' (members: {members})"
    )


_U8 = np.dtype(np.uint8)
TXT_WARNED = False
"""Whether this process has warned that the default decode reads ``txt`` members as bytes."""


def warn_bytes_as_tokens(sample: Mapping[str, Any]) -> None:
    """Warn, once per process, when ``sample`` is one whose tokens the default decode takes from
    its ``txt`` member's bytes: almost never what a model should train on."""
    global TXT_WARNED
    if TXT_WARNED or "txt" not in sample or any(m in sample for m in _TOKEN_MEMBERS):
        return
    TXT_WARNED = True
    warn(
        f"{_name(sample)}: the default decode reads the 'txt' member as UTF-8 bytes, one token per byte; "
        "to tokenize text pass decode=mixer.TextDecode(tokenizer) to the Source (or decode=... of your own)"
    )


_tarwalk = _native.tarwalk
if _tarwalk is None:  # without the compiled cores
    _tokens = None
else:
    # The dtypes np.save spells '<i4', '|u1', ... (their .str) on this machine: native integer ones only.
    _NATIVE_INTS = [np.dtype(c) for c in "bBhHiIqQ"]
    _tarwalk.setup(np.frombuffer, [(d.str.encode(), d, d.itemsize) for d in _NATIVE_INTS], np.dtype(np.uint8))
    _tokens = _tarwalk.tokens

NATIVE: bool = _tokens is not None
"""Whether `default_tokens` uses the compiled core by default (True when it was built)."""


def _name(sample: Mapping[str, Any]) -> str:
    return f"shard {sample.get('__url__', '?')}, key {sample.get('__key__')!r}"


# ---- multi-field decode output ------------------------------------------------------------


def decoded_fields(raw: Mapping[str, Any], out: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A decode's mapping checked: named numeric arrays of at least one dimension (the first is the
    sample's length, the rest a field's ``feature_shape``), in native byte order."""
    where = f"shard {raw.get('__url__', '?')}, key {raw.get('__key__')!r}"
    if not out:
        raise SampleError(f"{where}: decode returned an empty mapping")
    fields: dict[str, np.ndarray] = {}
    for name, value in out.items():
        a = np.asarray(value)
        if a.ndim < 1 or a.dtype.kind not in "iuf":
            raise SampleError(
                f"{where}: decode field {name!r} must be a numeric array of 1 or more dimensions "
                f"(got dtype {a.dtype}, shape {a.shape})"
            )
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        fields[name] = a
    return fields


def field_length(raw: Mapping[str, Any], fields: Mapping[str, np.ndarray], name: str | None) -> int:
    """The counted length of a multi-field sample: field ``name``'s, or the first field's."""
    if name is None:
        return len(next(iter(fields.values())))
    try:
        return len(fields[name])
    except KeyError:
        raise SampleError(
            f"shard {raw.get('__url__', '?')}, key {raw.get('__key__')!r}: length={name!r} names no field of the "
            f"decoded sample (fields: {sorted(fields)})"
        ) from None
