"""``make_loader``: a DataLoader over a Mixture, with deterministic worker seeding and bookkeeping.

The main process keeps what the last batch from each worker carried (its counters), so statistics
need no extra IPC: they ride along with the batches.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import multiprocessing
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.random  # noqa: F401  (see below)
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mixer.batching.batch import Batch, BatchMeta
from mixer.errors import ConfigError, StateError
from mixer.mixing import elastic
from mixer.mixing.adaptive import Adaptive
from mixer.mixing.mixture import Mixture
from mixer.observe.stats import DEFAULT_WINDOW, Stats
from mixer.plan.world import seed_for
from mixer.read.counters import Counters
from mixer.runtime import interrupts
from mixer.runtime.device import DeviceLike, to_device
from mixer.runtime.distributed import DEFAULT_SYNC_TIMEOUT, StopSync, SyncEnd, max_over_ranks, stop_sync
from mixer.runtime.feedback import Feedback, SharesTable, make_feedback
from mixer.runtime.transport import SlotPool, group_size, grouped, ungrouped
from mixer.state import checkpoint
from mixer.state.checkpoint import Position, ReaderLog, Resume

# numpy.random is imported here, before any worker forks, because DataLoader seeds it in every worker
# (and the readers draw from its PCG64): numpy imports it lazily, and a worker that imports it for
# itself pays ~10 ms of CPU and ~1,300 page faults on each pass (measured in a forked worker here).


def _init_worker(worker_id: int) -> None:
    """Seed the global RNGs inside each worker from the worker's own torch seed, so that user code
    (a custom ``decode``) that uses them is reproducible (mixer itself never uses them), and make
    the worker exit when its parent dies."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    _exit_with_parent()


PARENT_POLL_S = 0.2


def _exit_with_parent() -> None:
    """End this worker within ``PARENT_POLL_S`` of its parent's death (SIGKILL, SIGTERM, a crash).

    DataLoader's own watchdog only looks while a worker waits for a request, every 5 s, and a worker
    blocked writing a result that nobody reads (the pipe held open by its siblings) never looks:
    it stays orphaned. ``os._exit`` skips the queue's join at exit, which is where that hangs.
    The parent is the process that forked this worker, read here, so a loader handed to another
    process cannot make its workers exit by mistake."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="mixer-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Around the fork of the workers: the objects alive now are left out of the workers' garbage
    collections (``gc.freeze``, what the Python documentation advises before a fork without exec).

    A forked worker inherits the parent's whole heap (torch alone is ~170k tracked objects), and each
    full collection in the worker walks all of it and writes to every object's header, which also
    copies those pages (copy on write). Measured on the benchmark's pass (2 workers): two full
    collections per worker at ~65 ms each, ~4 ms each with the inherited objects frozen. The parent
    unfreezes right after the fork, so its own collections are unchanged. Skipped when the caller
    has frozen objects itself: unfreezing would undo that."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: Callers whose automatic saves and loads of a loader's state are refused: Lightning's Trainer saves
#: the state of the loaders it iterates (``CombinedLoader``) after fetching one batch ahead of the
#: training step, so the state it saves is one batch past what it trained.
FETCH_AHEAD_CALLERS = ("lightning.pytorch.", "pytorch_lightning.")


def _refuse_fetching_ahead(action: str) -> None:
    """Raise if the caller of the loader method calling this is in a module of :data:`FETCH_AHEAD_CALLERS`.

    Lightning names no hook for this: its ``CombinedLoader`` calls ``state_dict()`` on any iterable
    that has one. The frame two levels up is that caller (0: here, 1: the loader's method)."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    if caller.startswith(FETCH_AHEAD_CALLERS):
        raise StateError(
            f"a mixer Loader handed straight to Lightning's Trainer cannot {action} its state exactly: Lightning "
            "fetches the next batch before it trains the current one, so the loader's own state is one batch "
            "ahead and a resumed run would skip a batch. Use mixer.lightning.MixerDataModule: it saves the state "
            "as of the last batch trained"
        )


class _LoaderDataset(IterableDataset[Any]):
    """What DataLoader iterates: the mixture's batches (in a worker, in groups of up to ``group``,
    see :mod:`mixer.runtime.transport`), with the shared slots the workers write into and, for one
    iteration after ``load_state_dict``, where each reader resumes."""

    def __init__(self, mixture: Mixture, pool: SlotPool | None, group: int) -> None:
        self.mixture = mixture
        self.pool = pool
        self.group = group
        self.resume: Resume | None = None
        self.table: SharesTable | None = None

    def __iter__(self) -> Iterator[Any]:
        # A resume is for one pass: persistent workers keep this object and iterate it again for the
        # next pass, which must start afresh, not repeat the resumed one.
        resume, self.resume = self.resume, None
        batches = self.mixture.batches(pool=self.pool, resume=resume, table=self.table)
        info = get_worker_info()
        return batches if info is None else grouped(batches, info.id, self.group)


#: Batches per worker the main process may hold past their hand-out without the worker sending by
#: value: the training step's, the device feed's look-ahead (2 by default) and the rank sync's.
HELD = 4


def _slot_pool(
    mixture: Mixture, num_workers: int, prefetch_factor: int | None, context: Any, group: int
) -> SlotPool | None:
    """Shared slots for the workers' batches, when workers are forked (they inherit the mapping);
    other start methods fall back to pickling batches by value."""
    if num_workers <= 0:
        return None
    if context is None:
        context = multiprocessing.get_context()
    elif isinstance(context, str):
        context = multiprocessing.get_context(context)
    if context.get_start_method() != "fork":
        return None
    # Enough slots that a worker rarely finds none free (see mixer.runtime.transport: it then sends by value):
    # DataLoader keeps about prefetch_factor requests (groups) per worker outstanding, two groups
    # spare on top (the one being made, the one being handed out), and HELD batches that the
    # training loop may still hold after they were handed out (a batch's slot is freed with it).
    slots = ((prefetch_factor if prefetch_factor is not None else 2) + 2) * group + HELD
    return SlotPool(
        num_workers=num_workers, slots=slots, slot_elems=mixture.max_batch_elements, dtype=np.dtype(mixture.dtype)
    )


class Loader:
    """Iterates ``Batch`` objects from a ``Mixture`` through ``torch.utils.data.DataLoader``
    (``batch_size=None``: the mixture already batches). Batches arrive in order: worker ``w`` of
    ``W`` delivers global steps ``w, w + W, ...``.

    Built by :func:`make_loader` (which documents the options and sets the loader up); the class is
    public for type annotations and ``isinstance`` only, and calling it raises ``TypeError``.
    :meth:`state_dict` / :meth:`load_state_dict` give exact resume.
    """

    # Set up by make_loader.
    mixture: Mixture
    num_workers: int
    pool: SlotPool | None
    device: torch.device | None
    device_prefetch: int
    dataloader: DataLoader[Any]
    persistent_workers: bool
    sync: StopSync | None
    _pool_options: tuple[int, int | None, Any, int]
    _started: bool
    _resume: Resume | None
    _stats: Stats
    _feedback: Feedback | None
    _sync_options: tuple[Any, float]
    _position: Position  # as of the last batch handed out (or where a pass resumes, before its first)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("mixer.Loader is not built directly: use mixer.make_loader(mixture, ...)")

    def _setup_delivery(
        self,
        mixture: Mixture,
        *,
        num_workers: int,
        in_flight: int | None,
        persistent: bool,
        forked: bool,
        device: DeviceLike | None,
        device_prefetch: int,
        stats_window: int,
        sync_stop: bool | None,
        sync_end: SyncEnd,
        sync_group: Any,
        sync_timeout: float,
    ) -> None:
        """What every loader keeps on the training side, wherever its readers run: the device feed,
        the bookkeeping of each reader's state, statistics, the rank sync and adaptive feedback.
        ``in_flight``: requests (groups) per reader outstanding beyond the batch handed out
        (DataLoader's ``prefetch_factor``), which the adaptive lag counts."""
        self.mixture = mixture
        self.num_workers = num_workers
        # validated now (a ConfigError for "cuda" without CUDA); each iter() builds its own feed
        self.device = to_device((), device, prefetch=device_prefetch).device if device is not None else None
        self.device_prefetch = device_prefetch
        self.persistent_workers = persistent
        self._started = False
        self._resume: Resume | None = None
        self._reset_bookkeeping(None)
        self._stats = Stats(
            mixture.names,
            window=stats_window,
            num_workers=num_workers,
            max_tokens=mixture.batching.max_tokens,
            unit=mixture.unit,
        )
        # Equal batch counts over the data-parallel ranks in finite modes (see mixer.runtime.distributed).
        self._sync_options = (sync_group, sync_timeout)  # also for an elastic resume's agreement
        self.sync = stop_sync(
            mixture, sync_stop=sync_stop, sync_end=sync_end, sync_group=sync_group, sync_timeout=sync_timeout
        )
        self._feedback = make_feedback(
            mixture,
            num_workers=num_workers,
            prefetch_factor=in_flight,
            device_prefetch=device_prefetch if self.device is not None else 0,
            synced=self.sync is not None,
            forked=forked,
            persistent=persistent,
            group=sync_group,
            timeout=sync_timeout,
        )

    def __iter__(self) -> Iterator[Batch]:
        interrupts.watch()  # a Ctrl-C that a finalizer swallowed ends the pass at the next batch
        self._stats.reset(resumed=self._resume is not None)
        resume, self._resume = self._resume, None
        self._reset_bookkeeping(resume)
        table = None
        if self._feedback is not None:
            if resume is None:
                self._feedback.reset()
            # Made before this pass's readers start; they read the shares published into it.
            table = self._feedback.table()
        batches, close = self._open(resume, table)
        try:
            yield from self._deliver(batches)
        finally:
            close()

    def _open(self, resume: Resume | None, table: SharesTable | None) -> tuple[Iterator[Batch], Callable[[], None]]:
        """This pass's batches, one at a time in the round robin's order, and what ends the pass
        (called however it ends). Here: DataLoader's workers (or the main process); the readers of
        :mod:`mixer.service` run elsewhere and deliver through the same bookkeeping."""
        dataset = self.dataloader.dataset
        assert isinstance(dataset, _LoaderDataset)
        dataset.resume = resume
        dataset.table = table
        if self._started and not self.persistent_workers and self.pool is not None:
            # This pass forks new workers; an earlier pass's workers may still be writing into the
            # old slots (its iterator is alive), so the new ones get slots of their own.
            self.pool = dataset.pool = _slot_pool(self.mixture, *self._pool_options)
        self._started = True
        with _frozen_heap(), interrupts.unheard_by_children():
            loader_iter = iter(self.dataloader)  # forks the workers (num_workers > 0)
        # Workers send groups of batches (mixer.runtime.transport): one batch at a time from here on.
        single: Iterator[Batch] = ungrouped(loader_iter, self.num_workers) if self.num_workers > 0 else loader_iter

        # The pool is held for as long as this pass runs (by close): its batches are views of this mapping.
        def close(pool: SlotPool | None = self.pool) -> None:
            # Left early (break, an error, Ctrl-C): without this the DataLoader iterator and its
            # workers live on until the garbage collector finds them, then take ~5 s per worker.
            shutdown = getattr(loader_iter, "_shutdown_workers", None)
            if callable(shutdown) and not self.persistent_workers:
                shutdown()

        return single, close

    def _deliver(self, single: Iterator[Batch]) -> Iterator[Batch]:
        # Inside the device feed: a look-ahead batch the ranks agree to drop is never copied.
        source = single if self.sync is None else self.sync.agreed(single)
        batches = source if self.device is None else to_device(source, self.device, prefetch=self.device_prefetch)
        logs = self._logs
        for batch in batches:
            interrupts.raise_noted()
            meta = batch.meta
            if meta.filler:  # delivers nothing: no state, no counters (StopSync counts it)
                batch.meta = replace(meta, position=self._position)
                yield batch
                continue
            if self._feedback is not None:
                self._feedback.delivered(meta)
            self._stats.update(meta)
            # Each reader's state as of the last batch handed out (see mixer.state.checkpoint.ReaderLog).
            logs[meta.worker] = logs[meta.worker].after(meta)
            self._delivered += 1
            self._position = Position(self.mixture.fingerprint, self._delivered, tuple(logs))
            # The snapshot stays with the loader (inside the position); the training loop gets the rest.
            # Set in place: every real batch arrives with a meta of its own (a filler's is shared).
            meta.snapshot, meta.position = None, self._position
            yield batch

    @property
    def _readers(self) -> int:
        return max(self.num_workers, 1)

    def _reset_bookkeeping(self, resume: Resume | None) -> None:
        self._delivered = 0 if resume is None else resume.delivered
        saved = resume.readers if resume is not None else [None] * self._readers
        self._logs = [ReaderLog() if r is None else ReaderLog.from_state(r) for r in saved]
        self._position = Position(self.mixture.fingerprint, self._delivered, tuple(self._logs))

    def state_dict(self, upto: Batch | BatchMeta | None = None) -> dict[str, Any]:
        """The stream's position as of the last batch handed out: small, plain (JSON-able), and
        enough for :meth:`load_state_dict` to continue batch for batch as if never stopped
        (the format is :mod:`mixer.state.checkpoint`'s).

        ``upto``: a batch this loader handed out, or its ``meta`` (keep that rather than the batch,
        which holds its memory): the state as of *that* batch, so the resumed stream starts with the
        batch after it, whatever was handed out since. For training loops that fetch batches ahead of
        the step: save ``state_dict(upto=last_trained_batch)``. Refused (:class:`~mixer.errors.StateError`)
        for a batch of another mixture or loader shape, a batch that went through pickling (its
        position stays behind), and, under an :class:`~mixer.Adaptive` schedule, any batch but the last
        handed out (the feedback's state is kept as of the last batch only).

        Refused too when Lightning's Trainer calls it on a loader handed to it straight: Lightning
        saves a loader's state after it has fetched the next batch, which would skip that batch on
        resume; :class:`mixer.integrations.lightning.MixerDataModule` saves exactly."""
        _refuse_fetching_ahead("save")
        position = self._position if upto is None else self._position_of(upto)
        if self._feedback is not None and position is not self._position:
            raise StateError(
                "state_dict(upto=...): under an Adaptive schedule only the last batch handed out can be saved (the "
                "feedback's state is kept as of the last batch only); save before fetching the next batch"
            )
        return checkpoint.loader_state(
            fingerprint=self.mixture.fingerprint,
            rank=self.mixture.rank,
            world_size=self.mixture.world_size,
            num_workers=self._readers,
            delivered=position.delivered,
            readers=copy.deepcopy([log.state_dict() for log in position.readers]),
            adaptive=None if self._feedback is None else self._feedback.state_dict(),
        )

    def _position_of(self, upto: Batch | BatchMeta) -> Position:
        meta = upto if isinstance(upto, BatchMeta) else getattr(upto, "meta", None)
        if not isinstance(meta, BatchMeta):
            raise StateError(
                "state_dict(upto=...): expected a batch this loader handed out, or its meta (got "
                f"{type(upto).__name__})"
            )
        position = meta.position
        if position is None:
            raise StateError(
                "state_dict(upto=...): this batch carries no loader position: it was not handed out by a mixer "
                "Loader in this process (a batch that went through pickling leaves its position behind)"
            )
        if position.fingerprint != self.mixture.fingerprint or len(position.readers) != self._readers:
            raise StateError(
                "state_dict(upto=...): this batch was handed out by a loader of another mixture or with another "
                "num_workers; pass a batch of this loader"
            )
        return position

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue from ``state`` on the next iteration. Refused (``StateError``) for a state of another
        mixture, version or topology (rank, world_size, num_workers). Elastic resume: ``state`` is the
        list of the states of all the saved ranks (any world_size and num_workers; see
        :mod:`mixer.mixing.elastic`), or any sequence whose ``state[r]`` reads rank ``r``'s state when
        asked (a rank then reads only the states of the old ranks it takes over). Every rank of the
        new run passes the same saved run; under ``torch.distributed`` they agree on a few integers
        with one ``all_reduce`` over ``sync_group`` (bounded by ``sync_timeout``), so every rank must call it."""
        _refuse_fetching_ahead("load")
        if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            agree = max_over_ranks(self.mixture, group=self._sync_options[0], timeout=self._sync_options[1])
            state = elastic.resume_state(self.mixture, state, num_workers=self.num_workers, agree=agree)
        checkpoint.check(state, self.mixture, num_workers=self.num_workers)
        if self.persistent_workers and self._started:
            raise StateError(
                "load_state_dict must come before the first iteration when persistent_workers=True (the workers "
                "already run)"
            )
        if (state["adaptive"] is None) != (self._feedback is None):
            raise StateError("loader state: 'adaptive' must be given exactly when the mixture's schedule is Adaptive")
        if self._feedback is not None:
            self._feedback.load_state_dict(copy.deepcopy(state["adaptive"]))
        self._resume = Resume(int(state["delivered"]), copy.deepcopy(state["readers"]))
        self._reset_bookkeeping(self._resume)

    def sync_report(self) -> dict[str, Any]:
        """How this rank's latest pass was evened out with the other ranks (equal batch counts in finite
        modes, see :mod:`mixer.runtime.distributed`): ``{"sync_end": "pad" | "drop" | None, "fillers": n,
        "dropped": {"batches": n, "sources": {name: {"samples": n, "tokens": n}}}}``. ``fillers``:
        filler batches handed out after this rank's stream ended (``"pad"``); ``dropped``: batches
        read but not handed out because another rank's stream ended first (``"drop"``). ``sync_end``
        is None and all counts are zero when the ranks are not synced."""
        if self.sync is None:
            zero = {n: {"samples": 0, "tokens": 0} for n in self.mixture.names}
            return {"sync_end": None, "fillers": 0, "dropped": {"batches": 0, "sources": zero}}
        return self.sync.report()

    def feedback(self, batch: Batch, loss: torch.Tensor) -> None:
        """Report the training loss of a batch this loader handed out: ``loss`` holds one value per
        sample (``batch.source``'s length; per-token losses summed or averaged per sample, as you
        like, consistently), on any device. Accumulated per source without synchronising; every
        ``update_every`` steps an :class:`~mixer.Adaptive` schedule's policy turns the window's
        losses into new target shares (see :mod:`mixer.runtime.feedback`). Filler batches are ignored."""
        if self._feedback is None:
            raise ConfigError("feedback: the mixture's schedule is not mixer.Adaptive, so there is nothing to adapt")
        if not batch.meta.filler:
            self._feedback.observe(batch, loss)

    def counters(self) -> dict[str, dict[str, int]]:
        """Cumulative per-source counters summed over the workers, as of the last batch handed out."""
        total = self._stats.cumulative()
        return {name: dict(zip(Counters.FIELDS, map(int, row))) for name, row in zip(self.mixture.names, total)}

    def stats(self) -> dict[str, Any]:
        """Per-source counters, realized vs target share (in the mixture's unit), padding efficiency and
        tokens/s, over the whole pass and over the last ``stats_window`` batches handed out: a
        JSON-serialisable dict (see :meth:`mixer.observe.stats.Stats.as_dict`), computed from what the batches
        carry; filler batches (``batch.filler``) count in none of it, only in ``fillers``."""
        out = self._stats.as_dict()
        out["fillers"] = 0 if self.sync is None else self.sync.fillers
        out["adaptive"] = None if self._feedback is None else self._feedback.as_dict()
        return out


def make_loader(
    mixture: Mixture,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    timeout: float = 0,
    multiprocessing_context: Any = None,
    device: DeviceLike | None = None,
    device_prefetch: int = 2,
    stats_window: int = DEFAULT_WINDOW,
    sync_stop: bool | None = None,
    sync_end: SyncEnd = "pad",
    sync_group: Any = None,
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
) -> Loader:
    """A :class:`Loader` over ``mixture``: the one way to build one.

    Options (keyword-only): ``num_workers`` (0), ``pin_memory`` (False), ``prefetch_factor``,
    ``persistent_workers`` (False), ``timeout`` (0) and ``multiprocessing_context`` as for
    ``torch.utils.data.DataLoader``; workers send their batches in groups of up to 8 (see
    :mod:`mixer.runtime.transport`), so ``prefetch_factor`` counts groups and ``timeout`` bounds the wait
    for a group. With ``device`` (``"cuda"``, ``"cuda:N"``, ``"cpu"``) batches arrive on that device
    through :func:`mixer.to_device`, ``device_prefetch`` (2) batches copied ahead; a CUDA device
    turns ``pin_memory`` on. ``stats_window``: batches in the sliding window of
    :meth:`Loader.stats` (and so of :func:`mixer.log_every`). ``sync_stop`` (default None: on when the
    mixture is finite, has several ranks and a process group is initialized) makes every
    data-parallel rank hand out the same number of batches, with one ``all_reduce`` per batch over
    ``sync_group`` (default: the default group). ``sync_end="pad"`` (default): a rank whose stream
    ended first hands out *filler* batches (``batch.filler``; weigh their loss by 0) until every rank
    has ended, so every sample is still delivered exactly once; ``"drop"``: every rank stops with the
    first, and what the others then cannot hand out is dropped. Both are counted in
    :meth:`Loader.sync_report` (see :mod:`mixer.runtime.distributed`). ``sync_timeout`` (600 s): how long a
    rank waits for the others' agreement before it raises :class:`~mixer.errors.MixerError` naming the
    ranks that did not answer (a frozen or dead rank would otherwise hold the others for the process
    group's timeout).
    """
    # The one list of the options is this signature: the loader is set up here, not in a method
    # that would repeat it.
    loader = Loader.__new__(Loader)
    # Batches per DataLoader item (see mixer.runtime.transport). One under an Adaptive schedule: its lag
    # counts the batches readers make ahead as prefetch_factor x num_workers (mixer.runtime.feedback).
    adaptive = isinstance(mixture.schedule, Adaptive)
    group = 1 if adaptive else group_size(mixture.max_batch_elements * np.dtype(mixture.dtype).itemsize)
    loader._pool_options = (num_workers, prefetch_factor, multiprocessing_context, group)
    loader.pool = _slot_pool(mixture, *loader._pool_options)
    loader._setup_delivery(
        mixture,
        num_workers=num_workers,
        in_flight=prefetch_factor,
        persistent=persistent_workers and num_workers > 0,
        forked=loader.pool is not None,
        device=device,
        device_prefetch=device_prefetch,
        stats_window=stats_window,
        sync_stop=sync_stop,
        sync_end=sync_end,
        sync_group=sync_group,
        sync_timeout=sync_timeout,
    )
    pin_memory = pin_memory or (loader.device is not None and loader.device.type == "cuda")
    generator = torch.Generator()
    generator.manual_seed(seed_for(mixture.seed, "dataloader", mixture.rank) % 2**63)
    loader.dataloader = DataLoader(
        _LoaderDataset(mixture, loader.pool, group),
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
        timeout=timeout,
        worker_init_fn=_init_worker if num_workers > 0 else None,
        multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        generator=generator,
    )
    return loader
