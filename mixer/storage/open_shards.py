"""`OpenShards`: at most ``max_open_shards`` shards of one reader open at once, all its sources
together, least recently read closed first.

Why: every source of a mixture has a current shard, and a reader takes samples from one source at a
time. Keeping every source's shard open costs one file descriptor (a local file), or one response
and its buffers (a remote shard), per source per DataLoader worker: at 1,000 sources a worker held
over a thousand descriptors, most of them for sources it had not read in minutes. Here a stream
registers its shard when it opens it and marks it at every sample it reads; opening one more than
the cap closes the least recently read one. That stream keeps where it stands (slice, sample index,
byte offset: the same few integers its checkpoint holds) and reopens there when it is next read: a
local file seeks, a remote shard sends a ranged GET from that byte. A compressed shard has no byte
to seek to: it is decompressed again from its first byte up to that point (the price of closing
it; `mixer.storage.compressed`), so a mixture of many compressed sources wants a cap above the number
of sources it reads often. Every reopen is counted (``Counters.reopened``).

This is the cache of open files of MosaicML streaming's and Energon's many-dataset loaders in its
simplest form: an LRU keyed by the stream, not by the file, since a stream reads its shards in order.
A reader that knows when each stream will be read next may choose instead (``pick``): one source
per batch under the deficit selector visits sources in a near-cyclic order, the worst case of an
LRU, so that reader closes the shard of the source furthest ahead of its target.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

__all__ = ["OpenShards", "Suspendable"]


class Suspendable(Protocol):
    def suspend(self) -> None:
        """Close the open shard, keeping the position to reopen it at."""


class OpenShards:
    """The open shards of one reader (one per stream at most), at most ``cap`` of them. Not
    thread-safe: a reader's streams are read from one thread.

    ``opened(stream)`` registers a stream's newly opened shard as the most recently read one and
    suspends the least recently read others beyond the cap; ``used(stream)`` marks it read (cheap:
    once per sample); ``closed(stream)`` forgets it (finished, failed or suspended). ``peak`` is the
    most seen open at once, ``suspended`` how many were closed by the cap (tests, benchmarks)."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"max_open_shards must be >= 1 (got {cap})")
        self.cap = cap
        self._open: collections.OrderedDict[Suspendable, None] = collections.OrderedDict()
        self._last: Suspendable | None = None
        # Which open stream to close when the cap binds: the least recently read one, unless the
        # reader knows better (``pick``: given the others open, the one it will read last; see
        # mixer.mixing.mixture.Reader, which ranks them by how far each source is ahead of its target).
        self.pick: Callable[[list[Suspendable]], Suspendable] | None = None
        self.peak = 0
        self.suspended = 0

    def opened(self, stream: Suspendable) -> None:
        self._open[stream] = None
        self._open.move_to_end(stream)
        self._last = stream
        while len(self._open) > self.cap:
            others = [s for s in self._open if s is not stream]
            oldest = others[0] if self.pick is None else self.pick(others)
            self.suspended += 1
            oldest.suspend()  # calls closed(oldest)
            self._open.pop(oldest, None)
        self.peak = max(self.peak, len(self._open))

    def used(self, stream: Suspendable) -> None:
        if stream is not self._last and stream in self._open:
            self._open.move_to_end(stream)
            self._last = stream

    def closed(self, stream: Suspendable) -> None:
        self._open.pop(stream, None)
        if self._last is stream:
            self._last = None

    @property
    def full(self) -> bool:
        """Whether opening one more shard closes another (the cap binds)."""
        return len(self._open) >= self.cap

    def __len__(self) -> int:
        return len(self._open)

    def __repr__(self) -> str:
        return f"<OpenShards {len(self._open)}/{self.cap} open, peak {self.peak}, {self.suspended} suspended>"
