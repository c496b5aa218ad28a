"""`ShardList`: a source's sorted shard URLs held compactly, behind the `Sequence` interface.

Why: a source of 1e5 shards held as a tuple of strings costs ~12 MB per process (each URL a Python
object of ~50 bytes plus its text), and the mixture is pickled into every DataLoader worker of every
rank. Shard lists are nearly always a brace pattern or a listing of one prefix: the URLs share a
prefix and a suffix, and what differs is a zero-padded number counting up. So the list keeps the
prefix and suffix once and the middle parts either as that run of numbers (``first``, ``count``,
``width``: nothing per shard) or, for any other list, in one bytes buffer with an offsets array
(a few bytes per shard). URLs are rebuilt on access (a reader asks for one when it opens a shard).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["ShardList"]


class ShardList(Sequence[str]):
    """An immutable sequence of URLs equal, item for item, to the one it was built from."""

    __slots__ = ("prefix", "suffix", "_count", "_first", "_width", "_data", "_offsets")

    def __init__(self, urls: Iterable[str]) -> None:
        items = list(urls)
        self._count = len(items)
        self.prefix = os.path.commonprefix(items) if items else ""
        cut = [u[len(self.prefix) :] for u in items]
        self.suffix = os.path.commonprefix([m[::-1] for m in cut])[::-1] if items else ""
        middles = [m[: len(m) - len(self.suffix)] for m in cut]
        del items, cut
        self._first = self._width = -1
        self._data = b""
        self._offsets = np.zeros(0, dtype=np.int64)
        if middles and _is_run(middles):
            self._first, self._width = int(middles[0]), len(middles[0])
        else:
            encoded = [m.encode() for m in middles]
            self._data = b"".join(encoded)
            self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
            np.cumsum([len(e) for e in encoded], out=self._offsets[1:])

    def _middle(self, i: int) -> str:
        if self._width >= 0:
            return str(self._first + i).zfill(self._width)
        a, b = self._offsets[i], self._offsets[i + 1]
        return self._data[a:b].decode()

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        i = index + self._count if index < 0 else index
        if not 0 <= i < self._count:
            raise IndexError(f"shard index {index} out of range ({self._count} shards)")
        return f"{self.prefix}{self._middle(i)}{self.suffix}"

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(self._count))

    def __eq__(self, other: object) -> bool:
        if (
            isinstance(other, ShardList)
            and self._count == other._count
            and (self.prefix, self.suffix) == (other.prefix, other.suffix)
        ):
            return (self._first, self._width, self._data) == (other._first, other._width, other._data)
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == self._count and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._count, self.prefix, self.suffix, self._first, self._width, self._data))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its compact parts (a worker gets a few bytes per shard, not every URL).
        return (_restore, (self.prefix, self.suffix, self._count, self._first, self._width, self._data, self._offsets))

    def nbytes(self) -> int:
        """Bytes held beyond the object itself (benchmarks, tests)."""
        return len(self.prefix) + len(self.suffix) + len(self._data) + int(self._offsets.nbytes)

    def __repr__(self) -> str:
        how = (
            f"numbers {self._first}.. width {self._width}" if self._width >= 0 else f"{len(self._data)} bytes of parts"
        )
        return f"<ShardList {self._count} shards: {self.prefix!r} + ({how}) + {self.suffix!r}>"


def _is_run(middles: Sequence[str]) -> bool:
    """Whether the parts are the decimal numbers ``first, first + 1, ...`` written at one width
    (zero-padded): checked by rebuilding every part, so a list kept as a run is rebuilt exactly."""
    first, width = middles[0], len(middles[0])
    if not (0 < width <= 18 and first.isascii() and first.isdigit()):
        return False
    start = int(first)
    return all(m == str(start + i).zfill(width) for i, m in enumerate(middles))


def _restore(
    prefix: str, suffix: str, count: int, first: int, width: int, data: bytes, offsets: np.ndarray
) -> ShardList:
    out = ShardList.__new__(ShardList)
    out.prefix, out.suffix, out._count, out._first, out._width, out._data, out._offsets = (
        prefix,
        suffix,
        count,
        first,
        width,
        data,
        offsets,
    )
    return out
