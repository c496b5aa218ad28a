"""The async pump: a remote response opened and read ahead on fsspec's event loop, handed to the
consumer's thread through a bounded queue; and `PumpRemote`, the `Remote` built on it (HTTP and S3,
see `backends`)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from .remote import Remote

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
    """One response, opened and read ahead by a task on the event loop.

    The task sends the request (``opener``: returns the body's ``read(n)`` coroutine function and a
    cleanup), reports the outcome to `wait_open`, then reads the body as bytes arrive into a queue of at
    most ``block_size`` bytes that `take` empties from the consumer thread (read-ahead bounded by that
    plus aiohttp's own buffer of at most 2 x ``block_size``). Why a task, and one that opens and reads
    without yielding in between: aiohttp discards the bytes it has buffered as soon as a connection
    error is set on the body, so a reader that is not already waiting for bytes when they arrive loses
    them, and the resume must fetch them again. Reading on the loop as bytes arrive means the resume
    starts at the byte where the connection broke (unless the queue was full, the consumer lagging:
    then the bytes in aiohttp's buffer, at most 2 x ``block_size``, are fetched again; never a byte
    twice to the consumer). Stalls are caught by the HTTP client's per-read timeout (aiohttp
    ``sock_read``, botocore ``read_timeout``), which does not run while the queue is full; the
    consumer's waits are bounded too.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        opener: Callable[[], Coroutine[Any, Any, tuple[AsyncRead, Callable[[bool], None]]]],
        *,
        timeout: float,
        block_size: int,
    ) -> None:
        self._loop = loop
        self._timeout = timeout
        self._block = block_size
        self._cond = threading.Condition()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiting_for_space = False
        self._space: asyncio.Event | None = None
        self._opened: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._future = asyncio.run_coroutine_threadsafe(self._main(opener), loop)

    def wait_open(self) -> None:
        """Return once the response is open and checked; raise what opening it raised (closed then)."""
        try:
            self._opened.result(self._timeout + 5.0)  # the client's own timeouts fire first
        except concurrent.futures.TimeoutError:
            self.close()
            if self._opened.done():
                raise
            raise TimeoutError(f"no response within {self._timeout + 5.0:.0f}s") from None
        except BaseException:
            self.close()
            raise

    async def _main(self, opener: Callable[[], Coroutine[Any, Any, tuple[AsyncRead, Callable[[bool], None]]]]) -> None:
        self._space = asyncio.Event()
        try:
            read, cleanup = await opener()
        except asyncio.CancelledError:
            self._opened.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer thread by wait_open)
            self._opened.set_exception(exc)
            return
        self._opened.set_result(None)
        finished = False
        try:
            while True:
                with self._cond:
                    self._waiting_for_space = self._queued >= self._block
                    if self._waiting_for_space:
                        self._space.clear()
                if self._waiting_for_space:
                    await self._space.wait()
                    continue
                chunk = await read(self._block)
                with self._cond:
                    if chunk:
                        self._chunks.append(chunk)
                        self._queued += len(chunk)
                    else:
                        self._done = finished = True
                    self._cond.notify()
                if not chunk:
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer after the bytes before it)
            with self._cond:
                self._error, self._done = exc, True
                self._cond.notify()
        finally:
            cleanup(finished)

    def take(self) -> bytes:
        """The next bytes of the body; b"" at its end; the pump's error once the bytes before it are taken."""
        with self._cond:
            while not self._chunks and not self._done:
                if not self._cond.wait(self._timeout + 5.0):  # the client's own timeouts fire first
                    raise TimeoutError(f"no bytes within {self._timeout + 5.0:.0f}s")
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

    def close(self) -> None:
        if not self._loop.is_closed():  # (at interpreter exit the loop may be gone: nothing to close)
            self._future.cancel()  # thread-safe; the task's finally closes the response on the loop


class PumpRemote(Remote):
    """A remote whose responses are opened and read ahead by a `_Pump` on fsspec's event loop.

    ``begin(pos)`` sends the request without waiting for it (read-ahead of a shard not yet needed:
    see `ReadAhead`); a later ``open(pos)`` at the same position then only waits for what is already
    under way, and anything that went wrong meanwhile surfaces there, in the consumer's thread, under
    the stream's retry policy."""

    def __init__(self, fs: Any, url: str, timeout: float, block_size: int) -> None:
        super().__init__(fs, url, timeout)
        self.block_size = block_size
        self._pump: _Pump | None = None
        self._begun: int | None = None  # position of a pump started by begin() and not yet waited for

    async def _aopen(self, pos: int) -> tuple[AsyncRead, Callable[[bool], None]]:
        raise NotImplementedError

    def _new_pump(self, pos: int) -> _Pump:
        return _Pump(self.fs.loop, lambda: self._aopen(pos), timeout=self.timeout, block_size=self.block_size)

    def begin(self, pos: int) -> None:
        if self._pump is None and (self.size is None or pos < self.size):
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
