"""How batches cross from DataLoader workers to the main process, with flow control of our own.

Measured here (2 cores, 100-sample batches): pickling a tensor through torch's default sharing
costs ~2.7-6.6 ms per batch (a new shared-memory segment and a file-descriptor hand-over each time),
and pickling the buffer by value through the worker's pipe costs ~0.3 ms plus ~3.7 ms per MB
(fresh allocations and page faults on both sides). So when workers are forked, the loader maps one
anonymous shared region *before* the fork; every worker inherits it and owns a ring of slots in it;
a worker collates straight into a free slot of its own (:class:`SlotWriter`) and sends only
(worker, slot, stamp, sizes); the main process hands out a batch whose buffer is a view of the slot,
and the slot is released when that buffer is freed (no copy: a copy out cost ~33 µs per 256 KB
batch, ~1.5% of the pipeline's CPU).

The invariant: **a worker writes only into a slot that the main process has released.** Each slot
starts with a state word in the shared mapping:

- ``0`` free: released by the main process once nothing refers to the batch read from it (or
  never used);
- ``-1`` being written by its worker;
- ``stamp > 0`` sealed: holds batch number ``stamp`` of that worker, waiting to be read.

Only the owning worker moves a slot from free to written to sealed, and only the main process moves
it from sealed back to free, so no state word has two writers at once. A worker whose slots are all
sealed (the main process is behind, or the training loop holds on to its batches) does not wait
and does not overwrite: it sends that batch by value through its pipe, which is always correct,
only slower. Nothing here trusts DataLoader's request accounting: when workers end early
DataLoader gives their share of requests to the workers still running, which can then be
``prefetch_factor * num_workers`` items ahead, more than any fixed ring would hold.

Ordering: a worker seals after writing and only then sends the message; the pipe's system calls
order the data before the main process reads it. The main process releases from the finalizer
of the numpy view that every tensor of the batch keeps alive (``torch.from_numpy`` holds it until
the storage is freed), so no reference can read the slot after its release; a lock release/acquire
pair before the release is a full fence on weakly ordered CPUs such as aarch64. The stamp is
checked when the batch is read as a guard; a mismatch would be a bug in this module, and raises.

A slot's mapping lives as long as the workers that write into it: the loader maps fresh slots for
each set of workers it forks (a new pass without persistent workers), so workers of an abandoned
pass can never write into the slots of the next one.

**Groups.** Each DataLoader item costs ~250 µs of CPU over both processes whatever it carries
(measured here with 2 workers yielding small prebuilt objects: a request pickled by a feeder thread
in the main process, the worker's fetch, its result pickled by a feeder thread of its own, the
main process's poll and read), ~0.4 s per pass of the benchmark's 1,600 batches: a tenth of the
whole pipeline's CPU. So a worker sends its batches in *groups* (:func:`grouped`): one item
holds up to :func:`group_size` batches (1, 2, 4, ... at the start of a pass, so the first batch
is not held back), and the main process hands them out one at a time in the order DataLoader
gives without groups (:func:`ungrouped`): one batch of each worker in turn, a worker that ended
left out. ``prefetch_factor`` then counts groups, and the loader gives each worker ``(prefetch_factor
+ 2) x group`` slots and a few for batches the training loop still holds.
"""

from __future__ import annotations

import collections
import itertools
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from mixer.errors import MixerError

log = logging.getLogger(__name__)
_POOLS: weakref.WeakValueDictionary[int, SlotPool] = weakref.WeakValueDictionary()
_ids = itertools.count()
_STATE_BYTES = 8
FREE, WRITING = 0, -1
T = TypeVar("T")

#: Batches in one DataLoader item at most, and the bytes a group's batches may fill at most: the
#: per-item cost (~250 µs) is then under 2% of what a group of the benchmark's 256 KB batches costs
#: to make, and a batch of 2 MB or more (~40 ms to make) travels alone.
MAX_GROUP = 8
GROUP_BYTES = 2 << 20


class SlotPool:
    """``num_workers * slots`` slots of ``slot_elems`` elements of ``dtype`` in one anonymous
    ``MAP_SHARED`` mapping. Pages are only committed when first written."""

    def __init__(self, *, num_workers: int, slots: int, slot_elems: int, dtype: np.dtype[Any]) -> None:
        self.id = next(_ids)
        self.num_workers = num_workers
        self.slots = slots
        self.slot_elems = slot_elems
        self.dtype = np.dtype(dtype)
        data_bytes = slot_elems * self.dtype.itemsize
        # State word, data, then align each slot to a page.
        self.slot_bytes = -(-(_STATE_BYTES + data_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        self.region = mmap.mmap(-1, self.slot_bytes * num_workers * slots, flags=mmap.MAP_SHARED)
        # Every slot's state word, one int64 each (an anonymous mapping starts zeroed: all FREE).
        self._states = np.ndarray(
            (num_workers, slots), dtype=np.int64, buffer=self.region, strides=(slots * self.slot_bytes, self.slot_bytes)
        )
        # Counts the batches this process has written (the stamps) and where its search for a free
        # slot starts. Each forked worker has its own copy; stamps stay unique across the passes of
        # persistent workers.
        self.written = 0
        self._next = 0
        self._warned_full = False
        _POOLS[self.id] = self

    def _data(self, worker: int, slot: int, n: int) -> np.ndarray:
        offset = (worker * self.slots + slot) * self.slot_bytes + _STATE_BYTES
        return np.frombuffer(self.region, dtype=self.dtype, count=n, offset=offset)

    def claim(self, worker: int, n: int) -> tuple[int, int, np.ndarray] | None:
        """A free slot of ``worker``, marked as being written: (slot, stamp to seal it with, a
        writable view of ``n`` elements); None when the batch is larger than a slot or every slot
        still waits to be read (the batch then travels by value)."""
        if n > self.slot_elems:
            return None
        states = self._states[worker]
        for i in range(self.slots):
            slot = (self._next + i) % self.slots
            if states[slot] == FREE:
                break
        else:
            if not self._warned_full:
                self._warned_full = True
                log.debug(
                    "worker %d: every batch slot still waits to be read; sending batches by value until one is free",
                    worker,
                )
            return None
        self._next = (slot + 1) % self.slots
        self.written += 1
        states[slot] = WRITING
        return slot, self.written, self._data(worker, slot, n)

    def seal(self, worker: int, slot: int, stamp: int) -> None:
        """Mark the slot's data complete (after the batch was written into it, before it is sent)."""
        self._states[worker, slot] = stamp

    def writer(self, worker: int) -> SlotWriter:
        """How one batch of ``worker`` gets into a slot: pass its ``out`` to the collate, then
        ``seal()``."""
        return SlotWriter(self, worker)

    def view_out(self, worker: int, slot: int, stamp: int, n: int) -> np.ndarray:
        """The batch in the slot, as a view of it; the slot is released to its worker when the view
        is freed (with every tensor made from it)."""
        if self._states[worker, slot] != stamp:
            raise MixerError(
                f"batch slot {slot} of worker {worker} holds {int(self._states[worker, slot])}, expected stamp "
                f"{stamp}: flow control broken"
            )
        data = self._data(worker, slot, n)
        weakref.finalize(data, self._release, worker, slot).atexit = False
        return data

    def _release(self, worker: int, slot: int) -> None:
        _fence()
        self._states[worker, slot] = FREE


class SlotWriter:
    """One batch's claim on its worker's slots. ``out(n)`` is what a collate asks for its buffer:
    a free slot, claimed (moved to being written), or None when the batch is larger than a slot or
    every slot still waits to be read (the batch then travels by value). ``seal()``, after the batch
    was written and before it is sent, marks the claimed slot complete and returns what the batch
    carries to find it again, ``(pool id, worker, slot, stamp)``; None when nothing was claimed."""

    __slots__ = ("pool", "worker", "_claimed")

    def __init__(self, pool: SlotPool, worker: int) -> None:
        self.pool = pool
        self.worker = worker
        self._claimed: tuple[int, int] | None = None

    def out(self, n: int) -> np.ndarray | None:
        assert self._claimed is None, "a batch claims one slot"
        got = self.pool.claim(self.worker, n)
        if got is None:
            return None
        slot, stamp, data = got
        self._claimed = (slot, stamp)
        return data

    def seal(self) -> SlotRef | None:
        """Seal the claimed slot; where the batch lives, for ``Batch.slot``."""
        if self._claimed is None:
            return None
        slot, stamp = self._claimed
        self.pool.seal(self.worker, slot, stamp)
        return (self.pool.id, self.worker, slot, stamp, view_slot)


#: Where a batch lives in a slot: (pool id, worker, slot, stamp, the function that views it there).
#: The batch pickles it as it is, so the batching layer needs to know nothing of this module.
SlotRef = tuple[int, int, int, int, Callable[[int, int, int, int, int], np.ndarray]]


def view_slot(pool_id: int, worker: int, slot: int, stamp: int, n: int) -> np.ndarray:
    """The ``n`` elements of a sealed slot, in the process that reads the batch (see :meth:`SlotPool.view_out`)."""
    return pool(pool_id).view_out(worker, slot, stamp, n)


def _fence() -> None:
    """Order every load before this call ahead of every store after it. Releasing a held lock and
    taking it again is a store-release followed by a load-acquire, which no CPU reorders. x86-64
    needs none of it (stores are never reordered ahead of earlier loads); it costs ~0.2 µs. The
    lock is a fresh one so that threads copying at once never share it."""
    lock = threading.Lock()
    lock.acquire()
    lock.release()
    lock.acquire()


def pool(pool_id: int) -> SlotPool:
    try:
        return _POOLS[pool_id]
    except KeyError:
        raise MixerError(f"batch slot pool {pool_id} is gone: a batch from a worker outlived its loader") from None


def group_size(batch_bytes: int) -> int:
    """Batches per group for batches of up to ``batch_bytes`` (the slot size)."""
    return max(1, min(MAX_GROUP, GROUP_BYTES // max(batch_bytes, 1)))


def grouped(batches: Iterable[T], worker: int, size: int) -> Iterator[tuple[int, list[T], bool]]:
    """A worker's batches as DataLoader items ``(worker, batches, last)``: groups of 1, 2, 4, ...
    up to ``size`` batches. The group that ends the stream says ``last`` (it may be empty), so the
    main process knows the worker ended without inferring it from DataLoader's order. An error
    ends the group: the batches made before it go first, then the error, as without groups."""
    it = iter(batches)
    n = 1
    while True:
        group: list[T] = []
        try:
            while len(group) < n:
                group.append(next(it))
        except StopIteration:
            yield worker, group, True
            return
        except Exception:
            if group:
                yield worker, group, False
            raise
        yield worker, group, False
        n = min(2 * n, size)


def ungrouped(groups: Iterator[tuple[int, list[T], bool]], num_workers: int) -> Iterator[T]:
    """The batches of :func:`grouped` items in the order DataLoader delivers single batches: one of
    each worker in turn (worker ``w``'s ``k``-th batch is global step ``k * num_workers + w``), a
    worker that ended left out. Each worker's batches arrive in its own order; a group that came
    early (another worker's, while this one's turn waits) is held, at most about one per worker."""
    pending: list[collections.deque[T]] = [collections.deque() for _ in range(num_workers)]
    ended = [False] * num_workers
    turn = 0
    while True:
        while not pending[turn] and not ended[turn]:
            item = next(groups, None)
            if item is None:
                raise MixerError(f"DataLoader ended before worker {turn} sent its last group: transport broken")
            worker, batches, last = item
            pending[worker].extend(batches)
            ended[worker] = ended[worker] or last
        if pending[turn]:
            yield pending[turn].popleft()
        for step in range(1, num_workers + 1):
            nxt = (turn + step) % num_workers
            if pending[nxt] or not ended[nxt]:
                turn = nxt
                break
        else:
            break
    # Every worker sent its last group; what DataLoader has left are their ends.
    for worker, batches, _ in groups:
        raise MixerError(f"worker {worker} sent {len(batches)} batch(es) after its last group: transport broken")
