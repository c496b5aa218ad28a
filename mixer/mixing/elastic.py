"""Elastic resume: a run saved on ``W`` ranks x ``N`` readers continues on ``W'`` x ``N'``.

Each rank saves its own loader state (``Loader.state_dict()``); on resume every new rank passes the
list of all the saved ranks' states to ``Loader.load_state_dict`` and computes, independently and
identically, the whole re-split below, keeping its own part (no communication, as for the plan). With
the same shape the list resumes exactly as the rank's own state does (batch for batch).

For every source:

1. **Where each old reader really stood.** A saved reader state is a snapshot plus ``replay``
   batches made after it; the reader is rebuilt in its old place, restored and replayed
   (:meth:`mixer.mixing.mixture.Reader.settle`), so that its state is that of its last batch handed out.
2. **What is left of the source-epochs.** Let ``E`` be the latest epoch any old reader reached. Left
   are, per old reader at epoch ``e``: the unread slices of its part of ``e`` (the slice it was in
   continues from its sample index and byte offset; an in-shard split or an index range keeps its
   sample filter), and its whole planned part of every epoch ``e < e' <= E`` (some other reader
   already reached them). Plus every sample read but not delivered: those in shuffle buffers and in
   buckets (ready batches and packer rows included), by location.
3. **The re-split.** The slices are dealt to the ``W' x N'`` new readers by bytes (greedy, largest
   first, onto the least-loaded reader, as :func:`mixer.plan.shards.plan` assigns shards), each slice whole
   to one reader (a partly read shard continues on one reader), each reader reading its slices in
   epoch order; the buffered samples are dealt round-robin and read again by location
   (:mod:`mixer.stream.reread`) into the new readers' shuffle buffers. A new reader's stream holds its slices
   as a stand-in for epoch ``E`` (``SourceStream.inherited``) and then continues with epoch ``E + 1``
   planned for the new world. So every sample of every source-epoch up to ``E`` is delivered exactly
   once across the change, and later epochs are the new world's.

The mixing state carries over: the global step (the most batches any old rank handed out; the new
readers continue from there in DataLoader order), tokens and selector totals spread evenly over the
new readers (see :func:`merge_selector`), the per-source counters summed onto new reader 0 of rank 0
(the loaders' sums over all ranks stay right). The result is a loader state of the usual format for
this rank. It is deterministic, not identical to any uninterrupted run.

With ``stop="first_exhausted"`` a new reader ends when the first of its sources runs out, as any
reader does, so what it inherited of the others may stay undelivered (that policy never promises
every sample). Not supported (a :class:`~mixer.StateError` says so): ``Packed(split_documents=True)`` (a buffered
row may hold the tail of a document whose head was delivered) and :class:`~mixer.Adaptive` schedules
(the replay needs the shares in effect then).

Cost: every new rank settles every old reader; a reader saved with ``replay = k`` re-runs ``k``
batches (under ``state_every``) of reading, and every buffered sample is read again by its new reader.
Like MosaicML streaming's elastic resume, but by slices and locations rather than sample ids.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mixer.errors import StateError
from mixer.mixing.selector import Selector, make_selector
from mixer.plan.shards import ShardSlice, plan_all, slice_of, slice_row
from mixer.plan.world import World
from mixer.spec.budget import Packed
from mixer.state import checkpoint
from mixer.state.columns import pack, pack_parts
from mixer.stream.source_stream import SourceStream

if TYPE_CHECKING:
    from mixer.mixing.mixture import Mixture, Reader


@dataclass
class Settled:
    """One old reader where it stood: its world and its snapshot's parts, unpacked."""

    world: World
    batches: int
    tokens: int
    counters: list[list[int]]
    selector: Selector
    streams: list[dict[str, Any]]
    batchers: list[dict[str, Any]]


def resume_state(mixture: Mixture, states: Sequence[Any], *, num_workers: int) -> dict[str, Any]:
    """This rank's loader state, from the loader states of all the ranks of a saved run."""
    old_world, old_readers, by_rank = _check_states(mixture, states)
    readers = max(num_workers, 1)
    if (old_world, old_readers) == (mixture.world_size, readers):
        return by_rank[mixture.rank]  # the same shape: the rank's own state, exactly
    if isinstance(mixture.batching, Packed) and mixture.batching.split_documents:
        raise StateError(
            "elastic resume: not supported with Packed(split_documents=True) (a buffered row may hold the rest of a "
            "document whose head was delivered); resume with the saved world_size and num_workers"
        )
    if any(s["adaptive"] is not None for s in states):
        raise StateError(
            "elastic resume: not supported with an Adaptive schedule; resume with the saved world_size and num_workers"
        )
    template = mixture.reader(
        World(rank=mixture.rank, world_size=mixture.world_size)
    )  # unpacks the snapshots saved as they are
    try:
        settled = [
            settle(
                mixture,
                World(rank=r, world_size=old_world, worker=w, num_workers=old_readers),
                by_rank[r]["readers"][w],
                template,
            )
            for r in range(old_world)
            for w in range(old_readers)
        ]
    finally:
        _close(template)
    step = max(int(s["delivered"]) for s in states)
    new = mixture.world_size * readers
    mine = range(mixture.rank * readers, (mixture.rank + 1) * readers)
    streams: list[list[dict[str, Any]]] = [[] for _ in mine]
    plans = Plans(mixture, old_world * old_readers)
    for i in range(len(mixture.listed)):
        for j, st in enumerate(split_source(mixture, i, settled, new, mine, plans)):
            streams[j].append(st)
    out = []
    for j, g in enumerate(mine):
        world = World(rank=mixture.rank, world_size=mixture.world_size, worker=j, num_workers=readers)
        out.append(checkpoint.reader_state(_snapshot(mixture, world, g, settled, streams[j], step, new)))
    return checkpoint.loader_state(
        fingerprint=mixture.fingerprint,
        rank=mixture.rank,
        world_size=mixture.world_size,
        num_workers=readers,
        delivered=step,
        readers=out,
        adaptive=None,
    )


def _check_states(mixture: Mixture, states: Sequence[Any]) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """The saved world size, readers per rank and states by rank; a StateError unless ``states`` are
    one state of this mixture per saved rank, all of the same shape."""
    if not isinstance(states, (list, tuple)) or not states:
        raise StateError(
            f"elastic resume: expected a non-empty list of loader states, one per saved rank (got {type(states).__name__})"
        )
    for s in states:
        checkpoint.check_saved(s, mixture)
    shapes = {(int(s["world_size"]), int(s["num_workers"])) for s in states}
    if len(shapes) != 1:
        raise StateError(
            f"elastic resume: the states were saved by runs of different shapes (world_size, readers): {sorted(shapes)}"
        )
    ((world, readers),) = shapes
    by_rank = {int(s["rank"]): s for s in states}
    missing = sorted(set(range(world)) - set(by_rank))
    if missing or len(states) != world:
        raise StateError(
            f"elastic resume: need the state of every one of the {world} saved ranks, once each (missing ranks {missing}, got {len(states)} states)"
        )
    for r, s in by_rank.items():
        if not isinstance(s["readers"], list) or len(s["readers"]) != readers:
            raise StateError(f"elastic resume: the state of rank {r} must list {readers} reader state(s)")
        for k, reader in enumerate(s["readers"]):
            checkpoint.expect_keys(f"rank {r} loader reader {k}", reader, checkpoint.READER_KEYS)
    return world, readers, by_rank


def settle(mixture: Mixture, world: World, state: dict[str, Any], template: Reader | None = None) -> Settled:
    """An old reader where it stood: its snapshot as saved, or rebuilt in its place, restored and
    replayed. ``template``: any reader of the mixture, to unpack a snapshot without building one."""
    if state["snapshot"] is not None and int(state["replay"]) == 0 and not state["skips"] and template is not None:
        snapshot = state["snapshot"]
    else:
        reader: Reader = mixture.reader(world)
        try:
            reader.load_state_dict(state)
            snapshot = reader.settle()["snapshot"]
        finally:
            _close(reader)
        template = reader
    batchers = template.batchers[:1] if mixture.mix == "sample" else template.batchers
    parts = checkpoint.unpack_snapshot(snapshot, streams=template.streams, batchers=batchers)
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


class Plans:
    """The old world's plans, one :func:`mixer.plan.shards.plan_all` per (source, epoch) for all its readers."""

    def __init__(self, mixture: Mixture, readers: int) -> None:
        self.mixture, self.readers = mixture, readers
        self._done: dict[tuple[int, int], list[list[ShardSlice]]] = {}

    def of(self, i: int, epoch: int, reader: int) -> list[ShardSlice]:
        if (i, epoch) not in self._done:
            listed = self.mixture.listed[i]
            self._done[i, epoch] = plan_all(
                len(listed.shards),
                self.readers,
                seed=self.mixture.seed,
                source=listed.name,
                epoch=epoch,
                sizes=listed.shard_bytes,
                index=listed.index,
            )
        return self._done[i, epoch][reader]


def split_source(
    mixture: Mixture, i: int, settled: Sequence[Settled], new: int, mine: range, plans: Plans
) -> list[dict[str, Any]]:
    """Stream states of source ``i`` for the new readers ``mine`` (of ``new``): what the old
    readers left of its source-epochs, re-split (see the module docstring)."""
    listed = mixture.listed[i]
    last = max(int(s.streams[i]["epoch"]) for s in settled)
    units: list[tuple[int, ShardSlice]] = []  # (epoch, slice), in epoch order, then old reader, then plan order
    for e in range(min(int(s.streams[i]["epoch"]) for s in settled), last + 1):
        for s in settled:
            st = s.streams[i]
            if int(st["epoch"]) > e:
                continue
            slices = _old_plan(mixture, i, s, e, plans)
            if int(st["epoch"]) < e:
                units.extend((e, sl) for sl in slices)
                continue
            pos, index, offset = int(st["slice_pos"]), int(st["next_index"]), int(st["next_offset"])
            for p, sl in enumerate(slices[pos:], start=pos):
                if p == pos and (index or offset):
                    if sl.stop is not None and index >= sl.stop:
                        continue  # [index] the range was read to its end
                    sl = sl._replace(start=index, begin=offset)  # continues at its sample and byte
                units.append((e, sl))
    sizes = [_bytes(sl, listed.shard_bytes[sl.shard]) for _, sl in units]
    owner = deal(sizes, new)
    buffered = sorted(_buffered(mixture, i, settled))
    out = []
    for g in mine:
        inherit = [slice_row(sl) for (_, sl), o in zip(units, owner) if o == g]
        out.append(
            SourceStream.inheriting_state(
                epoch=last, buffer_size=mixture.shuffle_buffer, buffer=buffered[g::new], inherit=inherit
            )
        )
    return out


def _old_plan(mixture: Mixture, i: int, s: Settled, epoch: int, plans: Plans) -> list[ShardSlice]:
    """An old reader's slices of source ``i`` in ``epoch``: what it inherited, or its planned part."""
    st = s.streams[i]
    if int(st["inherit_epoch"]) == epoch:
        return [slice_of(row, f"source {mixture.listed[i].name!r} stream") for row in st["inherit"]]
    return plans.of(i, epoch, s.world.reader)


def _bytes(sl: ShardSlice, size: int | None) -> int:
    """The bytes a reader reads for a slice (the whole rest of the shard for an in-shard split); at
    least 1, so that slices of shards of unknown size are dealt evenly."""
    end = sl.end if sl.end is not None else size
    return max((end or 0) - sl.begin, 1)


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


def _buffered(mixture: Mixture, i: int, settled: Sequence[Settled]) -> set[tuple[int, int]]:
    """The (shard, offset) of every sample of source ``i`` the old readers read but did not deliver."""
    out: set[tuple[int, int]] = set()
    shared = mixture.mix == "sample"
    for s in settled:
        out.update((int(a), int(b)) for a, b in s.streams[i]["buffer"])
        for loc in _batcher_locations(s.batchers[0] if shared else s.batchers[i]):
            if not shared:
                out.add((int(loc[0]), int(loc[1])))
            elif int(loc[0]) == i:
                out.add((int(loc[1]), int(loc[2])))
    return out


def _batcher_locations(state: dict[str, Any]) -> list[Sequence[int]]:
    """Every location a bucketer's or packer's state holds (a packer piece ends in 4 placement ints)."""
    if "items" in state:
        return [*state["items"], *(loc for batch in state["ready"] for loc in batch)]
    return [piece[:-4] for group in (*state["ready"], *state["buffers"]) for piece in group]


def merge_selector(selectors: Sequence[Selector], template: Selector, new: int, *, leader: int = 0) -> Selector:
    """One new reader's selector from all the old readers' (``template``: a fresh one of its kind,
    ``new`` readers in all, ``leader``: the old reader that made the most batches); each selector
    class merges its own kind (:meth:`mixer.mixing.selector.Selector.merge`)."""
    olds = [s for s in selectors if type(s) is type(template)]
    if len(olds) != len(selectors):
        raise StateError(f"elastic resume: the saved readers' selectors are not all {template.name!r} selectors")
    template.merge(olds, readers=new, leader=leader)
    return template


def _snapshot(
    mixture: Mixture,
    world: World,
    g: int,
    settled: Sequence[Settled],
    streams: list[dict[str, Any]],
    step: int,
    new: int,
) -> dict[str, Any]:
    """New reader ``g``'s snapshot (at ``world``): fresh batchers, the re-split streams, the step
    where the old run stopped, the old totals (see the module docstring)."""
    reader = mixture.reader(world)
    try:
        n = len(mixture.listed)
        most = max(range(len(settled)), key=lambda k: (settled[k].batches, -k))
        selector = merge_selector([s.selector for s in settled], reader.selector, new, leader=most)
        counters = np.zeros((n, len(settled[0].counters[0]) if n else 0), dtype=np.int64)
        if g == 0:
            for s in settled:
                counters += np.asarray(s.counters, dtype=np.int64)
        batchers = reader.batchers[:1] if mixture.mix == "sample" else reader.batchers
        # reader w's k-th batch is step k * N' + w: it made the steps below `step` that are its own
        batches = max(0, -(-(step - world.worker) // world.num_workers))
        return checkpoint.snapshot(
            batches=batches,
            tokens=sum(s.tokens for s in settled) // new,
            active=pack([1] * n, 0),
            counters=pack(counters.tolist(), 1),
            selector=selector.state_dict(),
            streams=pack_parts(streams, reader.streams[0].STATE_DEPTHS),
            batchers=pack_parts([b.state_dict() for b in batchers], batchers[0].STATE_DEPTHS),
        )
    finally:
        _close(reader)
