"""`WindowedStream`: a remote shard read as successive ranged requests, each with an end byte, so
that the server sends about what is read, not the rest of the shard.

Why: an open-ended GET makes the server send the whole rest of the shard as fast as the connection
takes it; what the client has not read when it closes the response (the kernel's socket buffers,
the HTTP client's buffer, the pump's queue: a few MB, or the whole of a small shard) was sent for
nothing, and is sent again when the shard is reopened at its byte. A reader that takes a few samples
of a rare source and then moves on (`mixer.storage.open_shards` closes it) paid that at every visit.
Asking for a window at a time bounds it by the window. Used by the up-front look
(`mixer.plan.profiling`: windows sized to the samples still wanted) and by the readers for sources read
too rarely to keep their shards open (windows sized to what the source took at its last visit,
doubling while it keeps reading, so a source that turns busy is soon read in large requests).
`GrowingReads` is the same idea for a local file read while the open-shards cap binds: small reads
first, so a shard closed after a few samples was not read far past them.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import BinaryIO, cast

from mixer.storage.streams import ForwardStream

__all__ = ["MIN_WINDOW", "GrowingReads", "WindowedStream", "growing_reads"]

MIN_WINDOW = 64 << 10
"""The least a request asks for."""

OpenRange = Callable[[int, int], BinaryIO]
"""``open_range(start, end)``: the shard's bytes ``[start, end)`` as a stream (an `open_shard` call)."""


class WindowedStream(ForwardStream):
    """The bytes of a shard from ``start`` to its end, as successive ranged requests of ``want`` bytes
    (never less than :data:`MIN_WINDOW`), each made when the one before is used up, ending before
    byte ``end`` when given; ``want`` may be
    changed between reads (the profiler does), and is multiplied by ``grow`` after each request, up
    to ``max_want``. ``size`` is the shard's size once known (given, or told by a response); ``retries``
    counts the retries of every request; ``requests`` counts the requests."""

    def __init__(
        self,
        open_range: OpenRange,
        *,
        want: int,
        size: int | None = None,
        start: int = 0,
        end: int | None = None,
        grow: float = 1.0,
        max_want: int | None = None,
    ) -> None:
        super().__init__()
        self.want = want
        self.size = size
        self.stop = end  # the stream ends before this byte (a reader's byte range), else at the shard's end
        self.requests = 0
        self._open_range = open_range
        self._grow = grow
        self._max_want = max_want
        self._cur: BinaryIO | None = None
        self._pos = start
        self._end = start
        self._retries = 0

    @property
    def retries(self) -> int:
        return self._retries + int(getattr(self._cur, "retries", 0))

    def open(self) -> WindowedStream:
        """Make the first request now (so that a missing shard fails here, as `open_shard` does)."""
        if self._cur is None:
            self._next()
        return self

    def _next(self) -> bool:
        if self._cur is not None:
            if self._pos < self._end:  # the last window ended early: so did the shard
                return False
            self._retries += int(getattr(self._cur, "retries", 0))
            self._cur.close()
            self._cur = None
        limit = min(x for x in (self.size, self.stop, 1 << 62) if x is not None)
        if self._pos >= limit:
            return False
        end = min(self._pos + max(self.want, MIN_WINDOW), limit)
        self._cur = self._open_range(self._pos, end)
        self._end = end
        self.requests += 1
        if self._grow != 1.0:
            grown = int(self.want * self._grow)
            self.want = grown if self._max_want is None else min(grown, max(self._max_want, self.want))
        told = getattr(self._cur, "size", None)
        if told is not None:
            self.size = int(told)
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            parts = []
            while chunk := self.read(1 << 20):
                parts.append(chunk)
            return b"".join(parts)
        while True:
            if self._cur is not None:
                data = self._cur.read(size)
                if data or size == 0:
                    self._pos += len(data)
                    return data
            if not self._next():
                return b""

    def read1(self, size: int = -1) -> bytes:
        return self.read(size if size >= 0 else 1 << 20)

    def _release(self) -> None:
        if self._cur is not None:
            self._retries += int(getattr(self._cur, "retries", 0))
            self._cur.close()
            self._cur = None


class GrowingReads:
    """A local shard file as the tar reader reads it (`mixer.read.tario.read_samples`): its reads ask for
    ``first`` bytes, then twice as many each time, up to what the reader asks for (its chunk).

    Why: what a reader has read of a shard and not yet parsed into samples is dropped when the
    open-shards cap closes the shard (`mixer.storage.open_shards`), and read again when it reopens
    there. A reader read a shard in 1 MiB chunks: with many sources and the cap binding, a source
    that took a sample or a few per visit read the rest of a small shard at every visit (6.4 GB
    read for 0.35 GB uncapped, in the many-sources run the README reports). Read this way while the
    cap binds (`mixer.stream.source_stream.SourceStream._open_next`), it reads about what it takes. Reads may be
    short (the tar reader reads on until it has what it needs)."""

    def __init__(self, f: BinaryIO, first: int) -> None:
        self._f = f
        self._want = first

    def _take(self, size: int) -> int:
        want = self._want
        if want >= size:
            return size
        self._want = 2 * want
        return want

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self._f.read()
        return self._f.read(self._take(size))

    def readinto(self, b: memoryview) -> int:
        n = self._take(len(b))
        return self._f.readinto(b[:n] if n < len(b) else b)  # type: ignore[attr-defined]


def growing_reads(stream: BinaryIO, first: int) -> BinaryIO:
    """``stream`` read as `GrowingReads` when it is a local file, else ``stream`` itself (a remote
    shard reopened by a rarely read source asks for windows already: `WindowedStream`)."""
    return cast(BinaryIO, GrowingReads(stream, first)) if isinstance(stream, io.BufferedReader) else stream
