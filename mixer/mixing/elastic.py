"""Elastic resume: a run saved on ``W`` ranks x ``N`` readers continues on ``W'`` x ``N'``.

Each rank saves its own loader state (``Loader.state_dict()``); on resume every new rank passes the
saved ranks' states to ``Loader.load_state_dict``: a list, or any sequence that reads ``states[r]``
(rank ``r``'s state) when asked, so that a rank reads only the states it needs. Each new rank
works out its own part; all of them together settle every old reader once. With the same shape
the rank's own state resumes exactly (batch for batch).

For every source:

1. **Where each old reader really stood.** A saved reader state is a snapshot plus ``replay``
   batches made after it; unless it was saved at a snapshot, the reader is rebuilt in its old
   place, restored and replayed (:meth:`mixer.mixing.mixture.Reader.settle`), so that its state is
   that of its last batch handed out. Only the new rank that takes its leftover does this
   (:mod:`mixer.mixing.leftover`: old reader ``k``'s leftover goes to the new ranks whose stretch of a
   common line overlaps its part; a new rank takes about ``W / W'`` old ranks' worth).
2. **The step and the last epochs, agreed.** Let ``E`` be the latest epoch any old reader reached
   (per source) and the step the most batches any old rank handed out. Each new rank knows them for
   the old readers it took; one ``all_reduce`` (max) of those few integers over the new ranks gives
   every rank the whole run's (the loader does it over its process group). Without a process group
   of the new ranks, each rank reads every saved state for them (the epoch column of every snapshot;
   a reader saved between snapshots is settled), which gives the same integers at a cost that grows
   with the old world.
3. **What is left, and the re-split.** Left are, per old reader at epoch ``e``: the unread slices of
   its part of ``e`` (the slice it was in continues from its sample index and byte offset; an
   in-shard split or an index range keeps its sample filter), its whole planned part of every epoch
   ``e < e' <= E``, and every sample it read but did not deliver (shuffle buffers, buckets, ready
   batches and packer rows), by location. A new rank deals the slices it took to its readers by
   bytes (:func:`deal`: greedy, largest first, onto the least-loaded reader, as
   :func:`mixer.plan.shards.plan` assigns shards), each slice whole to one reader, each reader reading
   its slices in epoch order; it splits the buffered samples it took, sorted by location, into one
   run per reader (re-read by location, :mod:`mixer.stream.reread`, into the new readers' shuffle
   buffers). A new reader's stream holds its slices as a stand-in for epoch ``E``
   (``SourceStream.inherited``) and then continues with epoch ``E + 1`` planned for the new world.
   So every sample of every source-epoch up to ``E`` is delivered exactly once across the change,
   and later epochs are the new world's.

The mixing state carries over: the global step (the new readers continue from there in DataLoader
order); tokens seen and the selector's totals, each old reader's weighed by the part of its work a
new reader takes (see :func:`merge_selector`); each old reader's counters on one new reader (the
loaders' sums over all ranks stay right). The result is a loader state of the usual format for this
rank. It is deterministic, not identical to any uninterrupted run.

With ``stop="first_exhausted"`` a new reader ends when the first of its sources runs out, as any
reader does, so what it inherited of the others may stay undelivered (that policy never promises
every sample). Not supported (a :class:`~mixer.StateError` says so): ``Packed(split_documents=True)`` (a buffered
row may hold the tail of a document whose head was delivered) and :class:`~mixer.Adaptive` schedules
(the replay needs the shares in effect then).

Cost per new rank (measured in ``benchmarks/world_scale_elastic.py``): reading the states of at most
``W / W' + 2`` old ranks; settling the old readers it takes (a reader saved with ``replay = k``
re-runs ``k`` batches, under ``state_every``); one plan per source of the old world (what every
reader pays once at its start); a pass over the buffered samples it takes, at 16 bytes each. Like
MosaicML streaming's elastic resume, but by slices and locations rather than sample ids.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mixer.batching.batchers import make_batcher
from mixer.errors import StateError
from mixer.mixing.adaptive import Adaptive
from mixer.mixing.leftover import (
    Plans,
    Split,
    Stood,
    epochs,
    location_rows,
    slice_bytes,
    stood,
    taken_units,
    unique_sorted,
    unread,
)
from mixer.mixing.selector import Selector, make_selector
from mixer.plan.shards import slice_row
from mixer.plan.world import World
from mixer.spec.budget import Packed
from mixer.state import checkpoint
from mixer.state.columns import pack, pack_parts
from mixer.stream.source_stream import SourceStream

if TYPE_CHECKING:
    from mixer.mixing.mixture import Mixture, Reader

log = logging.getLogger(__name__)

#: ``agree(values)``: the elementwise max of ``values`` (int64) over every rank of the new run.
Agree = Callable[[np.ndarray], np.ndarray]


def resume_state(
    mixture: Mixture, states: Sequence[Any], *, num_workers: int, agree: Agree | None = None
) -> dict[str, Any]:
    """This rank's loader state, from the loader states of all the ranks of a saved run (``states[r]``:
    rank ``r``'s; read only when needed). ``agree``: the max over the new ranks (see :data:`Agree`;
    the loader passes one over its process group); None: this rank works the whole run's step and
    last epochs out itself, reading every saved state."""
    saved = Saved(mixture, states)
    readers = max(num_workers, 1)
    rank, world = mixture.rank, mixture.world_size
    if saved.world == world and saved.readers_per_rank(rank) == readers:
        own = saved.read(rank)  # the same shape: the rank's own state, exactly
        return dict(own, readers=[Saved.reader(own, w) for w in range(readers)])
    if isinstance(mixture.batching, Packed) and mixture.batching.split_documents:
        raise StateError(
            "elastic resume: not supported with Packed(split_documents=True) (a buffered row may hold the rest of a "
            "document whose head was delivered); resume with the saved world_size and num_workers"
        )
    if isinstance(mixture.schedule, Adaptive):
        raise StateError(
            "elastic resume: not supported with an Adaptive schedule; resume with the saved world_size and num_workers"
        )
    per = saved.readers_per_rank((rank * saved.world) // world)
    split = Split(saved.world * per, world * readers, readers)
    took = Taken(mixture, saved, split, rank)
    local = took.contribution()
    if world == 1:
        agreed = local  # the one new rank took every old reader
    elif agree is not None:
        agreed = np.asarray(agree(local.copy()), dtype=np.int64)
    else:
        agreed = np.maximum(local, took.everyone())
    step, last = _check_agreed(agreed, saved.world, per)
    out = [checkpoint.reader_state(s) for s in took.snapshots(step, last)]
    return checkpoint.loader_state(
        fingerprint=mixture.fingerprint,
        rank=rank,
        world_size=world,
        num_workers=readers,
        delivered=step,
        readers=out,
        adaptive=None,
    )


class Saved:
    """The saved ranks' loader states, each read (``states[r]``) and checked when needed: kind, version,
    fingerprint, shape. A list or tuple is in memory already: it is checked whole, as one run's
    states, and may list the ranks in any order; any other sequence is read lazily and must list
    them in rank order (``states[r]`` is rank ``r``'s)."""

    def __init__(self, mixture: Mixture, states: Sequence[Any]) -> None:
        if isinstance(states, (str, bytes, Mapping)) or not isinstance(states, Sequence) or not len(states):
            raise StateError(
                "elastic resume: expected a non-empty list of loader states, one per saved rank "
                f"(got {type(states).__name__})"
            )
        self.mixture, self.states, self.world = mixture, states, len(states)
        self._index: dict[int, int] | None = None  # rank -> place in a list
        self._per: int | None = None
        self._kept: dict[int, dict[str, Any]] = {}  # the states of a lazy sequence read so far
        if isinstance(states, (list, tuple)):
            self._check_list(states)

    def _check_list(self, states: Sequence[Any]) -> None:
        for s in states:
            checkpoint.check_saved(s, self.mixture)
        shapes = {(int(s["world_size"]), int(s["num_workers"])) for s in states}
        if len(shapes) != 1:
            raise StateError(
                "elastic resume: the states were saved by runs of different shapes (world_size, readers): "
                f"{sorted(shapes)}"
            )
        ((world, self._per),) = shapes
        self._index = {int(s["rank"]): j for j, s in enumerate(states)}
        missing = sorted(set(range(world)) - set(self._index))
        if missing or len(states) != world:
            raise StateError(
                f"elastic resume: need the state of every one of the {world} saved ranks, once each (missing ranks "
                f"{missing}, got {len(states)} states)"
            )

    def readers_per_rank(self, probe: int) -> int:
        """The saved run's readers per rank (read from rank ``probe``'s state, unless known)."""
        if self._per is None:
            self._per = int(self.read(probe)["num_workers"])
        return self._per

    def read(self, rank: int, *, keep: bool = True) -> dict[str, Any]:
        """Rank ``rank``'s saved state, checked; read from a lazy sequence once while ``keep``."""
        if self._index is not None:
            state = self.states[self._index[rank]]
        elif rank in self._kept:
            return self._kept[rank]
        else:
            state = checkpoint.check_saved(self.states[rank], self.mixture)
            if int(state["rank"]) != rank or int(state["world_size"]) != self.world:
                raise StateError(
                    f"elastic resume: states[{rank}] is the state of rank {state['rank']} of {state['world_size']}; a "
                    f"sequence of {self.world} states other than a list must give the saved ranks' states in rank order"
                )
            if self._per is not None and int(state["num_workers"]) != self._per:
                raise StateError(
                    "elastic resume: the states were saved by runs of different shapes (readers per rank "
                    f"{self._per} and {state['num_workers']})"
                )
        per = int(state["num_workers"])
        readers = state["readers"]
        if isinstance(readers, (str, bytes, Mapping)) or not isinstance(readers, Sequence) or len(readers) != per:
            raise StateError(f"elastic resume: the state of rank {rank} must list {per} reader state(s)")
        if keep and self._index is None:
            self._kept[rank] = state
        return state

    def forget(self, rank: int) -> None:
        """Rank ``rank``'s state is not needed again (a lazy sequence's is let go)."""
        self._kept.pop(rank, None)

    @staticmethod
    def reader(state: dict[str, Any], w: int) -> dict[str, Any]:
        """Reader ``w``'s state in a rank's saved state, checked (only the readers a rank takes are read:
        ``state["readers"]`` may be a sequence that reads them when asked, too)."""
        reader = state["readers"][w]
        return checkpoint.expect_keys(f"rank {state['rank']} loader reader {w}", reader, checkpoint.READER_KEYS)


def _check_agreed(agreed: np.ndarray, world: int, per: int) -> tuple[int, list[int]]:
    """The whole run's step and last epochs from the agreed integers (:meth:`Taken.contribution`)."""
    if agreed.shape[0] < 5 or agreed[1:5].tolist() != [world, -world, per, -per]:
        raise StateError(
            "elastic resume: the ranks of the new run were given different saved runs (world size x readers per rank "
            f"{world} x {per} here); every rank must pass the states of the same saved run"
        )
    return int(agreed[0]), [int(e) for e in agreed[5:]]


class Taken:
    """What new rank ``rank`` takes of the saved run (:mod:`mixer.mixing.leftover`): the old readers its
    stretch overlaps, settled and read as :class:`~mixer.mixing.leftover.Stood`, each read once."""

    def __init__(self, mixture: Mixture, saved: Saved, split: Split, rank: int) -> None:
        self.mixture, self.saved, self.split, self.rank = mixture, saved, split, rank
        self.per = split.old // saved.world
        self.sources = len(mixture.listed)
        fresh = _fresh_batchers(mixture)
        self.batcher = type(fresh[0])
        self.fresh = pack_parts([b.state_dict() for b in fresh], self.batcher.STATE_DEPTHS)
        self.ks = split.readers_of(rank)
        self.step = 0  # the most batches the old ranks taken handed out
        self.olds: list[Stood] = []
        for r in range(self.ks.start // self.per, (self.ks.stop - 1) // self.per + 1):
            state = saved.read(r)
            self.step = max(self.step, int(state["delivered"]))
            for w in range(self.per):
                k = r * self.per + w
                if k in self.ks:
                    self.olds.append(self._stood(k, self._settled(k, Saved.reader(state, w))))
            saved.forget(r)  # its readers are read: memory follows what this rank takes

    def _world(self, k: int) -> World:
        return World(rank=k // self.per, world_size=self.saved.world, worker=k % self.per, num_workers=self.per)

    def _settled(self, k: int, state: dict[str, Any]) -> dict[str, Any]:
        return settled_snapshot(self.mixture, self._world(k), state)

    def _stood(self, k: int, snapshot: dict[str, Any]) -> Stood:
        return stood(
            snapshot,
            k,
            sources=self.sources,
            batcher=self.batcher,
            shared=self.mixture.mix == "sample",
            take=lambda n: self.split.take(k, n, self.rank),
        )

    def contribution(self) -> np.ndarray:
        """``[step, W, -W, N, -N, E per source]`` over what this rank took (the max of these over the
        new ranks is the whole run's: every old reader is taken by some rank)."""
        last = np.max(np.stack([o.position["epoch"] for o in self.olds]), axis=0)
        world, per = self.saved.world, self.per
        return np.asarray([self.step, world, -world, per, -per, *last.tolist()], dtype=np.int64)

    def everyone(self) -> np.ndarray:
        """:meth:`contribution` over every old reader, from every saved state (no process group)."""
        log.info("elastic resume: no process group of the new ranks; reading all %d saved states", self.saved.world)
        step, last = 0, np.zeros(self.sources, dtype=np.int64)
        taken = {o.reader: o.position["epoch"] for o in self.olds}  # (settled already)
        for r in range(self.saved.world):
            state = self.saved.read(r, keep=False)
            step = max(step, int(state["delivered"]))
            for w in range(self.per):
                k = r * self.per + w
                at = taken[k] if k in taken else epochs(self._settled(k, Saved.reader(state, w)), self.sources)
                np.maximum(last, at, out=last)
        world, per = self.saved.world, self.per
        return np.asarray([step, world, -world, per, -per, *last.tolist()], dtype=np.int64)

    def snapshots(self, step: int, last: Sequence[int]) -> list[dict[str, Any]]:
        """This rank's new readers' snapshots, the leftover it took re-split among them (each reader's
        locations made rows only while its snapshot is packed)."""
        readers, mixture = self.split.per_rank, self.mixture
        plans = Plans(mixture, self.split.old, self.ks)
        inherit = [self._slices(i, last[i], plans) for i in range(self.sources)]
        buffered = [self._buffered(i) for i in range(self.sources)]
        out = []
        for j in range(readers):
            streams = [
                SourceStream.inheriting_state(
                    epoch=last[i],
                    buffer_size=mixture.shuffle_buffer,
                    buffer=location_rows(buffered[i][j]),
                    inherit=inherit[i][j],
                )
                for i in range(self.sources)
            ]
            out.append(self._snapshot(j, streams, step))
            for runs in buffered:
                runs[j] = runs[j][:0]  # packed: let its keys go
        return out

    def _slices(self, i: int, last: int, plans: Plans) -> list[list[list[int]]]:
        """Per new reader of this rank, the slice rows of source ``i`` it inherits, in epoch order."""
        sizes_of = self.mixture.listed[i].shard_bytes
        units = []  # (epoch, old reader, place, slice, bytes) taken by this rank
        for old in self.olds:
            left = unread(self.mixture, i, old, last, plans)
            sizes = [slice_bytes(sl, sizes_of[sl.shard]) for _, _, sl in left]
            whole = self.split.overlap(self.rank, old.reader) == self.split.new  # not cut by a boundary
            mine = range(len(left)) if whole else taken_units(self.split, self.rank, old.reader, left, sizes)
            for u in mine:
                e, p, sl = left[u]
                units.append((e, old.reader, p, sl, sizes[u]))
        units.sort(key=lambda u: u[:3])
        owner = deal([u[4] for u in units], self.split.per_rank)
        out: list[list[list[int]]] = [[] for _ in range(self.split.per_rank)]
        for unit, j in zip(units, owner):
            out[j].append(slice_row(unit[3]))
        return out

    def _buffered(self, i: int) -> list[np.ndarray]:
        """Per new reader of this rank, a run of the buffered samples of source ``i`` it took (location
        keys, sorted: a reader re-reads runs of nearby samples)."""
        parts = [o.buffered[i] for o in self.olds]
        for o in self.olds:
            o.buffered[i] = None  # handed on: the memory follows the samples still to re-split
        keys = unique_sorted(np.concatenate([p for p in parts if p is not None]))
        return [run.copy() for run in np.array_split(keys, self.split.per_rank)]

    def _snapshot(self, j: int, streams: list[dict[str, Any]], step: int) -> dict[str, Any]:
        """New reader ``j``'s snapshot: the re-split streams, fresh batchers, the step where the old
        run stopped, its part of the old readers' totals (see the module docstring)."""
        mixture, split, n = self.mixture, self.split, self.sources
        weigh = split.new * split.per_rank  # overlap / weigh: the part of an old reader this reader takes
        shares = [split.overlap(self.rank, o.reader) for o in self.olds]
        selectors = []
        for o in self.olds:
            old = make_selector(
                mixture.selector, n, seed=mixture.seed, stream=(o.reader // self.per, o.reader % self.per)
            )
            old.load_state_dict(o.selector)
            selectors.append(old)
        leader = max(range(len(self.olds)), key=lambda m: (self.olds[m].batches, -m))
        template = make_selector(mixture.selector, n, seed=mixture.seed, stream=(self.rank, j))
        selector = merge_selector(selectors, template, [s / weigh for s in shares], leader=leader)
        counters = np.zeros_like(self.olds[0].counters)
        for o in self.olds:
            if split.counted_on(o.reader) == (self.rank, j):
                counters += o.counters
        # reader j's k-th batch is step k * N' + j: it made the steps below `step` that are its own
        batches = max(0, -(-(step - j) // split.per_rank))
        return checkpoint.snapshot(
            batches=batches,
            tokens=sum(s * o.tokens for s, o in zip(shares, self.olds)) // weigh,
            active=pack([1] * n, 0),
            counters=pack(counters.tolist(), 1),
            selector=selector.state_dict(),
            streams=pack_parts(streams, SourceStream.STATE_DEPTHS),
            batchers=self.fresh,
        )


def _fresh_batchers(mixture: Mixture) -> list[Any]:
    """A new reader's batchers, empty (one shared in mix="sample"): their state is the same for all."""
    if mixture.mix == "sample":
        return [make_batcher(mixture.edges[0], mixture.batching, locate=checkpoint.locate_pair)]
    return [make_batcher(e, mixture.batching) for e in mixture.edges]


def settled_snapshot(mixture: Mixture, world: World, state: dict[str, Any]) -> dict[str, Any]:
    """An old reader's snapshot where it stood: as saved when it was saved at one, else rebuilt in its
    place, restored and replayed."""
    if state["snapshot"] is not None and int(state["replay"]) == 0 and not state["skips"]:
        return state["snapshot"]
    reader: Reader = mixture.reader(world)
    try:
        reader.load_state_dict(state)
        return reader.settle()["snapshot"]
    finally:
        _close(reader)


@dataclass
class Settled:
    """One old reader where it stood: its world and its snapshot's parts, unpacked (for inspection)."""

    world: World
    batches: int
    tokens: int
    counters: list[list[int]]
    selector: Selector
    streams: list[dict[str, Any]]
    batchers: list[dict[str, Any]]


def settle(mixture: Mixture, world: World, state: dict[str, Any]) -> Settled:
    """An old reader where it stood (:func:`settled_snapshot`), unpacked into one state per part."""
    snapshot = settled_snapshot(mixture, world, state)
    template = mixture.reader(world)
    try:
        batchers = template.batchers[:1] if mixture.mix == "sample" else template.batchers
        parts = checkpoint.unpack_snapshot(snapshot, streams=template.streams, batchers=batchers)
    finally:
        _close(template)
    selector = make_selector(
        mixture.selector, len(mixture.listed), seed=mixture.seed, stream=(world.rank, world.worker)
    )
    selector.load_state_dict(snapshot["selector"])
    return Settled(
        world,
        int(snapshot["batches"]),
        int(snapshot["tokens"]),
        parts.counters,
        selector,
        parts.streams,
        parts.batchers,
    )


def _close(reader: Reader) -> None:
    for st in reader.streams:
        st.close()


def deal(sizes: Sequence[int], readers: int) -> list[int]:
    """The reader of each unit: greedy longest-first onto the least-loaded reader (ties: the earlier
    unit, the lower reader), so loads differ by at most the largest unit."""
    owner = [0] * len(sizes)
    heap = [(0, r) for r in range(readers)]
    for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        load, r = heapq.heappop(heap)
        owner[u] = r
        heapq.heappush(heap, (load + sizes[u], r))
    return owner


def merge_selector(
    selectors: Sequence[Selector], template: Selector, weights: int | Sequence[float], *, leader: int = 0
) -> Selector:
    """One new reader's selector from old readers' (``template``: a fresh one of its kind): ``weights[k]``
    is the part of old reader ``k``'s work the new reader takes (a count ``n``: ``1 / n`` of each),
    ``leader`` the old reader that made the most batches; each selector class merges its own kind
    (:meth:`mixer.mixing.selector.Selector.merge`)."""
    olds = [s for s in selectors if type(s) is type(template)]
    if len(olds) != len(selectors):
        raise StateError(f"elastic resume: the saved readers' selectors are not all {template.name!r} selectors")
    parts = [1.0 / weights] * len(olds) if isinstance(weights, int) else [float(w) for w in weights]
    template.merge(olds, weights=parts, leader=leader)
    return template
