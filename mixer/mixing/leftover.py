"""What the old readers of an elastic resume left, and which new rank takes which part of it
(:mod:`mixer.mixing.elastic`).

**The split.** The old readers' parts lie one after the other on a line, and so do the new ranks':
old reader ``k`` of ``R`` covers ``[k R', (k + 1) R')`` of ``R R'`` points, and new rank ``r``, with
``N'`` of the ``R' = W' N'`` new readers, covers ``[r N' R, (r + 1) N' R)``. A new rank takes the
leftover of the old readers its stretch overlaps, in proportion: of an old reader that the boundary
between two new ranks cuts, each takes the items whose middle falls in its stretch (its unread
slices weighed by bytes, its buffered samples by count, both in a fixed order). Every item has
exactly one new rank, and a new rank reads the states of at most ``W / W' + 2`` of the ``W`` old
ranks (``W / W'`` rounded up, plus one on each side), whatever the size of either world.

**The table.** What a new rank needs of an old reader is a few integers per source (where its
stream stood) and the locations of its buffered samples (:class:`Stood`), read from its snapshot's
columns a whole column at a time (:func:`mixer.state.columns.unpack_rows`): no Python object per
buffered sample. A location is kept as two int64s (:func:`location_keys`: the shard, then the tar
block), so memory follows the samples the rank takes, at 8 bytes each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mixer.errors import StateError
from mixer.plan.shards import ShardSlice, plan_some, slice_of
from mixer.read.text import CHUNK_SHIFT
from mixer.state.checkpoint import SNAPSHOT_KEYS, expect_keys
from mixer.state.columns import unpack, unpack_rows
from mixer.stream.source_stream import SourceStream

if TYPE_CHECKING:
    from mixer.mixing.mixture import Mixture


@dataclass(frozen=True)
class Split:
    """The line of the module docstring: ``old`` readers (``R``), ``new`` readers (``R'``), ``per_rank``
    new readers per new rank (``N'``). Exact integer arithmetic, so every new rank draws the same
    boundaries."""

    old: int
    new: int
    per_rank: int

    def _rank_start(self, rank: int) -> int:
        return rank * self.per_rank * self.old

    def readers_of(self, rank: int) -> range:
        """The old readers whose parts new rank ``rank``'s stretch overlaps."""
        lo, hi = self._rank_start(rank), self._rank_start(rank + 1)
        return range(lo // self.new, (hi - 1) // self.new + 1)

    def overlap(self, rank: int, k: int) -> int:
        """How much of old reader ``k``'s part (``new`` points in all) lies in new rank ``rank``'s stretch."""
        lo = max(k * self.new, self._rank_start(rank))
        hi = min((k + 1) * self.new, self._rank_start(rank + 1))
        return max(hi - lo, 0)

    def rank_at(self, k: int, num: int, den: int) -> int:
        """The new rank of the point ``num / den`` of the way through old reader ``k``'s part."""
        return (k * self.new * den + self.new * num) // (self.per_rank * self.old * den)

    def _first(self, k: int, n: int, rank: int) -> int:
        """The first of ``n`` items of old reader ``k`` (item ``j``'s middle at ``(2j + 1) / 2n`` of its
        part) whose new rank is ``rank`` or later: the least ``j`` with ``R'(2j + 1) >= 2n (r N' R - k R')``."""
        need = 2 * n * (self._rank_start(rank) - k * self.new)
        odd = -(-need // self.new)  # the least 2j + 1 that reaches it
        return min(max(-(-(odd - 1) // 2), 0), n)

    def take(self, k: int, n: int, rank: int) -> slice:
        """Which of old reader ``k``'s ``n`` items (in their fixed order) go to new rank ``rank``."""
        return slice(self._first(k, n, rank), self._first(k, n, rank + 1))

    def counted_on(self, k: int) -> tuple[int, int]:
        """The new (rank, reader) that carries old reader ``k``'s counters: the rank where its part
        starts, its ``k % N'``-th reader, so that the counters sum over the new world as they did."""
        return self.rank_at(k, 0, 1), k % self.per_rank


#: The integers a new rank reads of an old reader's stream per source.
POSITION = ("epoch", "slice_pos", "next_index", "next_offset", "inherit_epoch")


@dataclass
class Stood:
    """Where old reader ``reader`` stood (its settled snapshot), as far as a new rank needs it: per
    source its stream's :data:`POSITION` (one int array per field) and inherited slice rows, and,
    sorted, the :func:`location_keys` of the buffered samples of its part that go to this rank;
    its totals and its selector's state."""

    reader: int
    batches: int
    tokens: int
    counters: np.ndarray  # (sources, counter fields)
    selector: dict[str, Any]
    position: dict[str, np.ndarray]
    inherit: list[list[list[int]]]
    buffered: list[np.ndarray | None]  # location keys; None once handed on


def stood(
    snapshot: Any, reader: int, *, sources: int, batcher: Any, shared: bool, take: Callable[[int], slice]
) -> Stood:
    """:class:`Stood` from a reader snapshot (a StateError naming the part and key when it does not fit
    this mixture). ``batcher``: the class of the mixture's batchers (its ``STATE_DEPTHS`` and
    ``LOCATED`` fields); ``shared``: one batcher for all sources (``mix="sample"``, locations
    ``(source, shard, offset)``); ``take(n)``: which of ``n`` sorted buffered samples this rank takes."""
    snapshot = expect_keys("reader snapshot", snapshot, SNAPSHOT_KEYS)
    streams = expect_keys("streams", snapshot["streams"], tuple(SourceStream.STATE_DEPTHS))
    batchers = expect_keys("batchers", snapshot["batchers"], tuple(batcher.STATE_DEPTHS))
    n = sources
    position = {f: np.asarray(unpack(streams[f], 0, n, f"streams state: {f!r}"), dtype=np.int64) for f in POSITION}
    of_source: list[np.ndarray] = []  # the source of each row of `rows`, piece by piece
    rows: list[np.ndarray] = []
    for f in SourceStream.LOCATED:
        per, found = unpack_rows(streams[f], SourceStream.STATE_DEPTHS[f], n, f"streams state: {f!r}")
        of_source.append(np.repeat(np.arange(n), per))
        rows.append(_columns(found, 0, 2))
    for f in batcher.LOCATED:
        where = f"batchers state: {f!r}"
        per, found = unpack_rows(batchers[f], batcher.STATE_DEPTHS[f], 1 if shared else n, where)
        if not shared:
            of_source.append(np.repeat(np.arange(n), per))
            rows.append(_columns(found, 0, 2))
            continue
        located = _columns(found, 0, 3)
        if located.size and (located[:, 0].min() < 0 or located[:, 0].max() >= n):
            raise StateError(f"{where}: a location names source {int(located[:, 0].max())}, this mixture has {n}")
        of_source.append(located[:, 0])
        rows.append(located[:, 1:3])
    buffered: list[np.ndarray | None] = [
        keys[take(len(keys))] for keys in _sorted_by_source(np.concatenate(of_source), np.concatenate(rows), n)
    ]
    _, counters = unpack_rows(snapshot["counters"], 1, n, "reader snapshot state: 'counters'")
    return Stood(
        reader=reader,
        batches=int(snapshot["batches"]),
        tokens=int(snapshot["tokens"]),
        counters=counters,
        selector=snapshot["selector"],
        position=position,
        inherit=unpack(streams["inherit"], 2, n, "streams state: 'inherit'"),
        buffered=buffered,
    )


def epochs(snapshot: Any, sources: int) -> np.ndarray:
    """The epoch each source's stream of a reader snapshot stands in (one column, not the snapshot)."""
    snapshot = expect_keys("reader snapshot", snapshot, SNAPSHOT_KEYS)
    streams = expect_keys("streams", snapshot["streams"], tuple(SourceStream.STATE_DEPTHS))
    return np.asarray(unpack(streams["epoch"], 0, sources, "streams state: 'epoch'"), dtype=np.int64)


def _columns(rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Columns ``lo:hi`` of ``rows`` (a location inside wider rows: packer pieces), ``(0, hi - lo)`` when empty."""
    if not len(rows):
        return np.zeros((0, hi - lo), dtype=np.int64)
    if rows.shape[1] < hi:
        raise StateError(f"a buffered sample's location has {rows.shape[1]} ints, expected at least {hi}")
    return rows[:, lo:hi]


def _sorted_by_source(source: np.ndarray, rows: np.ndarray, sources: int) -> list[np.ndarray]:
    """Per source, the :func:`location_keys` of its rows (``source[j]`` is row ``j``'s), sorted, each
    once: one sort for all sources (a reader holds a few hundred samples of each of hundreds)."""
    keys = location_keys(rows)
    order = np.lexsort((keys[:, 1], keys[:, 0], source))
    keys, source = keys[order], source[order]
    if len(keys) > 1:
        keep = np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1) | (source[1:] != source[:-1])])
        keys, source = keys[keep], source[keep]
    ends = np.cumsum(np.bincount(source, minlength=sources)).tolist()
    return [keys[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def unique_sorted(keys: np.ndarray) -> np.ndarray:
    """Rows of :func:`location_keys` sorted (by location, then chunk), each once."""
    keys = keys[np.lexsort((keys[:, 1], keys[:, 0]))]
    if len(keys) > 1:
        keys = keys[np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1)])]
    return keys


_BLOCK_BITS, _BLOCKS = 9, 31  # tar blocks are 512 bytes; 2**31 of them: shards up to 1 TiB
_OFFSET = (1 << CHUNK_SHIFT) - 1  # a location's byte offset; above it, a text chunk's index + 1


def location_keys(rows: np.ndarray) -> np.ndarray:
    """``(shard, byte offset)`` rows as two int64 columns each, in the same order: the shard in the
    high bits of the first and the offset's tar block (samples start at 512-byte boundaries) in its low
    31; in the second, the part of the offset above :data:`mixer.read.text.CHUNK_SHIFT` (a chunk of a
    long text document: its index + 1; 0 for every other sample). A StateError for a location that is
    not one (a negative or unaligned offset, one past 1 TiB, a shard past 2**32)."""
    shard, offset = rows[:, 0], rows[:, 1] & _OFFSET
    if len(rows) and (
        int(shard.min()) < 0
        or int(shard.max()) >> 32
        or int(rows[:, 1].min()) < 0
        or int(offset.max()) >> (_BLOCK_BITS + _BLOCKS)
        or np.any(offset & ((1 << _BLOCK_BITS) - 1))
    ):
        raise StateError(
            "elastic resume: a buffered sample's location is not a (shard, byte offset) of a tar member "
            f"(shards {int(shard.min())}..{int(shard.max())}, offsets {int(offset.min())}..{int(offset.max())})"
        )
    keys = np.empty((len(rows), 2), dtype=np.int64)
    keys[:, 0] = (shard << _BLOCKS) | (offset >> _BLOCK_BITS)
    keys[:, 1] = rows[:, 1] >> CHUNK_SHIFT
    return keys


def location_rows(keys: np.ndarray) -> np.ndarray:
    """The ``(shard, byte offset)`` rows of :func:`location_keys`."""
    rows = np.empty((len(keys), 2), dtype=np.int64)
    rows[:, 0] = keys[:, 0] >> _BLOCKS
    rows[:, 1] = ((keys[:, 0] & ((1 << _BLOCKS) - 1)) << _BLOCK_BITS) | (keys[:, 1] << CHUNK_SHIFT)
    return rows


class Plans:
    """The old world's plans (``readers`` readers in all) of the old readers ``ks``: one
    :func:`mixer.plan.shards.plan_some` per (source, epoch), computed when first asked for."""

    def __init__(self, mixture: Mixture, readers: int, ks: Iterable[int]) -> None:
        self.mixture, self.readers, self.ks = mixture, readers, sorted(ks)
        self._done: dict[tuple[int, int], dict[int, list[ShardSlice]]] = {}

    def of(self, i: int, epoch: int, k: int) -> list[ShardSlice]:
        if (i, epoch) not in self._done:
            listed = self.mixture.listed[i]
            self._done[i, epoch] = plan_some(
                len(listed.shards),
                self.readers,
                self.ks,
                seed=self.mixture.seed,
                source=listed.name,
                epoch=epoch,
                sizes=listed.shard_bytes,
                index=listed.index,
            )
        return self._done[i, epoch][k]


def unread(mixture: Mixture, i: int, old: Stood, last: int, plans: Plans) -> list[tuple[int, int, ShardSlice]]:
    """Old reader ``old``'s unread slices of source ``i`` in the source-epochs up to ``last``, in reading
    order, as ``(epoch, place in the epoch's part, slice)``: the rest of the part of the epoch it
    stood in (the slice it was in continues from its sample index and byte offset; a sample range
    read to its end is done), then its whole part of every later epoch up to ``last`` (another old
    reader already reached them). A part is what it inherited for the epoch it inherited, else its plan."""
    pos = {f: int(v[i]) for f, v in old.position.items()}
    out: list[tuple[int, int, ShardSlice]] = []
    for e in range(pos["epoch"], last + 1):
        if pos["inherit_epoch"] == e:
            slices = [slice_of(row, f"source {mixture.listed[i].name!r} stream") for row in old.inherit[i]]
        else:
            slices = plans.of(i, e, old.reader)
        if e > pos["epoch"]:
            out.extend((e, p, sl) for p, sl in enumerate(slices))
            continue
        start, index, offset = pos["slice_pos"], pos["next_index"], pos["next_offset"]
        for p, sl in enumerate(slices[start:], start=start):
            if p == start and (index or offset):
                if sl.stop is not None and index >= sl.stop:
                    continue  # [index] the range was read to its end
                sl = sl._replace(start=index, begin=offset)  # continues at its sample and byte
            out.append((e, p, sl))
    return out


def slice_bytes(sl: ShardSlice, size: int | None) -> int:
    """The bytes a reader reads for a slice (the whole rest of the shard for an in-shard split); at
    least 1, so that slices of shards of unknown size are weighed alike."""
    end = sl.end if sl.end is not None else size
    return max((end or 0) - sl.begin, 1)


def taken_units(
    split: Split, rank: int, k: int, units: Sequence[tuple[int, int, ShardSlice]], sizes: Sequence[int]
) -> list[int]:
    """Which of old reader ``k``'s ``units`` (in reading order, ``sizes`` bytes each) go to new rank
    ``rank``: those whose middle byte lies in its stretch."""
    total, before, mine = 2 * sum(sizes), 0, []
    for u, size in enumerate(sizes):
        if split.rank_at(k, 2 * before + size, total) == rank:
            mine.append(u)
        before += size
    return mine
