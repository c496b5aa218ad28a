"""``Mixture``: the IterableDataset that wires sources, schedule, selector, buckets and collate.

One iteration runs one *reader* (a DataLoader worker of one rank, or the main process). Readers never
talk to each other: each knows its place (:class:`mixer.plan.world.World`) and derives its shards, its
random numbers and its share of the global step from it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from mixer.batching.batch import Batch, BatchMeta
from mixer.batching.batchers import Batcher, Bucketer, closing_sources, epoch_wait, make_batcher
from mixer.batching.collate import Layout, count_delivered, make_layout
from mixer.errors import ConfigError
from mixer.mixing.fingerprint import fingerprint
from mixer.mixing.holding import UNCAPPED, allot
from mixer.mixing.loops import Cut, mix_batches, mix_samples
from mixer.mixing.options import (
    DEFAULT_BUFFER_BUDGET,
    STREAM_OPTIONS,
    BufferBudget,
    MixMode,
    Stop,
    Unit,
    check_options,
    parse_buffer_budget,
)
from mixer.mixing.schedule import Schedule, SourceInfo, Static, check_schedule
from mixer.mixing.selector import Deficit, make_selector
from mixer.plan.edges import bucket_edges
from mixer.plan.profiling import Profile
from mixer.plan.shards import warn_shared_shards
from mixer.plan.startup import start_up
from mixer.plan.world import World, resolve_rank, worker_place
from mixer.read.counters import Counters
from mixer.read.text import TextDecode
from mixer.spec.budget import Field, Packed, TokenBudget
from mixer.spec.source import ListedSource, Source
from mixer.state.checkpoint import (
    READER_KEYS,
    Rereads,
    Resume,
    expect_keys,
    group_locations,
    locate_pair,
    pack_snapshot,
    pair_lookup,
    reader_state,
    unpack_snapshot,
    with_skips,
)
from mixer.storage import IOOptions, OpenShards
from mixer.stream.reread import reread
from mixer.stream.text_stream import make_stream

log = logging.getLogger(__name__)


class SlotWriter(Protocol):
    """One batch's place in shared memory: ``out(n)`` gives the collate its buffer (None: make its own),
    ``seal()`` says where the batch lives (``Batch.slot``), or None."""

    def out(self, n: int) -> np.ndarray | None: ...

    def seal(self) -> tuple[Any, ...] | None: ...


class Slots(Protocol):
    """Where a reader's batches are written: shared slots the runtime maps before its workers fork
    (:class:`mixer.runtime.transport.SlotPool`); the mixing layer knows only this."""

    def writer(self, worker: int) -> SlotWriter: ...


class Shares(Protocol):
    """Target shares set from outside the schedule (:class:`mixer.runtime.feedback.SharesTable`):
    those in effect at a global step, or None while the schedule's own apply."""

    def shares_at(self, step: int, *, wait: bool) -> np.ndarray | None: ...


class Mixture(IterableDataset[Batch]):
    """Several sources mixed by target share into length-bucketed, token-budget batches.

    Level 1 (``selector``) picks the source of the next batch (``mix="batch"``: every batch comes
    from one source) or of the next sample (``mix="sample"``: buckets shared across sources) so that
    the realized share of ``unit`` (real tokens by default) tracks ``schedule``'s target. Level 2
    (``batching``) groups a source's samples by length so that padding stays small
    (:class:`~mixer.TokenBudget`), or packs them back to back (:class:`~mixer.Packed`: batches are
    :class:`~mixer.PackedBatch`). ``fields``: samples whose ``decode`` returns named arrays are
    collated per field (batches are :class:`~mixer.FieldBatch`; see :mod:`mixer.batching.collate`).

    ``stop``: ``"never"`` restarts an exhausted source with a reshuffled epoch; ``"first_exhausted"``
    ends when any source has delivered its whole pass; ``"all_exhausted"`` drops exhausted sources
    and renormalises the rest, so one pass delivers every sample of every source exactly once.

    Building it lists every source's shards and looks at the sources that need it (their size when
    ``Source.size`` is not given, their lengths when the bucket edges are derived; see
    :mod:`mixer.plan.profiling`), in parallel, with bounded reads. ``profile_cache``: a directory where
    those looks are kept, keyed by each source's shard listing, so that a restarted job reads no
    shard to start, and the listings of remote prefixes, so that it lists none (default None: no
    cache; see :mod:`mixer.plan.profile_cache` for what the keys cover). ``profile_share``: under
    ``torch.distributed``, rank 0 of ``dp_group`` (else of the default group) lists, verifies the
    shard indexes, looks and broadcasts the result, so the other ranks ask the storage nothing
    (:mod:`mixer.plan.startup`; None: when a group of several ranks is initialized; every rank of it
    must then build the mixture; False: every rank does it all itself).

    ``buffer_budget``: what a reader holds in shuffle buffers and buckets together, over all
    sources: ``"<n> tokens"`` (default ``"8000000 tokens"``, 32 MB of int32 tokens, not reached by a
    few sources of short samples; ``k``/``M``/``G`` suffixes) so that its memory does not grow with
    sample length, ``"<n> samples"`` (the count it was before it had a unit; a bare integer still
    means that, with a ``FutureWarning``), or None for none; apportioned by share
    (:meth:`Reader._hold_ahead`, :func:`mixer.mixing.holding.allot`). A node holds about
    ``ranks x workers x budget`` in its readers' buffers. With hundreds of sources prefer
    ``mix="sample"`` (shared buckets): in ``mix="batch"`` a source allotted less than a batch
    makes small batches.

    Each ``iter()`` starts the stream from the beginning: same seed, same batches. For exact resume
    use the loader's ``state_dict()`` / ``load_state_dict()``: every ``state_every`` batches a
    reader attaches its full state (where it reads, and the shard and byte offset of every buffered
    sample) to a batch; a resumed reader seeks back there and re-runs at most ``state_every - 1``
    batches in-process, so resuming costs the same at any point of an epoch.
    """

    # The options that decide the stream, checked and set from the table (mixer.mixing.options).
    selector: str
    unit: Unit
    mix: MixMode
    stop: Stop
    seed: int
    shuffle_buffer: int
    pad_id: int
    dtype: str
    state_every: int
    buffer_budget: int | None

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        batching: TokenBudget | Packed,
        schedule: Schedule | None = None,
        selector: str = "deficit",
        unit: Unit = "tokens",
        mix: MixMode = "batch",
        stop: Stop = "never",
        seed: int = 0,
        shuffle_buffer: int = 1000,
        pad_id: int = 0,
        dtype: str = "int32",
        rank: int | None = None,
        world_size: int | None = None,
        dp_group: Any = None,
        state_every: int = 64,
        buffer_budget: int | str | None = DEFAULT_BUFFER_BUDGET,
        fields: Mapping[str, Field] | None = None,
        profile_cache: str | os.PathLike[str] | None = None,
        profile_share: bool | None = None,
    ) -> None:
        given = locals()  # the keywords as passed: the options among them are checked by the table
        super().__init__()
        sources = list(sources)
        if not sources:
            raise ConfigError("sources: need at least one Source (got an empty list)")
        for i, s in enumerate(sources):
            if not isinstance(s, Source):
                raise ConfigError(f"sources[{i}]: expected a mixer.Source (got {type(s).__name__})")
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"sources: duplicate source names {dupes}; every source needs its own name")
        if not isinstance(batching, (TokenBudget, Packed)):
            raise ConfigError(f"batching: expected a mixer.TokenBudget or mixer.Packed (got {type(batching).__name__})")
        options = check_options(given)
        for name in STREAM_OPTIONS:
            setattr(self, name, options[name])
        # self.buffer_budget is canonical ("<n> tokens" or "<n> samples"); self.budget the parsed one
        self.budget: BufferBudget | None = parse_buffer_budget(self.buffer_budget, "Mixture.buffer_budget")
        if self.budget is not None and self.budget.amount < 2 * len(sources):
            raise ConfigError(
                f"Mixture.buffer_budget: must give each of the {len(sources)} sources at least 2 {self.budget.unit} "
                "(shuffle and buckets), "
                f"so >= {2 * len(sources)}, got {self.budget.amount}; or None for no budget"
            )
        self.sources = sources
        self.batching = batching
        self.schedule: Schedule = schedule if schedule is not None else Static()
        self.rank, self.world_size = resolve_rank(rank, world_size, dp_group)
        # How a batch is accounted, collated and sized: padded, packed or multi-field (mixer.batching.collate).
        self.layout: Layout = make_layout(batching, fields, dtype=self.dtype, pad_id=self.pad_id, names=names)
        for s in sources:
            if isinstance(s.length, str) and (fields is None or s.length not in fields):
                raise ConfigError(
                    f"source {s.name!r}: length={s.length!r} names a field, "
                    f"but the mixture's fields= {sorted(fields or ())} lack it"
                )
            if isinstance(s.decode, TextDecode) and (s.length is not None or fields is not None):
                raise ConfigError(
                    f"source {s.name!r}: a TextDecode source's samples are chunks of tokens, counted by their length: "
                    "length= and the mixture's fields= do not apply to it"
                )

        # Judges every sample it reads as the readers do: too long for the budget is a SampleError
        # naming shard and key, raised or skipped by the source's on_error, as mid-stream.
        cache, share = options["profile_cache"], options["profile_share"]
        # The only listing of shards, the look and the bucket edges: once per job (mixer.plan.startup).
        self.listed: list[ListedSource]
        self.profiles: list[Profile]
        self.edges: list[list[int]]
        self.listed, self.profiles, self.edges = start_up(
            sources, batching, cache=cache, share=share, group=dp_group, derive=self._bucket_edges
        )
        self.info = SourceInfo(
            names=tuple(names),
            weights=np.array([s.weight for s in sources], dtype=np.float64),
            sizes=np.array([p.size for p in self.profiles], dtype=np.float64),
            groups=tuple(s.group for s in sources),
        )
        # Check the whole schedule now (every phase of a curriculum, all-zero weights...), so that
        # it fails here and not in a worker process hours into the run.
        check_schedule(self.schedule, self.info)
        self.fingerprint = fingerprint(self, fields)  # once: checked on every load_state_dict

    def _bucket_edges(self, profiles: Sequence[Profile]) -> list[list[int]]:
        """Each source's bucket edges (a pure function of the profiles and the batching: computed by
        the rank that looks, and shared)."""
        batching = self.batching
        if isinstance(batching, Packed):
            return [[] for _ in profiles]  # no buckets: the Packer places documents
        if batching.buckets is not None:
            return [list(batching.buckets)] * len(profiles)
        if self.mix == "sample":
            shared = bucket_edges(np.concatenate([p.lengths for p in profiles]), **self._edge_options())
            return [shared] * len(profiles)
        return [bucket_edges(p.lengths, **self._edge_options()) for p in profiles]

    def _edge_options(self) -> dict[str, Any]:
        b = self.batching
        assert isinstance(b, TokenBudget)
        return {"longest": b.longest, "num_buckets": b.num_buckets, "max_ratio": b.max_bucket_ratio}

    @property
    def names(self) -> tuple[str, ...]:
        return self.info.names

    @property
    def sizes(self) -> dict[str, float]:
        """Source sizes in tokens, as used by the schedule (given or estimated up front)."""
        return dict(zip(self.info.names, self.info.sizes.tolist()))

    def target_at(self, step: int, tokens: float) -> np.ndarray:
        """The schedule's target share per source at a global step."""
        p = np.asarray(self.schedule.probs(self.info, step, tokens), dtype=np.float64)
        if p.shape != (len(self.sources),) or not np.all(np.isfinite(p)) or np.any(p < 0) or not p.sum() > 0:
            raise ConfigError(
                f"schedule {self.schedule!r} returned an invalid probability vector {p.tolist()} at step {step}"
            )
        return p / p.sum()

    @property
    def max_batch_elements(self) -> int:
        """The largest flat buffer a batch can need (see :meth:`mixer.batching.collate.Layout.max_elements`)."""
        return self.layout.max_elements(self.edges)

    def reader(self, world: World, *, pool: Slots | None = None, table: Shares | None = None) -> Reader:
        return Reader(self, world, pool=pool, table=table)

    def batches(
        self, *, pool: Slots | None = None, resume: Resume | None = None, table: Shares | None = None
    ) -> Iterator[Batch]:
        """This process's batches: as a DataLoader worker, or the main process when there are none.
        ``pool``: shared slots the loader mapped before forking its workers (see mixer.runtime.transport).
        ``resume``: where the loader's readers continue; this worker continues the saved reader
        :meth:`~mixer.state.checkpoint.Resume.reader_for` names. ``table``: the adaptive shares the loader
        publishes (see :mod:`mixer.runtime.feedback`), consulted before the schedule."""
        worker, num_workers = worker_place()
        if resume is not None:
            worker = resume.reader_for(worker)
        world = World(rank=self.rank, world_size=self.world_size, worker=worker, num_workers=num_workers)
        in_worker = get_worker_info() is not None
        state = resume.readers[worker] if resume is not None else None
        return iter(self.open_reader(world, pool=pool if in_worker else None, table=table, state=state))

    def open_reader(
        self,
        world: World,
        *,
        pool: Slots | None = None,
        table: Shares | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> Reader:
        """The reader at ``world``, continuing from its saved ``state`` (a loader state's entry for
        it) when given: what a DataLoader worker runs, and a reader anywhere else (:mod:`mixer.service`)."""
        if world.reader == 0:
            warn_shared_shards(self.listed, world, log)
        reader = self.reader(world, pool=pool, table=table)
        if state is not None:
            reader.load_state_dict(dict(state))
        return reader

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()


class Reader:
    """The stream of one reader. Global step of its ``k``-th batch: ``k * num_workers + worker``
    (DataLoader takes batches from its workers round-robin, in order), so every reader of every rank
    asks the schedule about the same global step at the same point in training. Tokens seen are
    estimated as this reader's tokens times the number of readers (readers deliver alike on average).

    A reader runs one of :mod:`mixer.mixing.loops`'s loops over its streams and batchers and keeps the
    bookkeeping around it: the target shares and hold sizes as progress moves, the counters, each
    batch's :class:`~mixer.BatchMeta` and, every ``state_every`` batches, a snapshot of its state."""

    def __init__(
        self, mixture: Mixture, world: World, *, pool: Slots | None = None, table: Shares | None = None
    ) -> None:
        self.mixture = mixture
        self.world = world
        self.pool = pool
        self.table = table
        self._in_worker = get_worker_info() is not None
        n = len(mixture.sources)
        finite = mixture.stop != "never"
        self.counters = [Counters() for _ in range(n)]
        budget = mixture.batching
        # One cap on open shards for all of this reader's streams (the smallest its sources ask for).
        self.open_shards = OpenShards(min(IOOptions.of(s.io_options).max_open_shards for s in mixture.sources))
        self.streams = [
            make_stream(
                s,
                world,
                seed=mixture.seed,
                budget=budget,
                shuffle_buffer=mixture.shuffle_buffer,
                finite=finite,
                counters=self.counters[i],
                open_shards=self.open_shards,
            )
            for i, s in enumerate(mixture.listed)
        ]
        # Items are Samples (mix="batch": one level 2 per source) or (source, Sample) pairs
        # (mix="sample": one shared level 2, repeated per source); use sites name the item type.
        self.batchers: list[Batcher[Any]]
        if mixture.mix == "sample":
            # How often each source turns its epoch, in the shared batches (at the shares of step 0):
            # the shared bucketer closes the epochs of the rarest ones only (closing_sources).
            shares = mixture.target_at(0, 0.0)
            rates = [s * world.readers * budget.max_tokens / max(p.size, 1.0) for p, s in zip(mixture.profiles, shares)]
            self._closes = closing_sources(rates, len(mixture.edges[0]) or 1)
            # Under stop="never", each source it closes whose epoch (in shared batches) is short has
            # the wait bound of a small source (epoch_wait) for the buckets holding its samples, so
            # that what it delivers in part of its epoch is not mostly its long samples while its
            # short ones wait in buckets the other sources fill slowly (a finite pass keeps the
            # bound of large sources).
            buckets = len(mixture.edges[0])
            waits = [
                epoch_wait(buckets, 1.0 / r) if c and r > 0 and not finite else None
                for r, c in zip(rates, self._closes)
            ]
            shared = make_batcher(mixture.edges[0], budget, locate=locate_pair)
            if isinstance(shared, Bucketer):  # (Packed packs: no buckets to bound)
                shared.bound_sources({i: w for i, w in enumerate(waits) if w is not None})
            self.batchers = [shared] * n
        else:
            # Under stop="never", a source's epoch (this reader's part) in full batches: a small
            # source's wait bound (epoch_wait; a finite pass keeps the bound of large sources).
            epochs = [p.size / world.readers / budget.max_tokens if not finite else None for p in mixture.profiles]
            self.batchers = [make_batcher(e, budget, epoch_batches=n) for e, n in zip(mixture.edges, epochs)]
        self.selector = make_selector(mixture.selector, n, seed=mixture.seed, stream=(world.rank, world.worker))
        if mixture.mix == "batch" and isinstance(self.selector, Deficit):
            # The deficit selector visits sources in a near-cyclic order, on which closing the least
            # recently read shard closes the one needed soonest: close the one it will pick last.
            self._index_of = {id(st): i for i, st in enumerate(self.streams)}
            self.open_shards.pick = self._picked_last
        self.active = np.ones(n, dtype=bool)
        self.batches = 0
        self.tokens = 0
        self._probs_key, self._retired = (-1, -1), 0  # (batches, sources retired) of _probs_cache
        self._probs_cache = np.zeros(n)
        self._allotted_for = b""  # the shares _hold_ahead last sized buffers for
        self._target_key, self._target_memo = (-1, -1), self._probs_cache  # (step, tokens) -> the schedule's shares
        self._holds = [0] * n
        # What each batcher may hold, in items and in padded tokens (all the same, the shared one's, in mix="sample").
        self._caps = [UNCAPPED] * n
        self._token_caps = [UNCAPPED] * n
        self._replay: int | None = None  # batches to re-run after a restore (None: not restored)
        self._resumed_counters: list[list[int]] | None = None

    def _picked_last(self, streams: list[Any]) -> Any:
        ahead = self.selector.ahead(self._probs_cache)  # type: ignore[attr-defined]
        return max(streams, key=lambda st: ahead[self._index_of[id(st)]])

    @property
    def step(self) -> int:
        return self.batches * self.world.num_workers + self.world.worker

    def _probs(self) -> np.ndarray:
        # Progress moves once per batch: with mix="sample" the schedule is asked once per batch.
        key = (self.batches, self._retired)
        if key != self._probs_key:
            self._probs_key = key
            self._probs_cache = self._target()
            self._hold_ahead(self._probs_cache)
        return self._probs_cache

    def _hold_ahead(self, probs: np.ndarray) -> None:
        """What each source may hold ahead now (:func:`mixer.mixing.holding.allot`): its shuffle buffer's
        limits, its buckets' hold in padded tokens, its batcher's caps."""
        if (key := probs.tobytes()) == self._allotted_for:  # (a pure function of the shares)
            return
        self._allotted_for = key
        m = self.mixture
        a = allot(
            probs,
            shuffle_buffer=m.shuffle_buffer,
            buckets=[len(e) for e in m.edges],
            max_tokens=m.batching.max_tokens,
            budget=m.budget,
            shared=m.mix == "sample",
        )
        self._holds[:], self._caps[:], self._token_caps[:] = a.holds, a.caps, a.token_caps
        shares = probs / probs.sum()
        for st, limit, tokens, share in zip(self.streams, a.limits, a.token_limits, shares.tolist()):
            st.set_limits(limit, tokens, share)

    def _target_at(self, step: int) -> np.ndarray:
        """The adaptive shares in effect at ``step`` when there are any, else the schedule's target
        (asked twice a batch at the same progress: for the pick, then for the batch's meta)."""
        if self.table is not None:
            shares = self.table.shares_at(step, wait=self._in_worker)
            if shares is not None:
                return shares
        key = (step, self.tokens)
        if key != self._target_key:
            self._target_key, self._target_memo = (
                key,
                self.mixture.target_at(step, float(self.tokens * self.world.readers)),
            )
        return self._target_memo

    def _target(self) -> np.ndarray:
        p = self._target_at(self.step)
        p = np.where(self.active, p, 0.0)
        total = p.sum()
        if total <= 0:
            # Only sources with a zero target are left (all_exhausted): drain them evenly.
            return self.active / self.active.sum()
        return p / total

    def _cuts(self) -> Iterator[Cut]:
        """The mixing loop, past the ``replay`` batches of a restore (re-run for bookkeeping only)."""
        m = self.mixture
        count_tokens = m.unit == "tokens"
        cuts: Iterator[Cut]
        if m.mix == "sample":
            cuts = mix_samples(
                self.streams,
                self.batchers[0],
                self.selector,
                m.layout,
                probs=self._probs,
                caps=self._caps,
                token_caps=self._token_caps,
                active=self.active,
                retire=self._retire,
                count_tokens=count_tokens,
                drain=m.stop == "all_exhausted",
                closes=self._closes,
            )
        else:
            cuts = mix_batches(
                self.streams,
                self.batchers,
                self.selector,
                m.layout,
                probs=self._probs,
                holds=self._holds,
                caps=self._caps,
                token_caps=self._token_caps,
                active=self.active,
                retire=self._retire,
                count_tokens=count_tokens,
            )
        if self._replay is not None:
            for _, cut in zip(range(self._replay), cuts):
                self._meta(cut)
            self._replay = None
            # Statistics count from the resume: the first batch tells the loader where counters stood.
            self._resumed_counters = [c.as_list() for c in self.counters]
        return cuts

    def __iter__(self) -> Iterator[Batch]:
        for cut in self._cuts():
            yield self._collate(cut, self._meta(cut))

    def settle(self) -> dict[str, Any]:
        """After ``load_state_dict``: the state where the saved reader stood after its replay
        (:mod:`mixer.mixing.elastic`)."""
        self._cuts()
        return self.state_dict()

    # ---- state (the format is mixer.state.checkpoint's) -------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        batchers = self.batchers[:1] if self.mixture.mix == "sample" else self.batchers
        return pack_snapshot(
            batches=self.batches,
            tokens=self.tokens,
            active=self.active,
            counters=[c.as_list() for c in self.counters],
            selector=self.selector,
            streams=self.streams,
            batchers=batchers,
        )

    def state_dict(self) -> dict[str, Any]:
        """This reader's state now, as a loader state lists its readers (:mod:`mixer.state.checkpoint`)."""
        return reader_state(self._snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` says: restore its snapshot (each part restores itself; buffered
        samples are read again by location), take the later skips again, re-run ``replay`` batches."""
        expect_keys("reader", state, READER_KEYS)
        snapshot = self._snapshot() if state["snapshot"] is None else state["snapshot"]
        shared = self.mixture.mix == "sample"
        batchers = self.batchers[:1] if shared else self.batchers
        saved = unpack_snapshot(snapshot, streams=self.streams, batchers=batchers)
        parts: list[Rereads] = [*self.streams, *batchers]
        for part, part_state in zip(parts, (*with_skips(saved.streams, state["skips"]), *saved.batchers)):
            part.load_state_dict(part_state)
        self.selector.load_state_dict(snapshot["selector"])
        self.active = np.asarray(saved.active, dtype=bool)
        for c, row in zip(self.counters, saved.counters):
            for field, value in zip(Counters.FIELDS, row):
                setattr(c, field, int(value))
        self.batches = int(snapshot["batches"])
        self.tokens = int(snapshot["tokens"])
        self._probs_key = (-1, -1)
        if shared:
            wanted = group_locations([st.locations() for st in self.streams], batchers[0].locations())
        else:
            wanted = group_locations([(*st.locations(), *b.locations()) for st, b in zip(self.streams, batchers)])
        found = [reread(src, self.mixture.batching, w) for src, w in zip(self.mixture.listed, wanted)]
        for st, f in zip(self.streams, found):
            st.attach(f.__getitem__)
        if shared:
            batchers[0].attach(pair_lookup(found))
        else:
            for b, f in zip(batchers, found):
                b.attach(f.__getitem__)
        self._replay = int(state["replay"])

    def _retire(self, i: int) -> bool:
        """Source ``i`` has no more samples for this reader; returns whether the stream goes on."""
        self.active[i] = False
        self._retired += 1
        if self.mixture.stop == "never":
            log.warning(
                "source %r has no data for reader %d; mixing the other sources only",
                self.mixture.names[i],
                self.world.reader,
            )
        return self.mixture.stop != "first_exhausted" and bool(self.active.any())

    def _meta(self, cut: Cut) -> BatchMeta:
        """Count the batch and describe it: skip decisions always, a snapshot every
        ``state_every`` batches (taken after the selector has counted the batch)."""
        _, sources, delivered = cut
        count_delivered(self.counters, sources, delivered)
        n_tokens = int(delivered.tokens.sum())
        step = self.step
        # The schedule's share at this step, with the same progress the selector used (for stats).
        target = self._target_at(step).tolist()
        self.batches += 1
        self.tokens += n_tokens
        skips = [[i, *sk] for i, st in enumerate(self.streams) for sk in st.new_skips]
        if skips:
            for st in self.streams:
                st.new_skips.clear()
        resumed, self._resumed_counters = self._resumed_counters, None
        return BatchMeta(
            step=step,
            worker=self.world.worker,
            tokens=n_tokens,
            counters=[c.as_list() for c in self.counters],
            target=target,
            snapshot=self._snapshot() if self.batches % self.mixture.state_every == 0 else None,
            skips=skips or (),
            resumed_counters=resumed,
        )

    def _collate(self, cut: Cut, meta: BatchMeta) -> Batch:
        """The batch, into a shared slot when there is a pool."""
        samples, sources, _ = cut
        layout = self.mixture.layout
        if self.pool is None:
            return layout.collate(samples, sources, meta=meta)
        writer = self.pool.writer(self.world.worker)
        batch = layout.collate(samples, sources, meta=meta, out=writer.out)
        batch.slot = writer.seal()
        return batch
