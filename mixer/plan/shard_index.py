"""``ShardIndex``: what a shard index holds (per shard: size, validator, sample count, each sample's
byte range and token length), its file format, and a reader's view of one sample range of a shard.

The file is JSON (gzip-compressed when its name ends in ``.gz``) with one small object per shard
and the per-sample numbers as arrays: sample start offsets delta-coded in 512-byte blocks (every tar
member starts on one) as ``uint32``, token lengths as ``uint32``, each zlib-compressed and base64
encoded: about 1-3 bytes per sample instead of a JSON object per sample (as MosaicML streaming's
``index.json`` and litdata's index keep per-shard arrays, not per-sample records).
The per-sample arrays are decoded lazily, shard by shard: a plan needs the lengths of at most two
shards per reader, and a profile of a few. A loaded index is not this JSON but its columnar twin,
mapped (:mod:`mixer.plan.index_columns`): the JSON file is what is written and read by other readers.
"""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, BinaryIO, cast

import numpy as np

from mixer.errors import ConfigError
from mixer.plan.index_columns import Columns
from mixer.plan.shards import ShardSlice
from mixer.read.tarheader import BLOCK, ZERO_BLOCK
from mixer.storage import ReadAhead, codec_of
from mixer.storage.streams import ForwardStream

FORMAT = "mixer-index"
VERSION = 1
DEFAULT_NAME = "mixer-index.json.gz"
"""The index file written next to the shards of each directory (``Source(index=True)``)."""


@dataclass(frozen=True)
class Entry:
    """One shard as indexed. ``offsets`` (``samples + 1`` values): sample ``i`` is the bytes
    ``offsets[i]:offsets[i + 1]`` of the (uncompressed) tar, the last value the end-of-archive block;
    ``lengths``: each sample's token length as the source's decode and length policy measure it (0
    for a sample the decode filters out or cannot decode). ``validator``: the storage's ETag, else
    the modification time, with ``size`` the shard's byte size (compressed size for ``.tar.gz``).
    ``damage``: why the shard could not be read to its end (the entry then holds the samples before
    the damage; readers read only those)."""

    size: int
    validator: str
    samples: int
    tokens: int
    weight: int  # sum of max(length, 1): what the plan balances (every sample weighs at least 1)
    blob: dict[str, str] = field(repr=False)
    damage: str | None = None

    def offsets(self) -> np.ndarray:
        blocks = np.frombuffer(zlib.decompress(base64.b64decode(self.blob["offsets"])), dtype="<u4")
        return np.cumsum(blocks, dtype=np.int64) * BLOCK

    def lengths(self) -> np.ndarray:
        return np.frombuffer(zlib.decompress(base64.b64decode(self.blob["lengths"])), dtype="<u4").astype(np.int64)

    @classmethod
    def make(
        cls, *, size: int, validator: str, offsets: np.ndarray, lengths: np.ndarray, damage: str | None = None
    ) -> Entry:
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(offsets) != len(lengths) + 1 or (offsets % BLOCK).any() or (np.diff(offsets) < 0).any():
            raise ConfigError(
                f"index entry: {len(offsets)} offsets for {len(lengths)} samples (need one more, multiples of "
                f"{BLOCK}, increasing)"
            )
        deltas = np.diff(offsets, prepend=0) // BLOCK
        blob = {"offsets": _pack(deltas.astype("<u4")), "lengths": _pack(lengths.astype("<u4"))}
        weight = int(np.maximum(lengths, 1).sum())
        return cls(int(size), str(validator), len(lengths), int(lengths.sum()), weight, blob, damage)

    def to_json(self) -> dict[str, Any]:
        out = {
            "size": self.size,
            "validator": self.validator,
            "samples": self.samples,
            "tokens": self.tokens,
            "weight": self.weight,
            **self.blob,
        }
        if self.damage is not None:
            out["damage"] = self.damage
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> Entry:
        try:
            return cls(
                int(d["size"]),
                str(d["validator"]),
                int(d["samples"]),
                int(d["tokens"]),
                int(d["weight"]),
                {"offsets": str(d["offsets"]), "lengths": str(d["lengths"])},
                d.get("damage"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: not a valid index entry ({type(exc).__name__}: {exc})") from None


def _pack(a: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(a.tobytes(), 6)).decode("ascii")


def encode_file(entries: dict[str, Entry], tokens_by: str, *, gz: bool) -> bytes:
    """The bytes of an index file holding ``entries`` (keyed by shard name; see :mod:`mixer.plan.index`)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "tokens_by": tokens_by,
        "shards": {k: e.to_json() for k, e in sorted(entries.items())},
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    return gzip.compress(data, 6, mtime=0) if gz else data


def _document(data: bytes, where: str) -> dict[str, Any]:
    try:
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        doc = json.loads(data)
    except (OSError, EOFError, ValueError) as exc:
        raise ConfigError(f"index {where}: not a readable index file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("shards"), dict):
        raise ConfigError(f"index {where}: not a {FORMAT} file")
    if doc.get("version") != VERSION:
        raise ConfigError(
            f"index {where}: version {doc.get('version')!r}, this mixer reads version {VERSION}: rebuild it with "
            "`mixer index`"
        )
    return doc


def decode_file(data: bytes, where: str) -> tuple[str, dict[str, Entry]]:
    """``(tokens_by, entries)`` of an index file's bytes; a foreign or broken file is a ConfigError."""
    doc = _document(data, where)
    return str(doc.get("tokens_by")), {
        k: Entry.from_json(v, f"index {where}, shard {k!r}") for k, v in doc["shards"].items()
    }


def decode_columns(data: bytes, where: str, identity: str | None) -> Columns:
    """An index file's bytes as :class:`~mixer.plan.index_columns.Columns` (in memory), without an
    object per entry; a foreign or broken file is a ConfigError naming the shard."""
    doc = _document(data, where)
    return Columns.from_json(doc["shards"], str(doc.get("tokens_by")), identity, f"index {where}")


def entries_columns(entries: Mapping[str, Entry], tokens_by: str, identity: str | None) -> Columns:
    """``entries`` (keyed by shard name) as columns in memory."""
    return Columns.from_json({k: e.to_json() for k, e in entries.items()}, tokens_by, identity)


EMPTY = entries_columns({}, "", None)


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """The index of one source's listed shards, in listing order: shard ``i`` is row ``where[i, 1]``
    of ``parts[where[i, 0]]`` (the columns of the index files it was read from, mapped; ``where`` is
    None when the shards are the rows of ``parts[0]`` in order, the usual case of one index file
    for one folder of shards: then nothing per shard is copied). ``counts``, ``tokens``, ``weights``
    and ``sizes`` are per-shard arrays; the per-sample arrays come from :meth:`offsets` and
    :meth:`lengths` (decoded on demand, a shard at a time). ``locations``: the index files it was
    read from (and written to); ``reindexed``: the shards read to make or refresh it."""

    shards: Sequence[str]
    parts: tuple[Columns, ...]
    where: np.ndarray | None
    tokens_by: str
    locations: tuple[str, ...] = ()
    reindexed: tuple[str, ...] = ()

    def _column(self, name: str) -> np.ndarray:
        if self.where is None:
            return getattr(self.parts[0], name)
        out = np.zeros(len(self.where), dtype=np.int64)
        for p, cols in enumerate(self.parts):
            mine = self.where[:, 0] == p
            out[mine] = getattr(cols, name)[self.where[mine, 1]]
        return out

    @cached_property
    def counts(self) -> np.ndarray:
        return self._column("samples")

    @cached_property
    def tokens(self) -> np.ndarray:
        return self._column("tokens")

    @cached_property
    def weights(self) -> np.ndarray:
        return self._column("weight")

    @cached_property
    def sizes(self) -> np.ndarray:
        """Each shard's byte size (an int64 array)."""
        return self._column("size")

    def _row(self, shard: int) -> tuple[Columns, int]:
        if self.where is None:
            return self.parts[0], shard
        p, row = self.where[shard]
        return self.parts[int(p)], int(row)

    @property
    def entries(self) -> tuple[Entry, ...]:
        """Every shard's :class:`Entry`, made on demand (an object per shard: for inspection; the
        mixture's readers use the columns)."""
        return tuple(self.entry(i) for i in range(len(self.shards)))

    def entry(self, shard: int) -> Entry:
        cols, row = self._row(shard)
        return Entry.from_json(cols.as_json(row), f"shard {shard}")

    def offsets(self, shard: int) -> np.ndarray:
        cols, row = self._row(shard)
        return cols.offsets(row)

    def lengths(self, shard: int) -> np.ndarray:
        cols, row = self._row(shard)
        return cols.lengths(row)

    def whole(self, shard: int) -> bool:
        """Whether reading the shard to its end reads exactly its indexed samples (not damaged)."""
        cols, row = self._row(shard)
        return row not in cols.damage

    def length_sample(self, limit: int = 1 << 16) -> np.ndarray:
        """Token lengths for bucket edges: every sample's when there are at most about ``limit``,
        else those of shards spread evenly over the list until ``limit`` are taken."""
        n = len(self.shards)
        total = int(self.counts.sum())
        picks = (
            range(n)
            if total <= limit
            else np.unique(np.linspace(0, n - 1, -(-n * limit // total)).round().astype(np.int64)).tolist()
        )
        parts = [self.lengths(i) for i in picks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class RangeStream(ForwardStream):
    """A shard stream cut at byte ``end`` (where a reader's sample range ends) and closed there
    with an end-of-archive block, so that the tar reader delivers the range's last sample and ends
    cleanly. A stream that ends before ``end`` is passed on as it is (the reader sees the damage).
    ``retries``, ``size`` and ``close`` are those of the stream underneath."""

    def __init__(self, inner: BinaryIO, start: int, end: int) -> None:
        super().__init__()
        self.inner = inner
        self._pos = start
        self._end = end
        self._tail = b""
        self._done = False

    @property
    def retries(self) -> int:
        return int(getattr(self.inner, "retries", 0))

    @property
    def size(self) -> int | None:
        return getattr(self.inner, "size", None)

    def read(self, size: int | None = -1) -> bytes:
        if self._pos < self._end:
            want = self._end - self._pos if size is None or size < 0 else min(size, self._end - self._pos)
            data = self.inner.read(want)
            self._pos += len(data)
            if data or want == 0:
                return data
            self._done = True  # ended early: no end block, the reader reports the truncation
        if not self._done:
            self._done, self._tail = True, ZERO_BLOCK
        out, self._tail = self._tail, b""
        return out

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def _release(self) -> None:
        self.inner.close()


def open_slice(
    ahead: ReadAhead, url: str, sl: ShardSlice, offset: int, upcoming: Iterable[str], window: int | None = None
) -> BinaryIO:
    """A reader's stream of slice ``sl`` from byte ``offset``: the whole shard as before, or a
    sample range that ends at ``sl.end`` (a ranged request with an end byte; a compressed shard is
    decompressed from its start and cut there). ``window``: see `mixer.storage.ReadAhead.open`."""
    if sl.end is None:
        return ahead.open(url, offset, upcoming, window=window)
    stream = ahead.open(url, offset, upcoming, end_offset=None if codec_of(url) else sl.end, window=window)
    return cast(BinaryIO, RangeStream(stream, offset, sl.end))


def range_loss(
    sl: ShardSlice, next_index: int, next_offset: int, index: ShardIndex
) -> tuple[tuple[int, int, int, int], str]:
    """What giving up an indexed slice at sample ``next_index`` (byte ``next_offset``) loses, as
    :meth:`mixer.stream.source_stream.SourceStream._loss` counts it: its samples not delivered, exactly, and
    the bytes left."""
    left = sl.stop - next_index if sl.stop is not None else 0
    end = sl.end if sl.end is not None else int(index.offsets(sl.shard)[-1])
    rest = max(end - next_offset, 0)
    return (
        left,
        1,
        0,
        rest,
    ), f"{left} indexed sample(s) of the range lost; {rest} bytes from offset {next_offset} skipped"
