"""`ConnectionPool`: at most ``max_connections`` remote responses open at once in one process, shared
by every source, with back-pressure instead of timeouts.

Why: each source of a mixture keeps a response open for its current shard (and ``read_ahead`` more),
while the reader takes samples from one source at a time. With hundreds of sources the open
responses of sources that are not being read pinned the HTTP client's whole pool, and a read then
waited for a connection until its timeout ("no response within 65s"). Here a stream asks the pool
for a connection before it sends a request, and a stream that is not being read gives its
connection back when another one needs it: it resumes later with a ranged GET at its next byte
(see `mixer.storage.pump`). So the number of connections is bounded by the pool, not by the number
of sources, and a stream that waits for a connection is queued, not timed out.

Which stream gives way (only ever to a stream whose reader is blocked on it, an *urgent* one): one
whose reader is not waiting on it, preferring those whose buffer is full (idle: their reader took
nothing for a while), least recently read first. A stream whose reader waits on it is never asked.
(A stream left unread for half its ``timeout`` gives its connection back unasked: see
`mixer.storage.pump`.) Connections are granted urgent streams first, then in order of asking (read-ahead waits its turn:
beyond the pool, shards are opened lazily). Every method runs on the event loop of the streams.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from typing import Protocol

__all__ = ["ConnectionPool", "Holder", "pool_for"]


class Holder(Protocol):
    """What the pool knows of a stream (a `mixer.storage.pump._Pump`)."""

    urgent: bool  # its reader is blocked waiting on it
    idle: bool  # its buffer is full: it reads nothing from the network now
    last_used: float  # monotonic time its reader last took bytes (or it was made)

    def give_way(self) -> None:
        """Give the connection back soon (after the read in flight), keeping what was received."""


class ConnectionPool:
    """At most ``limit`` holders at once; see the module docstring for who waits and who gives way.

    ``last_progress`` (monotonic) is the last time a connection changed hands or a holder received
    bytes (`progress`): a reader that waits for a connection uses it to tell a busy pool from a
    wedged one.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.holders: dict[Holder, None] = {}  # insertion-ordered set
        self.waiters: collections.OrderedDict[Holder, asyncio.Future[None]] = collections.OrderedDict()
        self.asked: set[Holder] = set()  # asked to give way, not yet released
        self.peak = 0  # the most holders seen at once (tests, benchmarks)
        self.last_progress = time.monotonic()

    async def acquire(self, holder: Holder) -> None:
        """Return once ``holder`` holds a connection (at once when one is free and nobody queues)."""
        if len(self.holders) < self.limit and not self.waiters:
            self._grant(holder)
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters[holder] = future
        self.wake()
        try:
            await future
        except BaseException:
            if self.waiters.pop(holder, None) is None and holder in self.holders:
                self.release(holder)  # granted while being cancelled
            raise

    def release(self, holder: Holder) -> None:
        """``holder`` no longer holds a connection (idempotent); the next waiter gets it."""
        if holder in self.holders:
            del self.holders[holder]
            self.asked.discard(holder)
            self.last_progress = time.monotonic()
            self._serve()
        elif self.waiters.pop(holder, None) is not None:
            self._serve()

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def wake(self) -> None:
        """Re-examine the queue: a waiter may have become urgent. Asks holders to give way, one for
        each urgent waiter not already covered by a holder asked before."""
        self._serve()
        urgent = sum(1 for w in self.waiters if w.urgent)
        needed = urgent - len(self.asked) - (self.limit - len(self.holders))
        if needed <= 0:
            return
        candidates = [h for h in self.holders if not h.urgent and h not in self.asked]
        candidates.sort(key=lambda h: (not h.idle, h.last_used))
        for holder in candidates[:needed]:
            self.asked.add(holder)
            holder.give_way()

    def _serve(self) -> None:
        while self.waiters and len(self.holders) < self.limit:
            holder = next((w for w in self.waiters if w.urgent), None)
            if holder is None:
                holder = next(iter(self.waiters))
            future = self.waiters.pop(holder)
            if future.done():  # cancelled meanwhile
                continue
            self._grant(holder)
            future.set_result(None)

    def _grant(self, holder: Holder) -> None:
        self.holders[holder] = None
        self.peak = max(self.peak, len(self.holders))
        self.last_progress = time.monotonic()

    def __repr__(self) -> str:
        return f"<ConnectionPool {len(self.holders)}/{self.limit} held, {len(self.waiters)} waiting>"


_lock = threading.Lock()
_pools: dict[tuple[int, int, int], tuple[asyncio.AbstractEventLoop, ConnectionPool]] = {}


def pool_for(loop: asyncio.AbstractEventLoop, limit: int) -> ConnectionPool:
    """The pool of this process and event loop for streams whose ``max_connections`` is ``limit``
    (sources that set the same value share it; a forked child starts with fresh pools)."""
    key = (os.getpid(), id(loop), limit)
    with _lock:
        entry = _pools.get(key)
        if entry is None:
            if any(k[0] != key[0] for k in _pools):  # forked: the parent's holders are not ours
                _pools.clear()
            entry = _pools[key] = (loop, ConnectionPool(limit))  # (the loop kept alive: ids stay unique)
        return entry[1]
