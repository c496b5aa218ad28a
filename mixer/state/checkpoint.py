"""The whole resume state format: what a loader state holds, how each part checks its own piece, the
mixture's composed fingerprint, reader snapshots, worker rotation and sample locations.

A loader state (version :data:`STATE_VERSION`) is plain JSON::

    {"kind": "mixer.Loader", "version": 6, "fingerprint": "<32 hex>", "rank": r, "world_size": n,
     "num_workers": w, "delivered": batches handed out,
     "readers": [{"snapshot": <reader snapshot> | None, "replay": k, "skips": [[source, epoch, slice, ...]]}],
     "adaptive": None | <mixer.runtime.feedback.Feedback state>}

Per reader: the last *snapshot* a batch carried (taken every ``state_every`` batches), how many batches
the reader made after it (``replay``: re-run in-process on resume) and the ``skips`` (shards given
up under ``on_error="skip"``) it took since. The loader keeps these per reader as immutable
:class:`ReaderLog` values and attaches its :class:`Position` (the batches handed out and every
reader's log) to each batch it hands out, so the state as of any batch handed out can still be
built after later ones were (``Loader.state_dict(upto=batch)``). A reader snapshot is::

    {"batches", "tokens", "active", "counters", "selector", "streams": {field: column},
     "batchers": {field: column}}

where ``streams`` holds every SourceStream's state and ``batchers`` every Bucketer's or Packer's (one,
shared, in mix="sample") as columns over the sources (:mod:`mixer.state.columns`: each field one
compressed array over all sources, so a source never read costs a few bits, and a shuffle
buffer's draws are one integer; after an elastic resume a stream also lists the slices it inherited,
see :mod:`mixer.mixing.elastic`); ``active`` and ``counters`` likewise, the selector's floats as
compressed float64 bytes. :func:`readable` expands a snapshot into one dict per source.

A *gathered* state (:func:`gathered_state`, kind ``"mixer.AllRanks"``) holds the loader states of
every data-parallel rank, collected on rank 0, for frameworks that write one checkpoint from one
process::

    {"kind": "mixer.AllRanks", "version": 1, "rank": r, "states": [<loader state> | None, ...] | None,
     "trained": batches trained | None}

The state never holds configuration: the mixture appears as its fingerprint
(:mod:`mixer.mixing.fingerprint`), composed of what each configuration class says decides the stream
(their ``describe()``), and a state of another mixture, version or topology is refused with a
:class:`~mixer.StateError`.

Buffered samples are stored by *location* and read again on restore: ``(shard, byte offset)`` in a
stream or a per-source batcher, ``(source, shard, offset)`` in the shared batcher of
``mix="sample"``. Each stateful part (:class:`Stateful`) restores only itself and refuses a state
with unknown or missing keys (:func:`expect_keys`); parts that hold samples (:class:`Rereads`) list
their locations after ``load_state_dict`` and take the re-read samples with ``attach``. A
snapshot locates the items of its batchers a column at a time (:func:`pack_located`): the same
columns as locating each item, without a Python object per buffered sample.

An elastic resume (:mod:`mixer.mixing.elastic`) reads this same format, and only part of it: of
each old rank whose readers a new rank takes over, ``num_workers``, ``delivered`` and those readers'
states; of their snapshots, the streams' positions and inherited slices, the buffered locations (a
column at a time, :func:`mixer.state.columns.unpack_rows`), the counters, tokens and selector.
Nothing is recorded for it at save time: what an old reader left is a pure function of its
snapshot and the old world's plan, and a table written with every snapshot would either repeat the
snapshot's locations or list the reader's whole remaining plan (every shard of a source, for a lone
reader) every ``state_every`` batches.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import numpy as np

from mixer.errors import StateError
from mixer.state.columns import expect_keys as expect_keys  # re-exported: every stateful part checks its keys with it
from mixer.state.columns import pack, pack_items, pack_parts, unpack, unpack_parts


class Topology(Protocol):
    """What a loader state is checked against: the mixture's fingerprint and the rank it reads for."""

    fingerprint: str
    rank: int
    world_size: int


class CarriesState(Protocol):
    """A batch's metadata as the loader's bookkeeping reads it (:class:`mixer.BatchMeta`)."""

    snapshot: dict[str, Any] | None
    skips: Sequence[Sequence[int]]


# 6: a stream's inherited slices (elastic resume); 5: columnar reader snapshots; 4: "adaptive"
# (feedback-driven mixing); 3: one checkpoint module
STATE_VERSION = 6
KIND = "mixer.Loader"
_HISTORY = {
    1: "mixer before the PCG64 shuffle buffers (random.Random state)",
    2: "mixer before the checkpoint module (readers {'state', 'since', 'skips'})",
    3: "mixer before adaptive mixing (no 'adaptive' key)",
    4: "mixer before the columnar reader state (one JSON object per source)",
    5: "mixer before elastic resume (no inherited slices in a stream's state)",
}

Location = tuple[int, ...]  # (shard, offset), or (source, shard, offset) in a shared batcher
LOADER_KEYS = (
    "kind",
    "version",
    "fingerprint",
    "rank",
    "world_size",
    "num_workers",
    "delivered",
    "readers",
    "adaptive",
)
READER_KEYS = ("snapshot", "replay", "skips")
SNAPSHOT_KEYS = ("batches", "tokens", "active", "counters", "selector", "streams", "batchers")


class Stateful(Protocol):
    """A part with checkpointed state: ``state_dict()`` is small and JSON-able; ``load_state_dict``
    restores this part only, and raises :class:`~mixer.StateError` naming the part and the key for
    a state with unknown or missing keys."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Columnar(Stateful, Protocol):
    """A part kept once per source: its state is plain ints and lists of ints, ``STATE_DEPTHS``
    deep per field, so that a reader stores the parts of all sources as columns."""

    STATE_DEPTHS: ClassVar[dict[str, int]]


class Rereads(Stateful, Protocol):
    """A stateful part that holds samples: its state lists them by location. After
    ``load_state_dict``, ``locations()`` are the samples to read again and ``attach(lookup)`` puts
    them back (``lookup(location)`` is the item); the part is usable again only then."""

    def locations(self) -> Iterable[Location]: ...

    def attach(self, lookup: Callable[[Location], Any]) -> None: ...


# ---- the fingerprint --------------------------------------------------------------------------


#: Modules of mixer's own callables as fingerprints and index files name them: the paths they had
#: before the package was split into layers, so that states and index files written then stay valid.
PERSISTED_MODULES = {
    "mixer.read.audio": "mixer.audio",
    "mixer.read.decode": "mixer.decode",
    "mixer.read.sample": "mixer.sample",
}


def qualname(fn: Any) -> str | None:
    """How a callable appears in a fingerprint or an index file (its module and qualified name)."""
    if fn is None:
        return None
    module = getattr(fn, "__module__", "?")
    return f"{PERSISTED_MODULES.get(module, module)}.{getattr(fn, '__qualname__', repr(fn))}"


# ---- the loader state -------------------------------------------------------------------------


def check(state: Any, mixture: Topology, *, num_workers: int) -> dict[str, Any]:
    """Validate a loader state against this mixture and topology; returns it."""
    check_saved(state, mixture)
    readers = max(num_workers, 1)
    saved = (state["rank"], state["world_size"], state["num_workers"])
    if saved != (mixture.rank, mixture.world_size, readers):
        raise StateError(
            f"loader state was saved with rank {saved[0]} of {saved[1]} and {saved[2]} reader(s) per rank; this "
            f"loader is rank {mixture.rank} of {mixture.world_size} with {readers}: one rank's state resumes the same "
            "num_workers or world_size only (another shape would repeat or lose samples of the current "
            "source-epochs); for an elastic resume pass the list of the states of all the saved ranks (see "
            "mixer.mixing.elastic)"
        )
    if not isinstance(state["readers"], list) or len(state["readers"]) != readers:
        raise StateError(f"loader state: 'readers' must list {readers} reader state(s)")
    for i, r in enumerate(state["readers"]):
        expect_keys(f"loader reader {i}", r, READER_KEYS)
    return state


def check_saved(state: Any, mixture: Topology) -> dict[str, Any]:
    """Validate a loader state's kind, version, keys and fingerprint (not its topology); returns it."""
    if not isinstance(state, dict) or state.get("kind") != KIND:
        got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise StateError(
            f"not a mixer loader state: got {got}; expected a dict with kind={KIND!r} (Loader.state_dict())"
        )
    version = state.get("version")
    if version != STATE_VERSION:
        what = (
            _HISTORY.get(version, "not a version this mixer knows") if isinstance(version, int) else "no valid version"
        )
        raise StateError(
            f"loader state version {version!r} ({what}) cannot be loaded: this mixer reads state version "
            f"{STATE_VERSION} only; resume with the mixer that saved it, or start the data stream afresh"
        )
    expect_keys("loader", state, LOADER_KEYS)
    if state["fingerprint"] != mixture.fingerprint:
        raise StateError(
            "loader state was saved from a different mixture (sources, shards, weights, seed, batching, schedule or "
            "other options differ); resume with the same configuration"
        )
    return state


def size_bytes(state: dict[str, Any]) -> int:
    """The state's size as compact JSON."""
    return len(json.dumps(state, separators=(",", ":")))


class ReaderLog(NamedTuple):
    """What the loader keeps per reader, from the metadata of the batches it hands out: the reader's
    state as of its last batch handed out (see the module docstring). Immutable: each batch makes a
    new one (:meth:`after`), so a :class:`Position` can keep the logs of one moment by reference (a
    named tuple: built once per batch, it costs a fraction of a frozen dataclass)."""

    snapshot: dict[str, Any] | None = None
    replay: int = 0
    skips: tuple[tuple[int, ...], ...] = ()

    def after(self, meta: CarriesState) -> ReaderLog:
        """This reader's log once the batch described by ``meta`` is handed out."""
        if meta.snapshot is not None:
            # Taken after this batch: its skips are inside it.
            return ReaderLog(meta.snapshot)
        skips = self.skips + tuple(tuple(s) for s in meta.skips) if meta.skips else self.skips
        return ReaderLog(self.snapshot, self.replay + 1, skips)

    def state_dict(self) -> dict[str, Any]:
        return reader_state(self.snapshot, replay=self.replay, skips=self.skips)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ReaderLog:
        expect_keys("loader reader", state, READER_KEYS)
        return cls(state["snapshot"], int(state["replay"]), tuple(tuple(s) for s in state["skips"]))


class Position(NamedTuple):
    """A loader's position as of one batch it handed out: ``delivered`` batches handed out, this one
    included, and every reader's :class:`ReaderLog` at that moment. The loader attaches one to every
    batch it hands out (``batch.meta.position``), so a training loop that fetches batches ahead of
    the step (Lightning, a prefetching wrapper) can still save the state as of the last batch it
    *trained* (``Loader.state_dict(upto=batch)``). It holds references to the logs, never copies:
    a tuple per batch. ``fingerprint`` names the mixture, so a position is only ever turned into a
    state of a loader of that mixture."""

    fingerprint: str
    delivered: int
    readers: tuple[ReaderLog, ...]


def handed_out(reader: Mapping[str, Any]) -> int:
    """How many batches a saved reader had handed out: its snapshot's count plus the batches after it."""
    snapshot = reader["snapshot"]
    return (0 if snapshot is None else int(snapshot["batches"])) + int(reader["replay"])


@dataclass(frozen=True)
class Resume:
    """Where the readers of a loader continue, from its state: ``delivered`` batches handed out and
    one reader state each."""

    delivered: int
    readers: Sequence[dict[str, Any]]

    @property
    def turn(self) -> int:
        """The saved reader whose turn comes next in the loader's round robin.

        The loader takes one batch of each reader in turn, a reader that ended left out for good
        (:func:`mixer.runtime.transport.ungrouped`), so round ``j`` of the uninterrupted run holds, in reader
        order, the readers that handed out more than ``j`` batches. The last batch handed out is then
        the one of the highest reader that handed out the most, and the turn is the reader after it.
        While every reader still runs this is ``delivered % n``; once one has ended it is not (the
        rotation skips the ended reader), which is why it is read from the readers' own counts. The
        same rule holds after an elastic resume, whose new readers' counts continue its global step."""
        counts = [handed_out(r) for r in self.readers]
        most = max(counts)
        last = max(i for i, c in enumerate(counts) if c == most)
        return (last + 1) % len(counts)

    def reader_for(self, worker: int) -> int:
        """The saved reader that DataLoader worker ``worker`` continues. The loader starts its round
        robin with worker 0, so worker ``w`` continues reader ``(w + turn) % n``: the order of
        batches is then exactly that of the uninterrupted run, in the tail of a finite pass too."""
        return (worker + self.turn) % len(self.readers)


# ---- reader snapshots -------------------------------------------------------------------------


def snapshot(
    *,
    batches: int,
    tokens: int,
    active: str,
    counters: str,
    selector: dict[str, Any],
    streams: dict[str, str],
    batchers: dict[str, str],
) -> dict[str, Any]:
    """The one builder of a reader snapshot (:data:`SNAPSHOT_KEYS`), from its parts already packed as
    columns: a reader's own snapshot (:func:`pack_snapshot`) and an elastic resume's new readers
    (:mod:`mixer.mixing.elastic`) both come through here."""
    return {
        "batches": int(batches),
        "tokens": int(tokens),
        "active": active,
        "counters": counters,
        "selector": selector,
        "streams": streams,
        "batchers": batchers,
    }


def pack_snapshot(
    *,
    batches: int,
    tokens: int,
    active: Any,
    counters: Sequence[Sequence[int]],
    selector: Stateful,
    streams: Sequence[Columnar],
    batchers: Sequence[Columnar],
) -> dict[str, Any]:
    """A reader snapshot (see the module docstring) of these parts: per-source parts as columns."""
    return snapshot(
        batches=batches,
        tokens=tokens,
        active=pack(active, 0),
        counters=pack(counters, 1),
        selector=selector.state_dict(),
        streams=pack_parts([st.state_dict() for st in streams], streams[0].STATE_DEPTHS),
        batchers=pack_located(batchers),
    )


def reader_state(
    snapshot: dict[str, Any] | None, *, replay: int = 0, skips: Iterable[Sequence[int]] = ()
) -> dict[str, Any]:
    """The one builder of a loader's per-reader state (:data:`READER_KEYS`)."""
    return {"snapshot": snapshot, "replay": int(replay), "skips": [list(s) for s in skips]}


def loader_state(
    *,
    fingerprint: str,
    rank: int,
    world_size: int,
    num_workers: int,
    delivered: int,
    readers: Sequence[dict[str, Any]],
    adaptive: dict[str, Any] | None,
) -> dict[str, Any]:
    """The one builder of a loader state (:data:`LOADER_KEYS`, this version): ``Loader.state_dict()``
    and an elastic resume's re-split both come through here."""
    return {
        "kind": KIND,
        "version": STATE_VERSION,
        "fingerprint": fingerprint,
        "rank": int(rank),
        "world_size": int(world_size),
        "num_workers": int(num_workers),
        "delivered": int(delivered),
        "readers": list(readers),
        "adaptive": adaptive,
    }


# ---- every rank's state in one checkpoint ------------------------------------------------------

#: A gathered state: the loader states of all the data-parallel ranks, collected on one of them, for
#: frameworks that write one checkpoint from one process (Lightning, Accelerate; see
#: :mod:`mixer.integrations.ranks`). Its own small format, versioned apart from the loader state it holds.
GATHERED_KIND = "mixer.AllRanks"
GATHERED_VERSION = 1
GATHERED_KEYS = ("kind", "version", "rank", "states", "trained")


def gathered_state(*, rank: int, states: Sequence[dict[str, Any] | None] | None, trained: int | None) -> dict[str, Any]:
    """The one builder of a gathered state (:data:`GATHERED_KEYS`). ``states``: on the rank that
    gathered them, one entry per data-parallel rank in rank order, each a loader state or None where
    that rank starts a new pass; None on every other rank. ``rank``: the rank that built it.
    ``trained``: how many batches the framework's training loop had taken, when it counts them (None
    otherwise)."""
    return {
        "kind": GATHERED_KIND,
        "version": GATHERED_VERSION,
        "rank": int(rank),
        "states": None if states is None else list(states),
        "trained": None if trained is None else int(trained),
    }


def gathered_states(state: Any) -> list[dict[str, Any]] | None:
    """The loader states of every rank that a gathered state holds, or None when every rank starts a
    new pass. A :class:`~mixer.StateError` for another kind or version, unknown or missing keys, a state
    built on a rank that did not gather the states, or ranks of which some start a new pass and some
    do not."""
    if not isinstance(state, dict) or state.get("kind") != GATHERED_KIND:
        got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise StateError(f"not a gathered mixer state: got {got}; expected a dict with kind={GATHERED_KIND!r}")
    if state.get("version") != GATHERED_VERSION:
        raise StateError(
            f"gathered state version {state.get('version')!r} cannot be loaded: this mixer reads version "
            f"{GATHERED_VERSION} only"
        )
    expect_keys("gathered state", state, GATHERED_KEYS)
    states = state["states"]
    if states is None:
        raise StateError(
            f"gathered state: this one was built on rank {state['rank']}, which holds none of the ranks' loader "
            "states (they were gathered on rank 0, whose checkpoint holds them): load the checkpoint rank 0 wrote"
        )
    if not isinstance(states, list) or not states:
        raise StateError(f"gathered state: 'states' must list one entry per rank (got {states!r})")
    fresh = [s is None for s in states]
    if all(fresh):
        return None
    if any(fresh):
        raise StateError(
            f"gathered state: ranks {[r for r, f in enumerate(fresh) if f]} start a new pass and the others do not; "
            "the ranks were not in step when it was saved"
        )
    return list(states)


@dataclass(frozen=True)
class Unpacked:
    """A reader snapshot's columns, back as one state per part."""

    active: list[int]
    counters: list[list[int]]
    streams: list[dict[str, Any]]
    batchers: list[dict[str, Any]]


def unpack_snapshot(snapshot: Any, *, streams: Sequence[Columnar], batchers: Sequence[Columnar]) -> Unpacked:
    """The per-part states of a reader snapshot for these parts (a StateError naming the part,
    the key and the rule when it does not fit them)."""
    snapshot = expect_keys("reader snapshot", snapshot, SNAPSHOT_KEYS)
    n = len(streams)
    return Unpacked(
        active=unpack(snapshot["active"], 0, n, "reader snapshot state: 'active'"),
        counters=unpack(snapshot["counters"], 1, n, "reader snapshot state: 'counters'"),
        streams=unpack_parts(snapshot["streams"], streams[0].STATE_DEPTHS, n, "streams"),
        batchers=unpack_parts(snapshot["batchers"], batchers[0].STATE_DEPTHS, len(batchers), "batchers"),
    )


def readable(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A reader snapshot with its columns expanded: ``streams`` and ``batchers`` as one dict per
    part, ``active`` and ``counters`` as lists (for inspection and tests; not loadable)."""

    def parts(columns: dict[str, Any], where: str) -> list[dict[str, Any]]:
        cols = {k: unpack(v, None, None, f"{where} state: {k!r}") for k, v in columns.items()}
        n = len(next(iter(cols.values()))) if cols else 0
        return [{k: cols[k][i] for k in cols} for i in range(n)]

    return dict(
        snapshot,
        active=unpack(snapshot["active"], 0, None, "reader snapshot state: 'active'"),
        counters=unpack(snapshot["counters"], 1, None, "reader snapshot state: 'counters'"),
        streams=parts(snapshot["streams"], "streams"),
        batchers=parts(snapshot["batchers"], "batchers"),
    )


def buffered(snapshot: dict[str, Any]) -> tuple[int, int]:
    """Samples a reader snapshot holds in shuffle buffers, and in its batchers (bucket items and
    ready batches; a packer's pieces)."""
    r = readable(snapshot)
    shuffle = sum(len(s["buffer"]) for s in r["streams"])
    batched = sum(len(b.get("items", ())) + sum(map(len, (*b["ready"], *b.get("buffers", ())))) for b in r["batchers"])
    return shuffle, batched


def with_skips(streams: list[dict[str, Any]], skips: Iterable[Sequence[int]]) -> list[dict[str, Any]]:
    """Stream states that also hold the skip decisions ``[source, epoch, slice, ...]`` taken after
    the snapshot (later decisions win, as when they were taken)."""
    skips = list(skips)
    if not skips:
        return streams
    streams = [dict(s, skips=list(s["skips"])) for s in streams]
    for source, *decision in skips:
        if not 0 <= int(source) < len(streams):
            raise StateError(f"loader reader state: a skip names source {source}, the snapshot has {len(streams)}")
        streams[int(source)]["skips"].append(decision)
    return streams


def group_locations(
    per_source: Sequence[Iterable[Location]], shared: Iterable[Location] = ()
) -> list[list[tuple[int, int]]]:
    """The (shard, offset) locations to read again per source, sorted: ``per_source[i]`` holds
    source ``i``'s, ``shared`` holds ``(source, shard, offset)``."""
    wanted: list[set[tuple[int, int]]] = [set() for _ in per_source]
    for i, locs in enumerate(per_source):
        wanted[i].update((int(a), int(b)) for a, b in locs)
    for source, shard, offset in shared:
        wanted[int(source)].add((int(shard), int(offset)))
    return [sorted(w) for w in wanted]


def pair_lookup(found: Sequence[Mapping[Location, Any]]) -> Callable[[Location], tuple[int, Any]]:
    """``(source, shard, offset)`` → ``(source, sample)`` over the re-read samples of every source."""
    return lambda loc: (loc[0], found[loc[0]][(loc[1], loc[2])])


# Snapshots list every buffered sample (often 10k+): a C-level getter, no Python frame per sample.
locate_sample: Callable[[Any], Location] = operator.attrgetter("shard", "offset")


def locate_pair(item: tuple[int, Any]) -> Location:
    """Where a ``(source, sample)`` item of a shared batcher lives: ``(source, shard, offset)``."""
    return (item[0], item[1].shard, item[1].offset)


_shard, _offset, _first, _second = (
    operator.attrgetter("shard"),
    operator.attrgetter("offset"),
    operator.itemgetter(0),
    operator.itemgetter(1),
)


def _columns(items: Sequence[Any], *coords: Callable[[Iterable[Any]], Iterable[int]]) -> list[np.ndarray]:
    return [np.fromiter(coord(items), dtype=np.int64, count=len(items)) for coord in coords]


# The locations of many items at once, one array per coordinate, with C-level maps: the same ints
# as ``map(locate, items)`` without a tuple per item.
LOCATION_COLUMNS: dict[Callable[[Any], Location], Callable[[Sequence[Any]], list[np.ndarray]]] = {
    locate_sample: lambda items: _columns(items, lambda it: map(_shard, it), lambda it: map(_offset, it)),
    locate_pair: lambda items: _columns(
        items,
        lambda it: map(_first, it),
        lambda it: map(_shard, map(_second, it)),
        lambda it: map(_offset, map(_second, it)),
    ),
}


class Unlocated(Columnar, Protocol):
    """A part that lists its items by ``locate(item)`` in the fields ``LOCATED`` of its state, and
    can give that state with the items themselves in place of their locations (``unlocated_state``)."""

    LOCATED: ClassVar[tuple[str, ...]]
    locate: Callable[[Any], Location]

    def unlocated_state(self) -> dict[str, Any]: ...


def pack_located(parts: Sequence[Columnar]) -> dict[str, str]:
    """``pack_parts([p.state_dict() for p in parts], ...)``, the same columns, with the fields that
    list items by location built from the items a column at a time (:func:`mixer.state.columns.pack_items`)
    when the parts can give them (:class:`Unlocated`) and their ``locate`` has columns."""
    first = parts[0]
    depths = first.STATE_DEPTHS
    locate = getattr(first, "locate", None)
    columns = LOCATION_COLUMNS.get(locate) if locate is not None and hasattr(first, "unlocated_state") else None
    if columns is None or any(getattr(p, "locate", None) is not locate for p in parts):
        return pack_parts([p.state_dict() for p in parts], depths)
    states = [p.unlocated_state() for p in cast("Sequence[Unlocated]", parts)]
    located = cast("Unlocated", first).LOCATED
    packed = {}
    for k, d in depths.items():
        values = [s[k] for s in states]
        packed[k] = pack_items(values, d, columns) if k in located else pack(values, d)
    return packed
