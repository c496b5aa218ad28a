"""An index file's entries as columns in one binary file that every process of a node maps read-only.

Why: an index file (:mod:`mixer.plan.shard_index`) is JSON, one object per shard with its per-sample
arrays compressed inside; parsed, it is a Python object per shard and a string per array, private
to each process that parses it (about 5 bytes per sample and 0.1 s per 1e6 samples), and DataLoader
workers copy the pages they touch. Its columnar twin (``<index file>.columns``, written beside it, or
in a node-local cache directory when the index's location is remote or read-only) holds the same
entries as arrays in one file: a process maps it (``mmap``) instead of parsing, the page cache holds
one copy for all the ranks and workers of a node, and a reader's private memory is what it computes
from the columns (a plan's cumulative sums), not the index's size.

The twin records the identity of the file it mirrors (size and modification time, or ETag) and is
used only while that identity holds; otherwise the index file is parsed once more and the twin
written again (atomically: a concurrent reader maps the old one or the new one). The JSON file stays
what ``build_index`` writes and what other readers read: the twin is derived from it, never the
other way round.

The layout: 8 bytes ``MIXERCOL``, the header's length (8 bytes, little endian), the header (JSON:
format, version, the mirrored file's identity, ``tokens_by``, the damage texts, and each column's
dtype, offset and count), then the columns, 64-byte aligned: ``keys`` (sorted, fixed-width bytes),
``size``, ``samples``, ``tokens``, ``weight`` (int64), ``validators`` (fixed-width bytes), ``blob_at``
(int64: shard ``i``'s offsets at ``blob[blob_at[2i]:blob_at[2i+1]]``, its lengths up to
``blob_at[2i+2]``) and ``blob``: the zlib-compressed arrays of the index file, as they are there.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import mmap
import os
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from mixer.errors import ConfigError
from mixer.read.tarheader import BLOCK

__all__ = ["SUFFIX", "Columns", "Row", "cache_path", "open_columns", "write_columns"]

MAGIC = b"MIXERCOL"
FORMAT = "mixer-index-columns"
VERSION = 1
SUFFIX = ".columns"
ALIGN = 64
NUMBERS = ("size", "samples", "tokens", "weight")


class Row(NamedTuple):
    """One entry's size and validator (what verifying it against the storage compares)."""

    size: int
    validator: str


class Columns:
    """The entries of one index file as arrays (see the module docstring), mapped from a file
    (``path``) or held in memory. Rows are the entries in key order."""

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        tokens_by: str,
        damage: Mapping[int, str],
        identity: str | None,
        path: str | None = None,
        buffer: Any = None,
    ) -> None:
        self.keys: np.ndarray = arrays["keys"]
        self.size: np.ndarray = arrays["size"]
        self.samples: np.ndarray = arrays["samples"]
        self.tokens: np.ndarray = arrays["tokens"]
        self.weight: np.ndarray = arrays["weight"]
        self.validators: np.ndarray = arrays["validators"]
        self.blob_at: np.ndarray = arrays["blob_at"]
        self.blob: np.ndarray = arrays["blob"]
        self.tokens_by = tokens_by
        self.damage = dict(damage)
        self.identity = identity
        self.path = path
        self._buffer = buffer  # the mapping the arrays view (kept open as long as they are)

    def __len__(self) -> int:
        return len(self.keys)

    def __reduce__(self) -> tuple[Any, ...]:
        # A mapped twin travels as its path (a spawned worker maps it again); one in memory as arrays.
        if self.path is not None:
            return (_reopen, (self.path, self.identity))
        arrays = {name: getattr(self, name) for name in ("keys", *NUMBERS, "validators", "blob_at", "blob")}
        return (_rebuilt, (arrays, self.tokens_by, self.damage, self.identity))

    def rows(self, keys: Sequence[str]) -> np.ndarray:
        """The row of each of ``keys`` (-1 where the file has no entry), in one vectorised search."""
        if not len(keys) or not len(self.keys):
            return np.full(len(keys), -1, dtype=np.int64)
        wanted = np.array([k.encode() for k in keys], dtype=np.bytes_)
        at = np.minimum(np.searchsorted(self.keys, wanted), len(self.keys) - 1)
        return np.where(self.keys[at] == wanted, at, -1).astype(np.int64)

    def get(self, key: str) -> Row | None:
        """The entry of shard ``key`` (one search; :meth:`rows` looks many up at once)."""
        row = int(self.rows([key])[0])
        return None if row < 0 else Row(int(self.size[row]), self.validator(row))

    def key(self, row: int) -> str:
        return bytes(self.keys[row]).decode()

    def validator(self, row: int) -> str:
        return bytes(self.validators[row]).decode()

    def blobs(self, row: int) -> tuple[bytes, bytes]:
        """The compressed offsets and lengths of row ``row``'s samples (as the index file holds them)."""
        a, m, b = (int(x) for x in self.blob_at[2 * row : 2 * row + 3])
        return self.blob[a:m].tobytes(), self.blob[m:b].tobytes()

    def offsets(self, row: int) -> np.ndarray:
        a, m = (int(x) for x in self.blob_at[2 * row : 2 * row + 2])
        blocks = np.frombuffer(zlib.decompress(self.blob[a:m].data), dtype="<u4")
        return np.cumsum(blocks, dtype=np.int64) * BLOCK

    def lengths(self, row: int) -> np.ndarray:
        m, b = (int(x) for x in self.blob_at[2 * row + 1 : 2 * row + 3])
        return np.frombuffer(zlib.decompress(self.blob[m:b].data), dtype="<u4").astype(np.int64)

    def as_json(self, row: int) -> dict[str, Any]:
        """Row ``row`` as the index file's entry object (see ``mixer.plan.shard_index.Entry.to_json``)."""
        offsets, lengths = self.blobs(row)
        out: dict[str, Any] = {name: int(getattr(self, name)[row]) for name in NUMBERS}
        out["validator"] = self.validator(row)
        out["offsets"] = base64.b64encode(offsets).decode("ascii")
        out["lengths"] = base64.b64encode(lengths).decode("ascii")
        if row in self.damage:
            out["damage"] = self.damage[row]
        return out

    @classmethod
    def from_json(
        cls, shards: Mapping[str, Mapping[str, Any]], tokens_by: str, identity: str | None, where: str = "index"
    ) -> Columns:
        """Columns in memory from an index file's ``shards`` objects (keyed by shard name); an
        entry that is not one is a ConfigError naming ``where`` and the shard."""
        keys = sorted(shards, key=lambda k: k.encode())
        n = len(keys)
        table = np.zeros((n, len(NUMBERS)), dtype=np.int64)
        parts: list[bytes] = []
        lengths = np.zeros(2 * n, dtype=np.int64)
        damage: dict[int, str] = {}
        validators = []
        for row, key in enumerate(keys):
            entry = shards[key]
            try:
                table[row] = [int(entry[name]) for name in NUMBERS]
                validators.append(str(entry["validator"]).encode())
                offsets, sizes = base64.b64decode(entry["offsets"]), base64.b64decode(entry["lengths"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(
                    f"{where}, shard {key!r}: not a valid index entry ({type(exc).__name__}: {exc})"
                ) from None
            parts += (offsets, sizes)
            lengths[2 * row : 2 * row + 2] = len(offsets), len(sizes)
            if entry.get("damage") is not None:
                damage[row] = str(entry["damage"])
        blob_at = np.zeros(2 * n + 1, dtype=np.int64)
        np.cumsum(lengths, out=blob_at[1:])
        arrays = {
            "keys": _fixed([k.encode() for k in keys]),
            **{name: np.ascontiguousarray(table[:, j]) for j, name in enumerate(NUMBERS)},
            "validators": _fixed(validators),
            "blob_at": blob_at,
            "blob": np.frombuffer(b"".join(parts), dtype=np.uint8),
        }
        return cls(arrays, tokens_by=tokens_by, damage=damage, identity=identity)


def _fixed(items: list[bytes]) -> np.ndarray:
    return np.array(items, dtype=f"S{max((len(x) for x in items), default=1) or 1}")


def _reopen(path: str, identity: str | None) -> Columns:
    cols = open_columns(path, identity)
    if cols is None:
        raise ConfigError(f"index columns {path}: changed or gone since this process's parent mapped it")
    return cols


def _rebuilt(arrays: dict[str, np.ndarray], tokens_by: str, damage: dict[int, str], identity: str | None) -> Columns:
    return Columns(arrays, tokens_by=tokens_by, damage=damage, identity=identity)


def write_columns(cols: Columns, path: str) -> None:
    """Write ``cols`` to ``path`` atomically (a temporary file in the same folder, then renamed)."""
    names = ("keys", *NUMBERS, "validators", "blob_at", "blob")
    table: dict[str, list[Any]] = {}
    at = 0
    for name in names:
        a = getattr(cols, name)
        table[name] = [a.dtype.str, at, len(a)]
        at += -(-a.nbytes // ALIGN) * ALIGN
    header = {
        "format": FORMAT,
        "version": VERSION,
        "of": cols.identity,
        "tokens_by": cols.tokens_by,
        "damage": {str(k): v for k, v in cols.damage.items()},
        "columns": table,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    start = -(-(len(MAGIC) + 8 + len(head)) // ALIGN) * ALIGN
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".mixer-columns-", dir=folder)
    try:
        os.fchmod(fd, 0o644)  # (mkstemp's 0600 would keep it from the node's other users)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(head).to_bytes(8, "little") + head)
            for name in names:
                f.seek(start + table[name][1])
                f.write(np.ascontiguousarray(getattr(cols, name)).data)
            f.truncate(start + at)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if os.path.dirname(path) == os.path.dirname(cache_path("", "")):
        _drop_older(path)


def open_columns(path: str, identity: str | None) -> Columns | None:
    """The columns mapped from ``path``, or None when there is no such file, when it mirrors
    another version of its index file (``identity``: of the index file now; None accepts any) or
    when it is not a readable twin (then it is written again)."""
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # (ValueError: an empty file cannot be mapped)
        return None
    try:
        if buffer[: len(MAGIC)] != MAGIC:
            raise ValueError("not a columns file")
        length = int.from_bytes(buffer[len(MAGIC) : len(MAGIC) + 8], "little")
        header = json.loads(buffer[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"format {header.get('format')!r} version {header.get('version')!r}")
        if identity is not None and header["of"] != identity:
            buffer.close()
            return None
        start = -(-(len(MAGIC) + 8 + length) // ALIGN) * ALIGN
        arrays = {
            name: np.frombuffer(buffer, dtype=np.dtype(dtype), count=count, offset=start + offset)
            for name, (dtype, offset, count) in header["columns"].items()
        }
        damage = {int(k): str(v) for k, v in header["damage"].items()}
        return Columns(
            arrays, tokens_by=str(header["tokens_by"]), damage=damage, identity=header["of"], path=path, buffer=buffer
        )
    except (ValueError, KeyError, TypeError):
        buffer.close()
        return None


def cache_path(location: str, identity: str) -> str:
    """Where the twin of an index file lives when it cannot live beside it (a remote or read-only
    location): a file of this machine's temporary directory named for the location and its
    identity, shared by every process of the node (:func:`write_columns` removes the twins of the
    location's older versions there)."""
    return os.path.join(
        tempfile.gettempdir(), "mixer-index-columns", f"{_digest(location)}-{_digest(identity)}{SUFFIX}"
    )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _drop_older(path: str) -> None:
    """Remove the cached twins of other versions of the same index file (best effort: another
    process may be removing or mapping them; a mapped file stays readable to its mapper)."""
    folder, name = os.path.split(path)
    location = name.split("-", 1)[0]
    with contextlib.suppress(OSError):
        for other in os.listdir(folder):
            if other != name and other.startswith(location + "-") and other.endswith(SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, other))
