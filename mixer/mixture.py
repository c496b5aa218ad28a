"""``Mixture``: the IterableDataset that wires sources, schedule, selector, buckets and collate.

One iteration runs one *reader* (a DataLoader worker of one rank, or the main process). Readers never
talk to each other: each knows its place (:class:`mixer.world.World`) and derives its shards, its
random numbers and its share of the global step from it.
"""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .batch import _DTYPES, Batch
from .batchers import Batcher, make_batcher
from .budget import Field, Packed, TokenBudget
from .collate import Layout, count_delivered, make_layout
from .decode import Sample
from .edges import bucket_edges
from .errors import ConfigError
from .options import MixMode, Stop, Unit, check_options
from .mixing import Cut, mix_batches, mix_samples
from .schedule import Schedule, SourceInfo, Static, check_schedule
from .selector import make_selector
from .profiling import Profile, check_profile_cache, check_profile_share, list_source, profile_sources
from .source import ListedSource, Source
from .reread import reread
from .stream import Counters, SourceStream
from .transport import SlotPool
from .world import World, resolve_rank, worker_place

log = logging.getLogger(__name__)

MIN_SHUFFLE = 16  # the smallest shuffle buffer a rarely read source is cut down to
HOLD_MIN_BATCHES = 2.0  # the least a rarely read source's buckets may hold, in batches of padded tokens




class Mixture(IterableDataset[Batch]):
    """Several sources mixed by target share into length-bucketed, token-budget batches.

    Level 1 (``selector``) picks the source of the next batch (``mix="batch"``: every batch comes
    from one source) or of the next sample (``mix="sample"``: buckets shared across sources) so that
    the realized share of ``unit`` (real tokens by default) tracks ``schedule``'s target. Level 2
    (``batching``) groups a source's samples by length so that padding stays small
    (:class:`~mixer.TokenBudget`), or packs them back to back (:class:`~mixer.Packed`: batches are
    :class:`~mixer.PackedBatch`). ``fields``: samples whose ``decode`` returns named arrays are
    collated per field (batches are :class:`~mixer.FieldBatch`; see :mod:`mixer.collate`).

    ``stop``: ``"never"`` restarts an exhausted source with a reshuffled epoch; ``"first_exhausted"``
    ends when any source has delivered its whole pass; ``"all_exhausted"`` drops exhausted sources
    and renormalises the rest, so one pass delivers every sample of every source exactly once.

    Building it lists every source's shards and looks at the sources that need it (their size when
    ``Source.size`` is not given, their lengths when the bucket edges are derived; see
    :mod:`mixer.profiling`), in parallel, with bounded reads. ``profile_cache``: a directory where
    those looks are kept, keyed by each source's shard listing, so that a restarted job reads no
    shard to start (default None: no cache; see :mod:`mixer.profile_cache` for what the key
    covers). ``profile_share``: under ``torch.distributed``, rank 0 of ``dp_group`` (else of the
    default group) looks and broadcasts the result, so the other ranks read nothing (None: when a
    group of several ranks is initialized; every rank of it must then build the mixture; False:
    every rank looks for itself).

    Each ``iter()`` starts the stream from the beginning: same seed, same batches. For exact resume
    use the loader's ``state_dict()`` / ``load_state_dict()``: every ``state_every`` batches a
    reader attaches its full state (where it reads, and the shard and byte offset of every buffered
    sample) to a batch; a resumed reader seeks back there and re-runs at most ``state_every - 1``
    batches in-process, so resuming costs the same at any point of an epoch.
    """

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
        fields: Mapping[str, Field] | None = None,
        profile_cache: str | os.PathLike[str] | None = None,
        profile_share: bool | None = None,
    ) -> None:
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
        checked = check_options(selector=selector, unit=unit, mix=mix, stop=stop, seed=seed, shuffle_buffer=shuffle_buffer,
                                pad_id=pad_id, dtype=dtype, state_every=state_every)  # fmt: skip
        seed, pad_id, shuffle_buffer, state_every = (checked[k] for k in ("seed", "pad_id", "shuffle_buffer", "state_every"))
        self.sources = sources
        self.batching = batching
        self.schedule: Schedule = schedule if schedule is not None else Static()
        self.selector = selector
        self.unit: Unit = unit
        self.mix: MixMode = mix
        self.stop: Stop = stop
        self.seed = int(seed)
        self.shuffle_buffer = shuffle_buffer
        self.pad_id = int(pad_id)
        self.dtype = dtype
        self.state_every = state_every
        self.rank, self.world_size = resolve_rank(rank, world_size, dp_group)
        # How a batch is accounted, collated and sized: padded, packed or multi-field (mixer.collate).
        self.layout: Layout = make_layout(batching, fields, dtype=dtype, pad_id=self.pad_id, names=names)
        for s in sources:
            if isinstance(s.length, str) and (fields is None or s.length not in fields):
                raise ConfigError(f"source {s.name!r}: length={s.length!r} names a field, but the mixture's fields= {sorted(fields or ())} lack it")

        # Judges every sample it reads as the readers do: too long for the budget is a SampleError
        # naming shard and key, raised or skipped by the source's on_error, as mid-stream.
        cache, share = check_profile_cache(profile_cache), check_profile_share(profile_share)
        self.listed: list[ListedSource] = [list_source(s) for s in sources]  # the only listing of shards
        self.profiles: list[Profile] = profile_sources(self.listed, batching, cache=cache, share=share, group=dp_group)
        self.info = SourceInfo(
            names=tuple(names),
            weights=np.array([s.weight for s in sources], dtype=np.float64),
            sizes=np.array([p.size for p in self.profiles], dtype=np.float64),
            groups=tuple(s.group for s in sources),
        )
        # Check the whole schedule now (every phase of a curriculum, all-zero weights...), so that
        # it fails here and not in a worker process hours into the run.
        check_schedule(self.schedule, self.info)
        if isinstance(batching, Packed):
            self.edges: list[list[int]] = [[] for _ in sources]  # no buckets: the Packer places documents
        elif batching.buckets is not None:
            self.edges = [list(batching.buckets)] * len(sources)
        elif mix == "sample":
            shared = bucket_edges(np.concatenate([p.lengths for p in self.profiles]), **self._edge_options())
            self.edges = [shared] * len(sources)
        else:
            self.edges = [bucket_edges(p.lengths, **self._edge_options()) for p in self.profiles]

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
            raise ConfigError(f"schedule {self.schedule!r} returned an invalid probability vector {p.tolist()} at step {step}")
        return p / p.sum()

    @property
    def max_batch_elements(self) -> int:
        """The largest flat buffer a batch can need (see :meth:`mixer.collate.Layout.max_elements`)."""
        return self.layout.max_elements(self.edges)

    def reader(self, world: World, *, pool: SlotPool | None = None) -> Reader:
        return Reader(self, world, pool=pool)

    def stream(self, *, pool: SlotPool | None = None, resume: dict[str, Any] | None = None) -> Iterator[Batch]:
        """This process's batches: as a DataLoader worker, or the main process when there are none.
        ``pool``: shared slots the loader mapped before forking its workers (see mixer.transport).
        ``resume``: ``{"shift": s, "readers": [...]}`` from a loader state: DataLoader always starts
        with worker 0, so worker ``w`` continues reader ``(w + s) % num_workers``, which keeps the
        order of batches exactly that of the uninterrupted run."""
        worker, num_workers = worker_place()
        if resume is not None:
            worker = (worker + resume["shift"]) % num_workers
        world = World(rank=self.rank, world_size=self.world_size, worker=worker, num_workers=num_workers)
        if world.reader == 0:
            for s in self.listed:
                if len(s.shards) < world.readers:
                    log.warning(
                        "source %r has %d shard(s) for %d readers: readers share shards and each reads every byte of "
                        "its shard but keeps only its part of the samples (I/O amplified up to %dx); more, smaller "
                        "shards avoid it", s.name, len(s.shards), world.readers, -(-world.readers // len(s.shards)),
                    )
        in_worker = get_worker_info() is not None
        reader = self.reader(world, pool=pool if in_worker else None)
        if resume is None:
            return iter(reader)
        saved = resume["readers"][worker]
        if saved["state"] is not None:
            reader.load_state_dict(saved["state"])
        reader.add_skips(saved["skips"])
        return reader.fast_forward(saved["since"])

    def __iter__(self) -> Iterator[Batch]:
        return self.stream()


class Reader:
    """The stream of one reader. Global step of its ``k``-th batch: ``k * num_workers + worker``
    (DataLoader takes batches from its workers round-robin, in order), so every reader of every rank
    asks the schedule about the same global step at the same point in training. Tokens seen are
    estimated as this reader's tokens times the number of readers (readers deliver alike on average).

    A reader runs one of :mod:`mixer.mixing`'s loops over its streams and batchers and keeps the
    bookkeeping around it: the target shares and hold sizes as progress moves, the counters, each
    batch's info and, every ``state_every`` batches, its state."""

    def __init__(self, mixture: Mixture, world: World, *, pool: SlotPool | None = None) -> None:
        self.mixture = mixture
        self.world = world
        self.pool = pool
        n = len(mixture.sources)
        finite = mixture.stop != "never"
        self.counters = [Counters() for _ in range(n)]
        budget = mixture.batching
        self.streams = [
            SourceStream(
                s, world, seed=mixture.seed, budget=budget, shuffle_buffer=mixture.shuffle_buffer,
                finite=finite, counters=self.counters[i],
            )
            for i, s in enumerate(mixture.listed)
        ]
        # Items are Samples (mix="batch": one level 2 per source) or (source, Sample) pairs
        # (mix="sample": one shared level 2, repeated per source); use sites name the item type.
        self.batchers: list[Batcher[Any]]
        if mixture.mix == "sample":
            shared = make_batcher(mixture.edges[0], budget)
            self.batchers = [shared] * n
        else:
            self.batchers = [make_batcher(e, budget) for e in mixture.edges]
        self.selector = make_selector(mixture.selector, n, seed=mixture.seed, stream=(world.rank, world.worker))
        self.active = np.ones(n, dtype=bool)
        self.batches = 0
        self.tokens = 0
        self._probs_key: tuple[int, int] | None = None
        self._probs_cache = np.zeros(n)
        self._holds = [0] * n
        self._resumed_counters: list[list[int]] | None = None

    @property
    def step(self) -> int:
        return self.batches * self.world.num_workers + self.world.worker

    def _probs(self) -> np.ndarray:
        # Progress moves once per batch: with mix="sample" the schedule is asked once per batch,
        # not once per sample.
        key = (self.batches, int(self.active.sum()))
        if key != self._probs_key:
            self._probs_key = key
            self._probs_cache = self._target()
            self._hold_ahead(self._probs_cache)
        return self._probs_cache

    def _hold_ahead(self, probs: np.ndarray) -> None:
        """Size what each source may hold ahead by how often it is read now: ``r = p / max(p)``
        (1 for the most wanted source). Its shuffle buffer keeps ``max(ceil(r * shuffle_buffer),
        min(shuffle_buffer, MIN_SHUFFLE))`` samples and its buckets ``max(r * len(edges), 2)``
        batches of padded tokens; beyond that the best batch they can make leaves (see
        :meth:`mixer.batchers.Bucketer.release`: fewer or shorter-padded samples), so a source at a
        0.5% share reads about what it delivers instead of filling every bucket first. Unchanged
        for the most wanted source: ``len(edges)`` buckets, each short of a full batch, never hold
        ``len(edges)`` batches.
        A pure function of progress: resumed readers size them the same way at the same points."""
        top = float(probs.max())
        m = self.mixture
        for i, (st, edges) in enumerate(zip(self.streams, m.edges)):
            r = float(probs[i]) / top if top > 0 else 1.0
            st.limit = max(math.ceil(r * m.shuffle_buffer), min(m.shuffle_buffer, MIN_SHUFFLE))
            self._holds[i] = int(max(r * len(edges), HOLD_MIN_BATCHES) * m.batching.max_tokens)

    def _target(self) -> np.ndarray:
        p = self.mixture.target_at(self.step, float(self.tokens * self.world.readers))
        p = np.where(self.active, p, 0.0)
        total = p.sum()
        if total <= 0:
            # Only sources with a zero target are left (all_exhausted): drain them evenly.
            return self.active / self.active.sum()
        return p / total

    def __iter__(self) -> Iterator[Batch]:
        m = self.mixture
        count_tokens = m.unit == "tokens"
        cuts: Iterator[Cut]
        if m.mix == "sample":
            cuts = mix_samples(
                self.streams, self.batchers[0], self.selector, m.layout, probs=self._probs, active=self.active,
                retire=self._retire, count_tokens=count_tokens, drain=m.stop == "all_exhausted",
            )
        else:
            cuts = mix_batches(
                self.streams, self.batchers, self.selector, m.layout, probs=self._probs, holds=self._holds,
                active=self.active, retire=self._retire, count_tokens=count_tokens,
            )
        for cut in cuts:
            yield self._finish(self._emit(cut))

    def fast_forward(self, batches: int) -> Iterator[Batch]:
        """The stream after producing and dropping ``batches`` batches (to reach the exact point of
        a saved state from the snapshot before it)."""
        pool, self.pool = self.pool, None
        it = iter(self)
        for _ in range(batches):
            next(it)
        self.pool = pool
        # Statistics count from the resume: the first batch tells the loader where counters stood.
        self._resumed_counters = [c.as_list() for c in self.counters]
        return it

    def _finish(self, batch: Batch) -> Batch:
        """Attach what the loader's bookkeeping needs: skip decisions always, the full state every
        ``state_every`` batches (taken after the selector has counted the batch)."""
        if self._resumed_counters is not None:
            batch.info["resumed_counters"], self._resumed_counters = self._resumed_counters, None
        skips = [[i, *sk] for i, st in enumerate(self.streams) for sk in st.new_skips]
        if skips:
            batch.info["skips"] = skips
            for st in self.streams:
                st.new_skips.clear()
        if self.batches % self.mixture.state_every == 0:
            batch.info["state"] = self.state_dict()
        return batch

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        shared = self.mixture.mix == "sample"
        batchers = self.batchers[:1] if shared else self.batchers
        return {
            "batches": self.batches,
            "tokens": self.tokens,
            "active": self.active.tolist(),
            "counters": [c.as_list() for c in self.counters],
            "selector": self.selector.state_dict(),
            "streams": [st.state_dict() for st in self.streams],
            "bucketers": [
                b.state_dict(_encode_pair if shared else _encode_sample)
                for b in batchers
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a reader saved by :meth:`state_dict`, re-reading every buffered sample by seeking
        to its (shard, byte offset)."""
        shared = self.mixture.mix == "sample"
        n = len(self.streams)
        wanted: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        for i, st in enumerate(state["streams"]):
            wanted[i].update((int(a), int(b)) for a, b in st["buffer"])
        for i, bs in enumerate(state["bucketers"]):
            for group in (*bs["ready"], *bs["buffers"]):
                for item in group:
                    if shared:
                        wanted[item[0]].add((item[1], item[2]))
                    else:
                        wanted[i].add((item[0], item[1]))
        samples = [reread(src, self.mixture.batching, sorted(w)) for src, w in zip(self.mixture.listed, wanted)]
        for st, saved, found in zip(self.streams, state["streams"], samples):
            st.load_state_dict(saved, found)
        if shared:
            pairs: Batcher[tuple[int, Sample]] = self.batchers[0]
            pairs.load_state_dict(state["bucketers"][0], _pair_decoder(samples))
        else:
            for b, bs, found in zip(self.batchers, state["bucketers"], samples):
                b.load_state_dict(bs, _sample_decoder(found))
        self.selector.load_state_dict(state["selector"])
        self.active = np.asarray(state["active"], dtype=bool)
        for c, row in zip(self.counters, state["counters"]):
            for field, value in zip(Counters.FIELDS, row):
                setattr(c, field, int(value))
        self.batches = int(state["batches"])
        self.tokens = int(state["tokens"])
        self._probs_key = None

    def add_skips(self, skips: Sequence[Sequence[int]]) -> None:
        for source, *decision in skips:
            self.streams[int(source)].add_skips([decision])

    def _retire(self, i: int) -> bool:
        """Source ``i`` has no more samples for this reader; returns whether the stream goes on."""
        self.active[i] = False
        if self.mixture.stop == "never":
            log.warning("source %r has no data for reader %d; mixing the other sources only", self.mixture.names[i], self.world.reader)
        return self.mixture.stop != "first_exhausted" and bool(self.active.any())

    def _emit(self, cut: Cut) -> Batch:
        """Count the batch, attach the bookkeeping and collate it, into a shared slot when there is
        a pool."""
        samples, sources, delivered = cut
        count_delivered(self.counters, sources, delivered)
        n_tokens = int(delivered.tokens.sum())
        info = {
            "step": self.step,
            "worker": self.world.worker,
            "tokens": n_tokens,
            "counters": [c.as_list() for c in self.counters],
            # The schedule's share at this step, with the same progress the selector used (for stats).
            "target": self.mixture.target_at(self.step, float(self.tokens * self.world.readers)).tolist(),
        }
        self.batches += 1
        self.tokens += n_tokens
        layout = self.mixture.layout
        if self.pool is None:
            return layout.collate(samples, sources, info=info)
        writer = self.pool.writer(self.world.worker)
        batch = layout.collate(samples, sources, info=info, out=writer.out)
        batch.slot = writer.seal()
        return batch


# Snapshots encode every buffered sample (often 10k+): a C-level getter, no Python frame per sample.
_encode_sample = operator.attrgetter("shard", "offset")


def _encode_pair(item: tuple[int, Sample]) -> tuple[int, int, int]:
    return (item[0], item[1].shard, item[1].offset)


def _sample_decoder(found: Mapping[tuple[int, int], Sample]) -> Callable[[Any], Sample]:
    """The inverse of ``_encode_sample`` over the re-read samples of one source."""
    return lambda x: found[(x[0], x[1])]


def _pair_decoder(found: Sequence[Mapping[tuple[int, int], Sample]]) -> Callable[[Any], tuple[int, Sample]]:
    """The inverse of ``_encode_pair`` over the re-read samples of every source."""
    return lambda x: (int(x[0]), found[x[0]][(x[1], x[2])])
