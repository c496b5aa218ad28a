"""Equal step counts across data-parallel ranks when the stream is finite.

With ``stop="first_exhausted"`` or ``"all_exhausted"`` each rank's stream ends when *its* share of
the data runs out, so ranks naturally end after different numbers of batches; a rank that stops
early leaves the others waiting in the training step's next collective until the process-group
timeout kills the job. :class:`StopSync` makes every rank hand out the same number of batches, in
one of two ways (``make_loader(sync_end=...)``):

* ``"pad"`` (default): every rank hands out *all* of its batches; a rank whose stream ended while
  others still have batches hands out **filler** batches (``batch.filler`` is True: a copy of a real
  batch, to be weighed by 0 in the loss) until every rank has ended. So one pass with
  ``stop="all_exhausted"`` delivers every sample exactly once over all ranks, and every rank takes
  ``max`` over ranks of its own batch count steps; fillers never count as delivered samples (not in
  ``stats()`` counters, not in ``state_dict()``) and are counted in :meth:`StopSync.report`;
* ``"drop"``: every rank stops after the shortest rank's last batch; the batches the other ranks
  still had are *dropped*: never handed out, never counted in the loader's bookkeeping, but read to
  the end of the stream, counted per source in :meth:`StopSync.report` and logged with a warning
  (so such a rank leaves its loop later, by the time it takes to read them).

How the ranks agree:

* before handing out a batch, each rank contributes whether it has one, whether its reading failed
  and (``"pad"``) whether it needs a batch to copy, to one ``all_reduce`` over the data-parallel
  group; the reduction for batch ``k + 1`` is started (``async_op=True``) right before batch ``k``
  is handed out, so it runs during the training step: the rank looks one batch ahead;
* a rank whose stream ended still takes part in every reduction until all agree to stop, so a rank
  with no data at all never hangs;
* a filler copies the last real batch this rank handed out in this iteration; a rank that has none
  (its part of the data was empty, or it resumed from a state saved in its filler phase) receives
  one copy of the next batch of the lowest rank that has one (one ``broadcast_object_list``, once);
  so fillers' contents are not reproduced by a resume, only their number and position are;
* when one rank's reading fails, every rank stops: the failing rank re-raises its error and the
  others raise :class:`~mixer.errors.MixerError` instead of waiting for a batch that never comes.

The reduction runs over a CPU tensor: on the group itself when its backend handles CPU tensors
(gloo, or ``"cpu:gloo,cuda:nccl"``), else on a gloo group over the same ranks created once when the
loader is built (a collective among them), so it never touches the GPU stream.

How long a rank waits (``make_loader(sync_timeout=...)``, default 600 s, NCCL's default collective
timeout, so the sync never gives up before a training step's own collectives would): every
collective of the sync carries that timeout itself (gloo ends the operation with an error when it
passes, so nothing is left pending and the process can exit), and the wait for it is bounded too.
A rank that froze (SIGSTOP, a partition, a hung step) or died (its connections closed) then makes
the others raise :class:`~mixer.errors.MixerError` naming the collective, how long this rank waited
and, where the process group's store can tell, the ranks that never reached the collective: a rank
that has waited ``ARRIVED_AFTER_S`` notes its arrival in the store (nothing is written while
collectives complete promptly), and a rank that gives up waits a moment for the others' notes. The
error replaces the 30 minutes of gloo's default timeout and gloo's bare ``RuntimeError``.

DataLoader workers forked after the process group was made inherit its sockets, so a killed rank's
connections stay open until its workers end too; their parent-death watchdog ends them within
``mixer.loader.PARENT_POLL_S`` (0.2 s), which bounds that delay. They are not closed in the worker:
an inherited descriptor's number is still owned by objects copied with the process, and closing it
would let a later file reuse a number that those objects then close.
"""

from __future__ import annotations

import itertools
import logging
import math
import pickle
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from .errors import ConfigError, MixerError

if TYPE_CHECKING:
    from .batch import Batch
    from .mixture import Mixture

log = logging.getLogger(__name__)

HAVE, ENDED, FAILED = 1, 0, -1
SyncEnd = Literal["pad", "drop"]
SYNC_ENDS = ("pad", "drop")
DEFAULT_SYNC_TIMEOUT = 600.0
ARRIVED_AFTER_S = 1.0  # a wait this long notes this rank's arrival in the store (never on the fast path)
_instances = itertools.count()  # loaders built in this process: the same sequence on every rank


def stop_sync(
    mixture: Mixture,
    *,
    sync_stop: bool | None = None,
    sync_end: SyncEnd = "pad",
    sync_group: Any = None,
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
) -> StopSync | None:
    """The :class:`StopSync` a loader over ``mixture`` needs, or None.

    ``sync_stop=None`` (default): on when the mixture is finite (``stop != "never"``), has more than
    one rank and a process group is initialized. ``True``: the same, but a missing process group is
    an error. ``False``: off (each rank ends with its own stream). ``sync_end``: ``"pad"`` (the ranks
    that end first hand out fillers) or ``"drop"`` (all stop with the first; see the module
    docstring). ``sync_group``: the data-parallel group (default: the default group); its size and
    this process's rank in it must match the mixture's ``world_size`` and ``rank``. ``sync_timeout``:
    seconds one agreement may take before :class:`~mixer.errors.MixerError` (see the module docstring).
    """
    if sync_stop is not None and not isinstance(sync_stop, bool):
        raise ConfigError(f"sync_stop must be True, False or None (got {sync_stop!r})")
    if sync_end not in SYNC_ENDS:
        raise ConfigError(f"sync_end must be one of {SYNC_ENDS} (got {sync_end!r})")
    if isinstance(sync_timeout, bool) or not isinstance(sync_timeout, (int, float)) or not (0 < sync_timeout < math.inf):
        raise ConfigError(f"sync_timeout must be a number of seconds > 0 and finite (got {sync_timeout!r})")
    if sync_stop is False or mixture.stop == "never" or mixture.world_size == 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if sync_stop:
            raise ConfigError(
                f"sync_stop=True needs an initialized torch.distributed process group (mixture rank "
                f"{mixture.rank} of {mixture.world_size}); call torch.distributed.init_process_group first"
            )
        return None
    group = sync_group if sync_group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (rank, size) != (mixture.rank, mixture.world_size):
        raise ConfigError(
            f"sync_stop: the mixture is rank {mixture.rank} of {mixture.world_size} but this process is rank {rank} "
            f"of {size} in the {'given sync_group' if sync_group is not None else 'default process group'}; pass "
            "make_loader(..., sync_group=<the data-parallel group>) (the dp_group given to the Mixture), or sync_stop=False"
        )
    if not _handles_cpu(group):
        group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
    return StopSync(group, mixture.names, end=sync_end, timeout=float(sync_timeout))


def _flag(pending: Batch | None, error: Exception | None) -> int:
    return FAILED if error is not None else ENDED if pending is None else HAVE


def _handles_cpu(group: Any) -> bool:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    return any(name in backend for name in ("gloo", "mpi", "ucc"))


class StopSync:
    """Hands out batches so that every rank of ``group`` hands out the same number (see the module
    docstring); :meth:`report` counts the fillers handed out or the batches dropped."""

    def __init__(self, group: Any, names: tuple[str, ...], *, end: SyncEnd = "pad", timeout: float = DEFAULT_SYNC_TIMEOUT) -> None:
        self.group = group
        self.names = names
        self.end: SyncEnd = end
        self.timeout = timeout
        self._instance = next(_instances)
        self._collectives = 0  # started so far, over every iteration: the same count on every rank
        self.reset()

    def reset(self) -> None:
        self.fillers = 0
        self.dropped_batches = 0
        self._dropped = np.zeros((len(self.names), 2), dtype=np.int64)  # samples, tokens

    def report(self) -> dict[str, Any]:
        """How the latest pass was evened out on this rank: ``{"sync_end": "pad" | "drop", "fillers": n,
        "dropped": {"batches": n, "sources": {name: {"samples": n, "tokens": n}}}}``: filler batches
        handed out (``"pad"``), batches read after the ranks agreed to stop (``"drop"``)."""
        return {
            "sync_end": self.end,
            "fillers": self.fillers,
            "dropped": {
                "batches": self.dropped_batches,
                "sources": {n: {"samples": int(s), "tokens": int(t)} for n, (s, t) in zip(self.names, self._dropped.tolist())},
            },
        }

    def agreed(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        self.reset()
        return self._padded(iter(batches)) if self.end == "pad" else self._dropping(iter(batches))

    # ---- "drop": stop with the first rank that ends ------------------------------------------

    def _dropping(self, it: Iterator[Batch]) -> Iterator[Batch]:
        import torch.distributed as dist

        flag = torch.zeros(1, dtype=torch.int32)

        def post(value: int) -> _Collective:
            flag.fill_(value)
            return self._all_reduce(flag, dist.ReduceOp.MIN)

        pending, error = self._fetch(it)
        work = post(_flag(pending, error))
        if error is not None:
            self._finish(work, error)
        while True:
            self._wait(work)
            agreed = int(flag.item())
            if agreed == FAILED:
                raise _other_failed()
            if agreed == ENDED:
                break
            batch = pending
            pending, error = self._fetch(it)
            work = post(_flag(pending, error))
            yield batch  # type: ignore[misc]
            if error is not None:
                # every rank handed out the same batches so far; now all of them stop
                self._finish(work, error)
        self._drain(pending, it)

    # ---- "pad": go on with fillers until the last rank ends ----------------------------------

    def _padded(self, it: Iterator[Batch]) -> Iterator[Batch]:
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        # One all_reduce(MAX) per batch over [has a batch, failed, needs a batch to copy, -(rank if it
        # has a batch else world)]: the last gives the lowest rank with a batch, the copy's source.
        flags = torch.zeros(4, dtype=torch.int64)
        template: Batch | None = None  # the last real batch handed out: what fillers copy

        def post(pending: Batch | None, error: Exception | None) -> _Collective:
            flags[0] = int(pending is not None)
            flags[1] = int(error is not None)
            flags[2] = int(pending is None and template is None)
            flags[3] = -rank if pending is not None else -world
            return self._all_reduce(flags, dist.ReduceOp.MAX)

        pending, error = self._fetch(it)
        work = post(pending, error)
        if error is not None:
            self._finish(work, error)
        while True:
            self._wait(work)
            have, failed, need, source = flags.tolist()
            if failed:
                raise _other_failed()
            if not have:
                break
            if need:  # some rank has no batch to copy: the lowest rank with one sends it
                sent = self._broadcast_object(pending if rank == -source else None, -source)
                if template is None and pending is None:
                    template = sent
            if pending is not None:
                batch = template = pending
                pending, error = self._fetch(it)
            else:
                assert template is not None
                batch = template.as_filler()
                self.fillers += 1
            work = post(pending, error)
            yield batch
            if error is not None:
                self._finish(work, error)
        if self.fillers:
            log.info(
                "equal step counts across ranks: this rank's stream ended first, so it handed out %d filler batch(es) "
                "(batch.filler is True: weigh their loss by 0) while the other ranks finished theirs", self.fillers,
            )

    # ---- bounded collectives ----------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> _Collective:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timedelta(seconds=self.timeout)
        return self._started("the all_reduce that agrees on the next batch", lambda: self.group.allreduce([tensor], opts))

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` from group rank ``src`` to every rank (pickled, as ``broadcast_object_list``
        does), each of the two broadcasts bounded by the timeout."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = timedelta(seconds=self.timeout)
        what = f"the broadcast of a batch to copy as filler from rank {src}"
        mine = dist.get_rank(self.group) == src
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        self._wait(self._started(what, lambda: self.group.broadcast([size], opts)))
        buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self._started(what, lambda: self.group.broadcast([buf], opts)))
        return obj if mine else pickle.loads(buf.numpy().tobytes())

    def _started(self, what: str, start: Any) -> _Collective:
        self._collectives += 1
        seq, t0 = self._collectives, time.monotonic()
        try:
            return _Collective(start(), what, seq, t0)
        except RuntimeError as exc:  # a peer already known to be gone
            raise self._error(_Collective(None, what, seq, t0), exc) from exc

    def _wait(self, c: _Collective) -> None:
        """Waits for ``c`` to complete, at most the timeout after it started (the operation's own
        timeout normally ends it first, with an error)."""
        deadline = c.started + self.timeout + 1.0
        note_at = c.started + ARRIVED_AFTER_S
        noted: threading.Thread | None = None
        while True:
            until = deadline if noted else min(deadline, note_at)
            try:
                c.work.wait(timedelta(seconds=max(until - time.monotonic(), 0.001)))
                if noted is not None:  # all answered after all: the note is not needed any more
                    threading.Thread(target=self._unnote, args=(c.seq, noted), name="mixer-sync-note", daemon=True).start()
                return
            except RuntimeError as exc:
                if c.work.is_completed() or time.monotonic() >= deadline:
                    raise self._error(c, exc) from exc
            if noted is None and time.monotonic() >= note_at:
                # slow: say in the store that this rank got here, for the error of whoever gives up
                noted = threading.Thread(target=self._note, args=(c.seq,), name="mixer-sync-note", daemon=True)
                noted.start()

    def _finish(self, c: _Collective, error: Exception) -> None:
        """This rank's own reading failed: let the others know (they raise their MixerError), then
        re-raise the reading error, never masked by a failure of the sync itself."""
        try:
            self._wait(c)
        except MixerError as exc:
            log.warning("while stopping after a reading error on this rank: %s", exc)
        raise error

    def _error(self, c: _Collective, exc: RuntimeError) -> MixerError:
        import torch.distributed as dist

        waited = time.monotonic() - c.started
        size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        timed_out = "timed out" in str(exc).lower()
        silent = self._silent(c.seq, rank, size)
        if silent is None:
            who = f"one or more of the other {size - 1} rank(s) of the {size} did not answer"
        elif silent:
            who = f"rank(s) {', '.join(map(str, silent))} of the {size} in the group never reached it"
        else:
            who = f"all {size} ranks reached it"
        if timed_out:
            what = f"{c.what} (collective #{c.seq} of this loader) got no answer within sync_timeout={self.timeout:g} s"
            hint = "a rank frozen (stopped, swapped out, partitioned) or busy elsewhere for longer; raise make_loader(sync_timeout=...) if that is expected"
        else:
            what = f"{c.what} (collective #{c.seq} of this loader) failed"
            hint = "a rank died or its connection broke"
        return MixerError(f"rank sync on rank {rank}: {what}; waited {waited:.1f} s; {who} ({hint}); backend: {exc}")

    def _key(self, seq: int, rank: int) -> str:
        return f"mixer-sync/{self._instance}/{seq}/{rank}"

    def _store(self) -> Any:
        try:
            return self.group.get_group_store()
        except (AttributeError, RuntimeError):
            return None

    def _note(self, seq: int) -> None:
        import torch.distributed as dist

        store = self._store()
        if store is not None:
            try:
                store.set(self._key(seq, dist.get_rank(self.group)), "1")
            except Exception:  # the store is best effort: the error says less, nothing else changes
                log.debug("mixer sync: could not note the arrival at collective %d in the store", seq, exc_info=True)

    def _unnote(self, seq: int, noting: threading.Thread) -> None:
        import torch.distributed as dist

        noting.join()
        store = self._store()
        if store is not None:
            try:
                store.delete_key(self._key(seq, dist.get_rank(self.group)))
            except Exception:  # best effort, as in _note
                log.debug("mixer sync: could not remove the note of collective %d from the store", seq, exc_info=True)

    def _silent(self, seq: int, rank: int, size: int) -> list[int] | None:
        """The ranks that never noted their arrival at collective ``seq``, or None when the store
        cannot tell. Every rank still waiting has noted it within ``ARRIVED_AFTER_S``, so this waits
        a little longer than that; a store that does not answer in time tells nothing."""
        store = self._store()
        if store is None:
            return None
        found: list[list[int]] = []

        def ask() -> None:
            self._note(seq)
            deadline = time.monotonic() + ARRIVED_AFTER_S + 0.5
            missing = [r for r in range(size) if r != rank]
            try:
                while True:
                    missing = [r for r in missing if not store.check([self._key(seq, r)])]
                    if not missing or time.monotonic() >= deadline:
                        break
                    time.sleep(0.05)
            except Exception:  # best effort, as in _note
                log.debug("mixer sync: could not ask the store who reached collective %d", seq, exc_info=True)
                return
            found.append(missing)

        asking = threading.Thread(target=ask, name="mixer-sync-ask", daemon=True)
        asking.start()
        asking.join(ARRIVED_AFTER_S + 3.0)
        return found[0] if found else None

    @staticmethod
    def _fetch(it: Iterator[Batch]) -> tuple[Batch | None, Exception | None]:
        try:
            return next(it, None), None
        except Exception as exc:
            return None, exc

    def _drain(self, pending: Batch | None, it: Iterator[Batch]) -> None:
        while pending is not None:
            self.dropped_batches += 1
            source = pending.source.cpu().numpy().astype(np.int64)
            lengths = pending.lengths.cpu().numpy().astype(np.int64)
            n = len(self.names)
            self._dropped[:, 0] += np.bincount(source, minlength=n)
            self._dropped[:, 1] += np.bincount(source, weights=lengths, minlength=n).astype(np.int64)
            pending = next(it, None)
        if self.dropped_batches:
            d = self._dropped
            log.warning(
                "equal batch counts across ranks (sync_end='drop'): another rank's stream ended first, so this rank "
                "dropped its last %d batch(es) (%d samples, %d tokens; per source: %s)",
                self.dropped_batches, int(d[:, 0].sum()), int(d[:, 1].sum()),
                ", ".join(f"{name} {int(s)}" for name, s in zip(self.names, d[:, 0]) if s),
            )


class _Collective:
    """One started collective of the sync: its work handle, what it is (for errors), its sequence
    number (the same on every rank) and when this rank started it."""

    __slots__ = ("work", "what", "seq", "started")

    def __init__(self, work: Any, what: str, seq: int, started: float) -> None:
        self.work, self.what, self.seq, self.started = work, what, seq, started


def _other_failed() -> MixerError:
    return MixerError("another data-parallel rank failed while reading its data; stopping this rank too (see that rank's error)")
