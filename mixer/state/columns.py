"""Compact, JSON-able columns of integers: how a reader state stores what it holds per source.

A reader keeps the same few fields for every source (a stream's epoch and cursor, a batcher's
buffered locations, counters). Stored as one JSON object per source, a thousand sources cost
megabytes even when most were never read; stored as columns (one array over all sources per
field) and compressed, an untouched source costs a few bits. A column is a list of per-part
values of a known *depth* (0: an int per part; 1: a list of ints; 2: a list of lists of ints...),
flattened into the lengths of each level and the leaves; when the innermost lists all have the
same width (``(shard, offset)`` locations), the leaves are stored one coordinate after the other.
Each array is divided by its common divisor (tar offsets are multiples of 512), delta-coded,
zigzag-mapped to unsigned, narrowed to the smallest dtype that holds it and zlib-compressed (run
lengths only: fast, and as small); the column is the base64 text of that. Locations stay in buffer
order (the order decides the resumed stream; a sorted list would need the permutation as well,
about as many bits).

Floats (a selector's running totals) are stored as their float64 bytes, compressed: exact.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from mixer.errors import StateError

_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


def _put(out: list[bytes], a: np.ndarray) -> None:
    """Append one int64 array: divisor, delta, zigzag, narrowest dtype. (A snapshot puts dozens of
    small arrays: written without np.diff's per-call overhead.)"""
    a = np.asarray(a, dtype=np.int64).reshape(-1)
    n = a.size
    g = (int(np.gcd.reduce(a)) or 1) if n else 1
    if g != 1:
        a = a // g
    d = np.empty(n, dtype=np.int64)
    if n:
        d[0] = a[0]
        np.subtract(a[1:], a[:-1], out=d[1:])
    z = ((d << 1) ^ (d >> 63)).view(np.uint64)
    top = int(z.max()) if n else 0
    code = 0 if top < 1 << 8 else 1 if top < 1 << 16 else 2 if top < 1 << 32 else 3
    out.append(struct.pack("<BQQ", code, n, g))
    out.append(z.astype(_DTYPES[code]).tobytes())


def _get(data: memoryview, at: int) -> tuple[np.ndarray, int]:
    code, n, g = struct.unpack_from("<BQQ", data, at)
    at += 17
    dtype = np.dtype(_DTYPES[code])
    z = np.frombuffer(data, dtype=dtype, count=n, offset=at).astype(np.uint64)
    d = (z >> np.uint64(1)).view(np.int64) ^ -(z & np.uint64(1)).view(np.int64)
    return np.cumsum(d, dtype=np.int64) * np.int64(g), at + n * dtype.itemsize


def _text(chunks: list[bytes]) -> str:
    # Run-length matches only (Z_RLE): the arrays are delta-coded and narrowed already, so longer
    # matches buy little; on reader snapshots this is 30-40% faster than level 1 and 5-8% smaller.
    # Any zlib stream reads back the same, so states written either way load.
    z = zlib.compressobj(1, zlib.DEFLATED, zlib.MAX_WBITS, 8, zlib.Z_RLE)
    return base64.b64encode(z.compress(b"".join(chunks)) + z.flush()).decode("ascii")


def _bytes(text: Any, where: str) -> memoryview:
    try:
        return memoryview(zlib.decompress(base64.b64decode(text, validate=True)))
    except (TypeError, ValueError, zlib.error) as exc:
        raise StateError(f"{where}: not a packed column ({type(exc).__name__}: {exc})") from exc


def pack(values: Sequence[Any], depth: int) -> str:
    """``values`` (one per part, nested ``depth`` lists deep, int leaves) as a packed column. At depth
    2 the parts may also be ``(rows, width)`` int arrays (locations): the same column, built without
    a Python object per row."""
    if depth == 2 and values and all(isinstance(v, np.ndarray) and v.ndim == 2 for v in values):
        rows = np.concatenate(values).astype(np.int64, copy=False)
        counts2 = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        return pack_flat([counts2], [rows[:, c] for c in range(rows.shape[1])])
    counts: list[np.ndarray] = []
    flat: Any = values
    for _ in range(depth):
        counts.append(np.fromiter(map(len, flat), dtype=np.int64, count=len(flat)))
        flat = list(chain.from_iterable(flat))
    return pack_flat(counts, np.asarray(flat, dtype=np.int64).reshape(-1))


def pack_items(values: Sequence[Any], depth: int, columns: Callable[[Sequence[Any]], Sequence[np.ndarray]]) -> str:
    """:func:`pack` of ``values`` whose innermost lists are still items: ``values`` nest ``depth - 1``
    lists deep, and ``columns(items)`` is the ints that stand for the items (their locations), one
    array per coordinate. A snapshot lists ~10k buffered samples: built a column at a time, it
    creates no Python object per item (a tuple each cost about as much again in garbage collection)."""
    counts: list[np.ndarray] = []
    flat: Any = values
    for _ in range(depth - 1):
        counts.append(np.fromiter(map(len, flat), dtype=np.int64, count=len(flat)))
        flat = list(chain.from_iterable(flat))
    return pack_flat(counts, list(columns(flat)))


def pack_flat(counts: Sequence[np.ndarray], leaves: np.ndarray | Sequence[np.ndarray]) -> str:
    """The packed column of values already flattened: ``counts[k]`` the lengths of the lists at
    depth ``k`` (``counts[0]``: one per part) and ``leaves`` the ints in order; or, for innermost
    lists all of one width, whose lengths ``counts`` then leaves out, one array per coordinate."""
    lengths = list(counts)
    if not isinstance(leaves, np.ndarray):  # by coordinate
        n = len(leaves[0]) if len(leaves) else 0
        if n and len(leaves):
            return _pack_arrays(len(lengths) + 1, len(leaves), lengths, leaves)
        lengths.append(np.full(n, len(leaves), dtype=np.int64))
        leaves = np.zeros(0, dtype=np.int64)
    last = lengths[-1] if lengths else None
    if last is not None and last.size and last[0] > 0 and np.all(last == last[0]):
        width = int(last[0])  # constant-width innermost lists: no lengths, leaves by coordinate
        return _pack_arrays(len(lengths), width, lengths[:-1], leaves.reshape(-1, width).T)
    return _pack_arrays(len(lengths), 0, lengths, [leaves])


def _pack_arrays(
    depth: int, width: int, lengths: Sequence[np.ndarray], leaves: Sequence[np.ndarray] | np.ndarray
) -> str:
    chunks: list[bytes] = [struct.pack("<BQ", depth, width)]
    for c in (*lengths, *leaves):
        _put(chunks, c)
    return _text(chunks)


def unpack(text: Any, depth: int | None, parts: int | None, where: str) -> list[Any]:
    """The per-part values of a packed column (nested lists, int leaves); a StateError naming
    ``where`` when it is not one of ``parts`` values ``depth`` deep (None: as saved)."""
    data = _bytes(text, where)
    try:
        saved, width = struct.unpack_from("<BQ", data, 0)
        if depth is not None and saved != depth:
            raise StateError(f"{where}: a column {saved} deep, expected {depth}")
        depth = saved
        at = 9
        lengths = []
        for _ in range(depth - (1 if width else 0)):
            counts, at = _get(data, at)
            lengths.append(counts)
        if width:
            cols = [_get(data, at)]
            at = cols[0][1]
            for _ in range(width - 1):
                cols.append(_get(data, at))
                at = cols[-1][1]
            leaves: list[Any] = np.stack([c for c, _ in cols], axis=1).tolist()
        else:
            leaves = _get(data, at)[0].tolist()
    except struct.error as exc:
        raise StateError(f"{where}: a truncated packed column") from exc
    for counts in reversed(lengths):
        ends = np.cumsum(counts).tolist()
        if (ends[-1] if ends else 0) != len(leaves):
            raise StateError(f"{where}: a packed column whose lengths do not add up")
        starts = [0, *ends[:-1]]
        leaves = [leaves[a:b] for a, b in zip(starts, ends)]
    if parts is not None and len(leaves) != parts:
        raise StateError(f"{where}: {len(leaves)} values, this mixture has {parts}")
    return leaves


def unpack_rows(text: Any, depth: int, parts: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The innermost lists of a packed column ``depth`` deep as rows, for columns of fixed-width rows
    (locations, packer pieces; at depth 1 each part is one row: counters): how many rows each of the
    ``parts`` holds (the levels in between flattened, a part's batches one after the other) and the
    rows as one ``(rows, width)`` int64 array, without a Python object per row. A StateError naming
    ``where`` when the column is not that, or its rows differ in width."""
    data = _bytes(text, where)
    try:
        saved, width = struct.unpack_from("<BQ", data, 0)
        if saved != depth or depth < 1:
            raise StateError(f"{where}: a column {saved} deep, expected {depth}")
        at, lengths = 9, []
        for _ in range(depth - (1 if width else 0)):
            counts, at = _get(data, at)
            lengths.append(counts)
        cols = []
        for _ in range(width if width else 1):
            col, at = _get(data, at)
            cols.append(col)
    except struct.error as exc:
        raise StateError(f"{where}: a truncated packed column") from exc
    if width:
        rows = np.stack(cols, axis=1)
    elif cols[0].size:
        raise StateError(f"{where}: rows of different widths, expected one width (locations)")
    else:
        rows = np.zeros((0, 0), dtype=np.int64)
    if depth == 1:  # each part a row
        if len(rows) != parts:
            raise StateError(f"{where}: {len(rows)} values, this mixture has {parts}")
        return np.ones(parts, dtype=np.int64), rows
    per = lengths[depth - 2]  # rows per innermost container
    for level in reversed(lengths[: depth - 2]):  # rows per container one level up
        ends = np.cumsum(level)
        if (int(ends[-1]) if ends.size else 0) != per.size:
            raise StateError(f"{where}: a packed column whose lengths do not add up")
        total = np.concatenate([[0], np.cumsum(per)])
        per = total[ends] - total[ends - level]
    if per.size != parts:
        raise StateError(f"{where}: {per.size} values, this mixture has {parts}")
    if int(per.sum()) != len(rows):
        raise StateError(f"{where}: a packed column whose lengths do not add up")
    return per, rows


def expect_keys(part: str, state: Any, keys: Collection[str]) -> dict[str, Any]:
    """``state`` if it is a dict with exactly ``keys``, else a StateError naming ``part`` and the key."""
    if not isinstance(state, dict):
        raise StateError(f"{part} state: expected a dict with keys {sorted(keys)} (got {type(state).__name__})")
    unknown = sorted(k for k in state if k not in keys)
    if unknown:
        raise StateError(f"{part} state: unknown key {unknown[0]!r} (expected {sorted(keys)})")
    missing = [k for k in keys if k not in state]
    if missing:
        raise StateError(f"{part} state: missing key {missing[0]!r} (expected {sorted(keys)})")
    return state


def pack_parts(states: Sequence[Mapping[str, Any]], depths: Mapping[str, int]) -> dict[str, str]:
    """Per-part state dicts (the same keys) as one dict of packed columns."""
    return {k: pack([s[k] for s in states], d) for k, d in depths.items()}


def unpack_parts(state: Any, depths: Mapping[str, int], parts: int, part: str) -> list[dict[str, Any]]:
    """The per-part state dicts of :func:`pack_parts` (keys checked, naming ``part``)."""
    expect_keys(part, state, tuple(depths))
    columns = {k: unpack(state[k], d, parts, f"{part} state: {k!r}") for k, d in depths.items()}
    return [{k: columns[k][i] for k in depths} for i in range(parts)]


def pack_floats(values: Any) -> str:
    """A float64 vector, exactly (its bytes, compressed)."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(values, dtype="<f8").tobytes(), 1)).decode("ascii")


def unpack_floats(text: Any, size: int, where: str) -> np.ndarray:
    data = _bytes(text, where)
    if len(data) != 8 * size:
        raise StateError(f"{where}: {len(data) // 8} values, expected {size}")
    return np.frombuffer(data, dtype="<f8").astype(np.float64)
