"""Which reader reads what: a pure function of (shard list, world, seed, source-epoch, index).

Every reader computes the same plan independently, so no coordination is needed: within one
source-epoch every sample is read by exactly one of the ``world.readers`` readers. Without a shard
index the units are whole shards (or, with fewer shards than readers, every ``parts``-th sample of a
shared shard); with one (:mod:`mixer.plan.index`) they are sample ranges, balanced by tokens.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from mixer.errors import ShardError, StateError
from mixer.plan.world import World, rng_for


class ShardSlice(NamedTuple):
    """Read shard ``shard`` (an index into the source's sorted shard list), keeping the samples whose
    index ``i`` inside the shard satisfies ``i % parts == part``. ``parts > 1`` only when a source has
    fewer shards than there are readers and no index: then several readers share a shard and each
    reads all of its bytes (I/O amplification) but keeps a disjoint subset of its samples.

    With an index: samples ``start`` to ``stop`` (exclusive; ``stop`` is None without an index),
    read from byte ``begin`` up to byte ``end`` (None: to the shard's end-of-archive block, for a
    range that is the whole shard)."""

    shard: int
    part: int = 0
    parts: int = 1
    start: int = 0
    stop: int | None = None
    begin: int = 0
    end: int | None = None


def slice_row(sl: ShardSlice) -> list[int]:
    """A slice as a state stores it: its fields, -1 for a None ``stop`` or ``end``."""
    return [-1 if v is None else v for v in sl]


def slice_of(row: Sequence[int], where: str) -> ShardSlice:
    """The slice of :func:`slice_row` (a StateError naming ``where`` when it is not one)."""
    if len(row) != len(ShardSlice._fields) or min(row[:4], default=0) < 0:
        raise StateError(
            f"{where} state: a slice is {len(ShardSlice._fields)} ints {list(ShardSlice._fields)} (got {list(row)})"
        )
    shard, part, parts, start, stop, begin, end = map(int, row)
    return ShardSlice(shard, part, parts, start, None if stop < 0 else stop, begin, None if end < 0 else end)


class Ranges(Protocol):
    """What a plan by sample ranges needs from an index (:class:`mixer.plan.shard_index.ShardIndex`):
    per shard, the sample count and the weight (sum of ``max(length, 1)``: tokens, each sample
    weighing at least one), and on demand one shard's token lengths and sample offsets."""

    @property
    def counts(self) -> np.ndarray: ...
    @property
    def weights(self) -> np.ndarray: ...
    def lengths(self, shard: int) -> np.ndarray: ...
    def offsets(self, shard: int) -> np.ndarray: ...
    def whole(self, shard: int) -> bool: ...


def shard_order(num_shards: int, *, seed: int, source: str, epoch: int) -> list[int]:
    """The shard order of one source-epoch: a fresh permutation per epoch, the same on every reader."""
    return _order(num_shards, seed=seed, source=source, epoch=epoch).tolist()


def _order(num_shards: int, *, seed: int, source: str, epoch: int) -> np.ndarray:
    return rng_for(seed, "shard-order", source, epoch).permutation(num_shards)


def plan(
    num_shards: int,
    world: World,
    *,
    seed: int,
    source: str,
    epoch: int,
    sizes: Sequence[int | None] | np.ndarray | None = None,
    index: Ranges | None = None,
) -> list[ShardSlice]:
    """This reader's part of one source-epoch, in reading order.

    With an ``index``: sample ranges (:func:`range_bounds`), whatever the number of shards.

    With at least as many shards as readers, whole shards are assigned: by bytes (greedy
    longest-first onto the least-loaded reader, ties broken by the epoch's shuffled order) when every
    shard size is known, else round-robin over the shuffled order. With fewer shards than readers,
    reader ``r`` reads shard ``order[r % S]`` and keeps every ``parts``-th sample of it.
    """
    if num_shards <= 0:
        return []
    order = _order(num_shards, seed=seed, source=source, epoch=epoch)
    readers, me = world.readers, world.reader
    if index is not None:
        return _range_slices(order, index, *range_bounds(order, index, readers, [me, me + 1]))
    if num_shards < readers:
        shard_pos = me % num_shards
        parts = len(range(shard_pos, readers, num_shards))
        return [ShardSlice(int(order[shard_pos]), me // num_shards, parts)]
    if sizes is None or _unsized(sizes):
        return [ShardSlice(s) for s in order[me::readers].tolist()]
    mine = order[_owners_by_size(order, sizes, readers)[order] == me]  # in the shuffled order
    return [ShardSlice(s) for s in mine.tolist()]


def plan_all(
    num_shards: int,
    readers: int,
    *,
    seed: int,
    source: str,
    epoch: int,
    sizes: Sequence[int | None] | np.ndarray | None = None,
    index: Ranges | None = None,
) -> list[list[ShardSlice]]:
    """Every reader's :func:`plan` of one source-epoch at once (reader ``k``'s is ``plan`` with
    ``world.reader == k``): one order and one assignment instead of one per reader."""
    some = plan_some(
        num_shards, readers, range(readers), seed=seed, source=source, epoch=epoch, sizes=sizes, index=index
    )
    return [some[k] for k in range(readers)]


def plan_some(
    num_shards: int,
    readers: int,
    ks: Iterable[int],
    *,
    seed: int,
    source: str,
    epoch: int,
    sizes: Sequence[int | None] | np.ndarray | None = None,
    index: Ranges | None = None,
) -> dict[int, list[ShardSlice]]:
    """The :func:`plan` of readers ``ks`` of ``readers``, by reader: one order and one assignment for
    all of them (an elastic resume plans the old readers whose leftover a new rank takes). The cost
    is one plan's, whatever the number of readers asked for."""
    ks = sorted(set(ks))
    if num_shards <= 0:
        return {k: [] for k in ks}
    order = _order(num_shards, seed=seed, source=source, epoch=epoch)
    if index is not None:
        points = sorted({*ks, *(k + 1 for k in ks)})
        at = dict(zip(points, range_bounds(order, index, readers, points)))
        return {k: _range_slices(order, index, at[k], at[k + 1]) for k in ks}
    if num_shards < readers:
        return {
            k: [
                ShardSlice(int(order[k % num_shards]), k // num_shards, len(range(k % num_shards, readers, num_shards)))
            ]
            for k in ks
        }
    if sizes is None or _unsized(sizes):
        return {k: [ShardSlice(s) for s in order[k::readers].tolist()] for k in ks}
    owners = _owners_by_size(order, sizes, readers)[order]  # the owner of each place of the order
    return {k: [ShardSlice(s) for s in order[owners == k].tolist()] for k in ks}


def _unsized(sizes: Sequence[int | None] | np.ndarray) -> bool:
    """Whether some shard's size is unknown (a C-level scan: a source lists up to ~1e5 shards)."""
    if isinstance(sizes, np.ndarray):
        return sizes.dtype == object and any(s is None for s in sizes)
    return None in sizes


# The greedy assignment works on one integer per reader, ``load * readers + reader``: its order is
# (load, reader), the heap's order. Loads are kept relative to the least one; under the greedy rule
# no reader is ever more than the largest shard above the least loaded, so a key stays below
# (2 * largest + 1) * readers, and numpy's int64 is used when that is below _KEY_LIMIT.
_KEY_LIMIT = 1 << 62
_MIN_READERS = 256  # fewer readers: the plain heap is as fast as a vectorised round
_MIN_RUN = 64  # a vectorised round that assigns fewer shards than this gives way to the heap ...
_BURST = 4096  # ... for at least this many shards (and at least one round)


def _owners_by_size(order: np.ndarray, sizes: Sequence[int | None] | np.ndarray, readers: int) -> np.ndarray:
    """The reader of every shard under greedy longest-processing-time: shards by decreasing size
    (ties: earlier in ``order`` first), each onto the least-loaded reader (ties: lowest index).

    Every reader computes the whole assignment, so it is kept cheap (1e6 shards over 65,536 readers:
    well under a second, see benchmarks/plan_scale.py). It is the heap's assignment, computed in
    rounds: take the least-loaded readers in (load, reader) order and give the j-th of them the j-th
    next shard, for as long as none of the readers already given one in this round has become less
    loaded than the next reader in line (the heap would pick it again) -- shards come by decreasing
    size and readers by increasing load, so a round usually covers all readers. Where rounds stay
    short (few readers, or a few much smaller loads), the heap itself runs.
    """
    n = len(order)
    try:
        size = np.asarray(sizes, dtype=np.int64)
    except TypeError:  # None among them: no size, no weight
        size = np.fromiter((s or 0 for s in sizes), dtype=np.int64, count=n)
    if n and size.min() < 0:
        bad = int(np.argmin(size))
        raise ShardError(f"shard {bad} has a negative size in the listing ({int(size[bad])} bytes); sizes must be >= 0")
    by_size = order[np.argsort(-size[order], kind="stable")]  # ties keep the shuffled order
    owner = np.empty(n, dtype=np.int64)
    positive = int(np.count_nonzero(size))
    first = min(readers, positive)
    # the first shards land on readers 0, 1, ... in turn: all start empty, and a loaded reader is
    # never picked while an empty one is left
    owner[by_size[:first]] = np.arange(first)
    largest = int(size.max()) if n else 0
    vector = readers >= _MIN_READERS and (2 * largest + 1) * readers < _KEY_LIMIT
    if vector:
        load = np.zeros(readers, dtype=np.int64)
        load[:first] = size[by_size[:first]]
        keys: np.ndarray | list[int] = np.sort(load * readers + np.arange(readers))
    else:
        keys = sorted(
            [*(s * readers + r for r, s in enumerate(size[by_size[:first]].tolist())), *range(first, readers)]
        )
    keys = _greedy(keys, size[by_size[first:positive]], by_size[first:positive], owner, readers)
    # empty shards all go to the least-loaded reader: giving it nothing keeps it the least loaded
    owner[by_size[positive:]] = int(keys[0]) % readers
    return owner


def _greedy(
    keys: np.ndarray | list[int], size: np.ndarray, shards: np.ndarray, owner: np.ndarray, readers: int
) -> np.ndarray | list[int]:
    """Assigns ``shards`` (by decreasing ``size``) to readers, writing ``owner``; ``keys`` are every
    reader's ``load * readers + reader``, sorted (a numpy array: vectorised rounds; a list: the
    heap only). Returns the keys after the last shard, sorted at least as a heap."""
    p, n = 0, len(shards)
    while p < n:
        if isinstance(keys, np.ndarray):
            m = min(readers, n - p)
            given = keys[:m] + size[p : p + m] * readers
            overtaken = np.minimum.accumulate(given[: m - 1]) < keys[1:m]
            run = int(np.argmax(overtaken)) + 1 if overtaken.any() else m
            if run >= min(m, _MIN_RUN):
                owner[shards[p : p + run]] = keys[:run] % readers
                keys = np.sort(np.concatenate([np.sort(given[:run]), keys[run:]]), kind="stable")  # merges two runs
                keys -= keys[0] // readers * readers
                p += run
                continue
            stop = min(n, p + max(readers, _BURST))
        else:
            stop = n
        heap = keys if isinstance(keys, list) else keys.tolist()  # sorted: a heap
        picked = []
        replace = heapq.heapreplace
        for s in size[p:stop].tolist():
            key = heap[0]
            picked.append(key % readers)
            replace(heap, key + s * readers)
        owner[shards[p:stop]] = picked
        p = stop
        if isinstance(keys, np.ndarray):
            base = heap[0] // readers * readers
            keys = np.sort(np.fromiter((k - base for k in heap), dtype=np.int64, count=readers))
        else:
            keys = heap
    return keys


# ---- with an index: sample ranges balanced by tokens ---------------------------------------------


def range_bounds(order: np.ndarray, index: Ranges, readers: int, ks: Sequence[int]) -> list[tuple[int, int]]:
    """Where reader ``k`` (for each ``k`` of ``ks``, 0..readers) starts: a position ``(p, i)``,
    sample ``i`` of the shard at place ``p`` of the epoch's ``order``. Reader ``k`` reads from its
    position up to reader ``k + 1``'s.

    The shards in the epoch's order are one sequence of samples, each weighing ``max(length, 1)``
    tokens, cut into ``readers`` runs of equal weight: a sample goes to the reader whose share of the
    total holds its midpoint. Loads differ by at most about one sample, whatever the number of
    shards (1.5 shards per reader included), and each reader reads at most two partial shards. The
    cost per reader: the order, a cumulative sum over the shards and the lengths of the (at most two)
    shards it starts and ends in -- no reader computes anyone else's part.
    """
    n = len(order)
    cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(index.weights[order], out=cum[1:])
    total = int(cum[-1])
    thr = [-(-2 * total * k // readers) for k in ks]  # sample j is reader k's from 2*mid(j) >= thr(k)
    places = np.searchsorted(cum[:-1], np.asarray([t // 2 for t in thr], dtype=np.int64), side="right") - 1
    out: list[tuple[int, int]] = []
    keys: dict[int, np.ndarray] = {}
    for k, t, p in zip(ks, thr, places.tolist()):
        if k <= 0 or n == 0:
            out.append((0, 0))
        elif k >= readers:
            out.append((n, 0))
        else:
            if p not in keys:  # twice each sample's midpoint, in tokens from the epoch's start
                w = np.maximum(index.lengths(int(order[p])), 1)
                keys[p] = 2 * int(cum[p]) + 2 * np.cumsum(w) - w
            out.append((p, int(np.searchsorted(keys[p], t, side="left"))))
    return out


def _range_slices(order: np.ndarray, index: Ranges, first: tuple[int, int], last: tuple[int, int]) -> list[ShardSlice]:
    """The slices from position ``first`` up to ``last`` (see :func:`range_bounds`)."""
    (pa, ia), (pb, ib) = first, last
    counts = index.counts
    out = []
    for p in range(pa, min(pb, len(order) - 1) + 1):
        s = int(order[p])
        count = int(counts[s])
        start = ia if p == pa else 0
        stop = min(ib, count) if p == pb else count
        if stop <= start:
            continue
        if start == 0 and stop == count and index.whole(s):
            out.append(ShardSlice(s, start=0, stop=count))
        else:
            offsets = index.offsets(s)
            out.append(ShardSlice(s, start=start, stop=stop, begin=int(offsets[start]), end=int(offsets[stop])))
    return out


def warn_shared_shards(listed: Sequence[Any], world: World, log: logging.Logger) -> None:
    """Say which sources have fewer shards than readers and no index (listed sources: ``name``,
    ``shards``, ``index``): their readers share shards, each reading every byte of its shard."""
    for s in listed:
        if len(s.shards) < world.readers and s.index is None:  # an index splits by byte ranges
            log.warning(
                "source %r has %d shard(s) for %d readers: readers share shards and each reads every byte of "
                "its shard but keeps only its part of the samples (I/O amplified up to %dx); more, smaller "
                "shards avoid it",
                s.name,
                len(s.shards),
                world.readers,
                -(-world.readers // len(s.shards)),
            )
