"""The async pump: a remote response opened and read ahead on fsspec's event loop, handed to the
consumer's thread through a bounded queue, on a connection of the process's `ConnectionPool`; and
`PumpRemote`, the `Remote` built on it (HTTP and S3, see `backends`)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mixer.storage.faults import EndOfShard, Fault
from mixer.storage.options import DEFAULT_MAX_CONNECTIONS
from mixer.storage.pool import ConnectionPool, pool_for
from mixer.storage.remote import Remote

__all__ = ["AsyncRead", "PumpRemote"]

AsyncRead = Callable[[int], Coroutine[Any, Any, bytes]]
"""A response body's ``read(n)``: up to ``n`` bytes, b"" at its end."""


def _call_soon(loop: Any, fn: Callable[[], Any]) -> None:
    """Run a cleanup on the loop thread without waiting (closing must never block)."""
    try:
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass


class _Pump:
    """One response, opened and read ahead by a task on the event loop, under the process's
    `ConnectionPool`.

    The task waits for a connection of the pool, sends the request (``opener(pos)``: returns the
    body's ``read(n)`` coroutine function and a cleanup), reports the outcome of the first one to
    `wait_open`, then reads the body as bytes arrive into a queue of at most ``block_size`` bytes
    that `take` empties from the consumer thread (read-ahead bounded by that plus aiohttp's own
    buffer of at most 2 x ``block_size``). Why a task, and one that opens and reads without yielding
    in between: aiohttp discards the bytes it has buffered as soon as a connection error is set on
    the body, so a reader that is not already waiting for bytes when they arrive loses them, and the
    resume must fetch them again. Reading on the loop as bytes arrive means the resume starts at the
    byte where the connection broke (unless the queue was full, the consumer lagging: then the bytes
    in aiohttp's buffer, at most 2 x ``block_size``, are fetched again; never a byte twice to the
    consumer). Stalls are caught by the HTTP client's per-read timeout (aiohttp ``sock_read``,
    botocore ``read_timeout``), which does not run while the queue is full; the consumer's waits are
    bounded too, but not while the pump waits for a connection (that is queueing, not a fault).

    When the pool asks it to give way (another stream's reader is blocked and every connection is
    held), or its queue has stayed full for ``timeout`` seconds (its reader is busy elsewhere, and a
    server would drop so idle a response anyway), the pump closes its response after the read in
    flight, keeps what it queued, and once
    the consumer has taken enough to make room, waits for a connection again and re-opens at the
    next byte it has not received (``opener(pos)``: a ranged GET pinned to the ETag); an error of that
    re-open reaches the consumer after the bytes before it, like any other.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        opener: Callable[[int], Coroutine[Any, Any, tuple[AsyncRead, Callable[[bool], None]]]],
        *,
        start: int,
        size: Callable[[], int | None],
        pool: ConnectionPool,
        timeout: float,
        block_size: int,
    ) -> None:
        self._loop = loop
        self._opener = opener
        self._start = start
        self._size = size
        self._pool = pool
        self._timeout = timeout
        self._block = block_size
        self._cond = threading.Condition()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._received = 0  # bytes of the body received (queued or taken)
        self._done = False
        self._error: BaseException | None = None
        self._waiting_for_space = False
        self._space: asyncio.Event | None = None
        self._opened: concurrent.futures.Future[None] = concurrent.futures.Future()
        # What the pool reads (see `mixer.storage.pool.Holder`).
        self.urgent = False
        self.idle = False
        self.last_used = time.monotonic()
        self._give_way = False
        self._waiting_conn = True
        self._clock = time.monotonic()  # when the consumer's current wait started counting
        self._future = asyncio.run_coroutine_threadsafe(self._main(), loop)

    # ---------------------------------------------------------------------------- consumer side
    def wait_open(self) -> None:
        """Return once the response is open and checked; raise what opening it raised (closed then)."""
        limit = self._timeout + 5.0  # the client's own timeouts fire first
        started = time.monotonic()
        self._set_urgent(True)
        try:
            while True:
                try:
                    self._opened.result(1.0)
                    return
                except concurrent.futures.TimeoutError:
                    if self._opened.done():
                        raise
                now = time.monotonic()
                if self._waiting_conn:
                    self._check_pool(max(started, self._pool.last_progress), now)
                elif now - max(started, self._clock) > limit:
                    raise TimeoutError(f"no response within {limit:.0f}s") from None
        except BaseException:
            self.close()
            raise
        finally:
            self._set_urgent(False)

    def take(self) -> bytes:
        """The next bytes of the body; b"" at its end; the pump's error once the bytes before it are taken."""
        with self._cond:
            if not self._chunks and not self._done:
                self._wait_for_bytes()
            self.last_used = time.monotonic()
            if self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._waiting_for_space and self._queued < self._block:
                    self._waiting_for_space = False
                    space = self._space
                    assert space is not None
                    _call_soon(self._loop, space.set)
                return chunk
            if self._error is not None:
                raise self._error
            return b""

    def _wait_for_bytes(self) -> None:
        """Wait (holding ``_cond``) until bytes, the end or an error are queued."""
        limit = self._timeout + 5.0  # the client's own timeouts fire first
        self._clock = time.monotonic()
        self._set_urgent(True)
        try:
            while not self._chunks and not self._done:
                self._cond.wait(1.0)
                if self._chunks or self._done:
                    return
                now = time.monotonic()
                if self._waiting_conn:
                    self._check_pool(max(self._clock, self._pool.last_progress), now)
                elif now - self._clock > limit:
                    raise TimeoutError(f"no bytes within {limit:.0f}s")
        finally:
            self._set_urgent(False)

    def _set_urgent(self, urgent: bool) -> None:
        self.urgent = urgent
        if urgent and self._waiting_conn:
            _call_soon(self._loop, self._pool.wake)

    def _check_pool(self, since: float, now: float) -> None:
        """Waiting for a connection is not a fault, unless no connection of the pool has made any
        progress for as long as a read may take: then this read cannot make progress either."""
        limit = self._timeout + 5.0
        if now - since > limit:
            n = self._pool.limit
            raise Fault(
                f"no connection free for {limit:.0f}s: all {n} connections this process may open "
                f"(io_options max_connections={n}) are held by reads that made no progress",
                transient=False,
            )

    def close(self) -> None:
        if not self._loop.is_closed():  # (at interpreter exit the loop may be gone: nothing to close)
            self._future.cancel()  # thread-safe; the task's finally closes the response on the loop

    # ---------------------------------------------------------------------------- loop side
    def give_way(self) -> None:
        """Asked by the pool (on the loop): close the response soon and queue for a connection again."""
        self._give_way = True
        if self._space is not None:
            self._space.set()

    async def _main(self) -> None:
        self._space = asyncio.Event()
        pool = self._pool
        first = True
        try:
            while True:
                pos = self._start + self._received
                size = None if first else self._size()
                if size is not None and pos >= size:
                    # Gave way with every byte received: done, without waiting for a connection
                    # just to learn it (the consumer may be blocked on this very stream).
                    self._finish(None)
                    return
                self._waiting_conn = True
                await pool.acquire(self)
                with self._cond:
                    self._waiting_conn = self._give_way = False
                    self._clock = time.monotonic()
                try:
                    read, cleanup = await self._opener(pos)
                except asyncio.CancelledError:
                    if first:
                        self._opened.cancel()
                    raise
                except EndOfShard as exc:
                    if first:
                        self._opened.set_exception(exc)
                    else:
                        self._finish(None)
                    return
                except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer thread)
                    if first:
                        self._opened.set_exception(exc)
                    else:
                        self._finish(exc)
                    return
                if first:
                    self._opened.set_result(None)
                    first = False
                finished = False
                try:
                    finished = await self._read_body(read)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 (handed to the consumer after the bytes before it)
                    self._finish(exc)
                    return
                finally:
                    cleanup(finished)
                if finished:
                    return
                pool.release(self)  # gave way: the rest waits until the consumer has made room
                await self._until_space()
        finally:
            pool.release(self)

    async def _read_body(self, read: AsyncRead) -> bool:
        """Queue the body's bytes; True at its end, False when giving way."""
        assert self._space is not None
        while True:
            full = self._check_full()
            if self._give_way:
                return False
            if full:
                self.idle = True
                try:
                    # Half the timeout: aiohttp's socket-read timer keeps running while a full buffer
                    # pauses reading, and fires at `timeout`; letting go first avoids that false fault.
                    await asyncio.wait_for(self._space.wait(), self._timeout / 2)
                except asyncio.TimeoutError:
                    return False  # unread for half the timeout: the connection goes back (resumed later at its byte)
                finally:
                    self.idle = False
                continue
            chunk = await read(self._block)
            with self._cond:
                if chunk:
                    self._chunks.append(chunk)
                    self._queued += len(chunk)
                    self._received += len(chunk)
                else:
                    self._done = True
                self._cond.notify()
            if not chunk:
                return True
            self._pool.progress()

    async def _until_space(self) -> None:
        assert self._space is not None
        while True:
            if not self._check_full():
                return
            await self._space.wait()

    def _check_full(self) -> bool:
        """Whether the queue holds a block already; if so, arm the event the consumer sets on reading."""
        assert self._space is not None
        with self._cond:
            full = self._waiting_for_space = self._queued >= self._block
            if full:
                self._space.clear()
        return full

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            self._error, self._done = error, True
            self._cond.notify()


class PumpRemote(Remote):
    """A remote whose responses are opened and read ahead by a `_Pump` on fsspec's event loop.

    ``begin(pos)`` sends the request without waiting for it (read-ahead of a shard not yet needed:
    see `ReadAhead`); a later ``open(pos)`` at the same position then only waits for what is already
    under way, and anything that went wrong meanwhile surfaces there, in the consumer's thread, under
    the stream's retry policy."""

    def __init__(
        self, fs: Any, url: str, timeout: float, block_size: int, max_connections: int = DEFAULT_MAX_CONNECTIONS
    ) -> None:
        super().__init__(fs, url, timeout)
        self.block_size = block_size
        self.max_connections = max_connections
        self._pump: _Pump | None = None
        self._begun: int | None = None  # position of a pump started by begin() and not yet waited for

    async def _aopen(self, pos: int) -> tuple[AsyncRead, Callable[[bool], None]]:
        raise NotImplementedError

    def _new_pump(self, pos: int) -> _Pump:
        loop = self.fs.loop
        return _Pump(
            loop,
            self._aopen,
            start=pos,
            size=self._stop,
            pool=pool_for(loop, self.max_connections),
            timeout=self.timeout,
            block_size=self.block_size,
        )

    def _stop(self) -> int | None:
        """Where this stream's bytes end, when known: the shard's size, or the end byte of a ranged
        read before it (a pump that gave way there has nothing left to ask for)."""
        if self.end is None:
            return self.size
        return self.end if self.size is None else min(self.size, self.end)

    def begin(self, pos: int) -> None:
        stop = self._stop()
        if self._pump is None and (stop is None or pos < stop):
            self._pump, self._begun = self._new_pump(pos), pos

    def open(self, pos: int) -> None:
        pump, begun = self._pump, self._begun
        self._pump = self._begun = None
        if pump is not None and begun != pos:
            pump.close()
            pump = None
        if self.size is not None and pos >= self.size:
            if pump is not None:
                pump.close()
            self._past_end(pos, self.size)
        pump = pump if pump is not None else self._new_pump(pos)
        pump.wait_open()
        self._pump = pump

    def read(self, n: int) -> bytes:
        assert self._pump is not None
        return self._pump.take()

    def close(self, finished: bool = False) -> None:
        pump, self._pump, self._begun = self._pump, None, None
        if pump is not None:
            pump.close()
