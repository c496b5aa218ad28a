"""`RemoteStream`: a remote shard as a byte stream that resumes at the byte after a transient fault;
`Remote`: the one way of GETting a shard from a byte position that it drives (each scheme's own:
see `mixer.storage.schemes`).

Not through fsspec's file objects: those retry nothing and misreport faults (fsspec's HTTP ``open()`` /
``info()`` turn a 503 or a refused connection into ``FileNotFoundError``; s3fs hides up to ~12 s of
retries of a refused connection behind one call). Instead a `Remote` issues its own GETs through the
session of the fsspec filesystem and looks at the real status, and the stream re-opens it at the first
byte it has not handed out yet.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mixer.storage.faults import Backoff, EndOfShard, Fault, retrying
from mixer.storage.streams import ForwardStream
from mixer.storage.urls import redact

__all__ = ["Remote", "RemoteStream", "parse_content_range"]


class Remote:
    """One way of GETting a shard from a byte position: ``open(pos)`` starts a response (raises
    `EndOfShard` when ``pos`` is the end), ``read(n)`` returns up to ``n`` bytes of it (b"" at its end),
    ``close()`` drops it. ``size`` is learnt from responses; the ETag pins the version across re-opens."""

    size: int | None = None
    end: int | None = None
    """The byte a response should stop before (a ranged GET with an end byte); None: the shard's end."""

    def __init__(self, fs: Any, url: str, timeout: float) -> None:
        self.fs = fs
        self.url = url
        self.timeout = timeout
        self.etag: str | None = None

    def begin(self, pos: int) -> None:
        """Send the request for ``pos`` without waiting for it, where the remote can (`PumpRemote`)."""

    def open(self, pos: int) -> None:
        raise NotImplementedError

    def read(self, n: int) -> bytes:
        raise NotImplementedError

    def close(self, finished: bool = False) -> None:
        pass

    def _learn(self, size: int | None, etag: str | None) -> None:
        if size is not None:
            if self.size is not None and size != self.size:
                raise Fault(f"the shard changed size while being read ({self.size} -> {size} bytes)", transient=False)
            self.size = size
        if etag and not etag.startswith("W/") and self.etag is None:
            self.etag = etag

    def _past_end(self, pos: int, total: int | None) -> None:
        """Handle a 416 / InvalidRange: the end (EOF) or a start offset past the end (permanent)."""
        total = total if total is not None else self.size
        if total is not None and pos == total:
            self.size = total
            raise EndOfShard
        raise Fault(
            f"byte {pos} is past the end of the shard ({total if total is not None else '?'} bytes)", transient=False
        )


def parse_content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of ``bytes first-last/total`` or ``bytes */total`` (an HTTP
    ``Content-Range``, also what S3 answers a ranged GET with); None where unknown."""
    if not value:
        return None, None
    m = re.match(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*$", value)
    if not m:
        return None, None
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return first, total


class RemoteStream(ForwardStream):
    """A forward-only binary stream of a remote shard that survives network faults without losing or
    repeating a byte.

    ``read(n)`` returns exactly ``n`` bytes unless the shard ends first. Every network open and read has
    a timeout (no byte for ``timeout`` seconds counts as a stalled stream). On a transient fault
    (refused / reset / aborted connection, HTTP 5xx / 408 / 429, S3 throttling, a timeout or stall, a
    body shorter than announced) the stream re-opens at the first byte it has not yet received, with a
    ranged GET (``If-Match`` on the ETag, so a shard replaced meanwhile fails instead of being spliced),
    after exponential backoff with jitter (honouring ``Retry-After``), at most ``retries`` times in a row
    without progress. Permanent faults (404, 403, a bad request, a start offset past the end) raise
    `ShardError` at once, naming the redacted URL and byte offset; so do exhausted retries, with the
    last cause chained. ``retries`` counts every retry made (for the caller's stats); ``size`` is the
    shard's size once a response has told it; ``tell()`` is the offset of the next byte ``read`` returns.
    ``end_offset``: the stream ends before this byte, and every request says so (an end byte in its
    range), so the server sends no more than is asked for; a server that ignores ranges is cut off.
    Not thread-safe. Nothing is written to disk; read-ahead is bounded (about 3 x ``block_size``).
    """

    def __init__(
        self,
        url: str,
        remote: Remote,
        *,
        start_offset: int,
        retries: int,
        backoff: float,
        block_size: int,
        end_offset: int | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.retries = 0
        self._remote = remote
        self._end = end_offset
        remote.end = end_offset
        self._max_retries = retries
        self._backoff = Backoff(backoff)
        self._block = block_size
        self._pos = start_offset  # next byte read() hands out
        self._fetched = start_offset  # next byte to ask the network for (= _pos + unread buffer)
        self._buf = b""
        self._off = 0
        self._body_open = False
        self._eof = False

    @property
    def size(self) -> int | None:
        return self._remote.size

    # --------------------------------------------------------------------------------- io API
    def seekable(self) -> bool:
        return False

    def read(self, size: int | None = -1) -> bytes:
        self._check_not_closed()
        if size == 0:
            return b""
        want = None if size is None or size < 0 else size
        buf, off = self._buf, self._off
        if want is not None and len(buf) - off >= want:
            self._off = off + want
            self._pos += want
            return buf[off : off + want]
        parts = [buf[off:]] if off < len(buf) else []
        got = len(buf) - off
        self._buf, self._off = b"", 0
        try:
            while want is None or got < want:
                chunk = self._next_chunk()
                if not chunk:
                    break
                if want is not None and len(chunk) > want - got:
                    parts.append(chunk[: want - got])
                    self._buf, self._off = chunk, want - got
                    got = want
                else:
                    parts.append(chunk)
                    got += len(chunk)
        except BaseException:
            # Keep what arrived before the error: a caller that goes on reading must not skip it.
            self._buf, self._off = b"".join(parts) + self._buf[self._off :], 0
            raise
        self._pos += got
        return b"".join(parts)

    def read1(self, size: int = -1) -> bytes:
        self._check_not_closed()
        if self._off >= len(self._buf):
            self._buf, self._off = self._next_chunk(), 0
        end = len(self._buf) if size is None or size < 0 else self._off + size
        data = self._buf[self._off : end]
        self._off += len(data)
        self._pos += len(data)
        return data

    def __repr__(self) -> str:
        return f"<RemoteStream {redact(self.url)} at byte {self._pos}, {self.retries} retries>"

    def open_body(self) -> None:
        """Send the first request and check its answer, under the retry policy (raising closes the
        stream); without this the first ``read`` does it."""
        try:
            self._with_retries(self._try_open)
        except BaseException:
            self.close()
            raise

    def begin(self) -> None:
        """Send the first request without waiting for its answer (read-ahead: see `ReadAhead`);
        `open_body` then waits for it."""
        self._remote.begin(self._fetched)

    # ------------------------------------------------------------------------------ internals
    def _release(self) -> None:
        self._remote.close()
        self._buf = b""

    def _check_not_closed(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed stream")

    def _try_open(self) -> bytes:
        if self._end is not None and self._fetched >= self._end:
            self._eof = self._body_open = True
            return b""
        try:
            self._remote.open(self._fetched)
        except EndOfShard:
            self._eof = True
        self._body_open = True
        return b""

    def _next_chunk(self) -> bytes:
        """The next bytes from the network (b"" only at the true end of the shard)."""
        if self._eof:
            return b""
        chunk = self._with_retries(self._try_read)
        if not chunk:
            self._eof = True
            self._remote.close(finished=True)
        return chunk

    def _try_read(self) -> bytes:
        if not self._body_open:
            self._try_open()
            if self._eof:
                return b""
        end = self._end
        if end is not None and self._fetched >= end:
            return b""
        chunk = self._remote.read(self._block)
        if chunk:
            if end is not None and self._fetched + len(chunk) > end:
                chunk = chunk[: end - self._fetched]  # a server that ignored the end byte
            self._fetched += len(chunk)
            return chunk
        size = self._remote.size
        if size is not None and end is not None:
            size = min(size, end)
        if size is not None and self._fetched < size:
            raise Fault(f"the body ended at byte {self._fetched} of {size}", transient=True)
        return b""

    def _with_retries(self, attempt_fn: Callable[[], bytes]) -> bytes:
        return retrying(
            attempt_fn,
            self._where,
            retries=self._max_retries,
            backoff=self._backoff,
            in_a_row=True,
            after_fault=self._drop_body,
            before_retry=self._count_retry,
        )

    def _where(self) -> str:
        return f"shard {redact(self.url)} at byte {self._fetched}"

    def _drop_body(self) -> None:
        self._remote.close()
        self._body_open = False

    def _count_retry(self) -> None:
        self.retries += 1
