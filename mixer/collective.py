"""Collectives that give up: every collective of a :class:`Bounded` carries a timeout, and a rank
that waits past it raises :class:`~mixer.errors.MixerError` naming the collective, how long it waited
and, where the process group's store can tell, the ranks that never reached it.

Used by the rank sync (:class:`mixer.runtime.distributed.StopSync`, one ``all_reduce`` per batch) and by
adaptive mixing's feedback (:mod:`mixer.runtime.feedback`, one ``all_reduce`` per update window), both with
the loader's ``sync_timeout``: a frozen (SIGSTOP, a partition, a hung step) or dead rank would
otherwise hold the others for the process group's timeout (gloo's 30 minutes) and then fail them
with gloo's bare ``RuntimeError``.

How: the operation itself carries the timeout (gloo ends it with an error when it passes, so
nothing is left pending and the process can exit), and the wait for it is bounded too. A rank that
has waited :data:`ARRIVED_AFTER_S` notes its arrival in the store (nothing is written while
collectives complete promptly), and a rank that gives up waits a moment for the others' notes, so
its error can say which ranks never arrived.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from mixer.errors import MixerError

log = logging.getLogger(__name__)

ARRIVED_AFTER_S = 1.0  # a wait this long notes this rank's arrival in the store (never on the fast path)
_instances = itertools.count()  # bounded collective sets made in this process: the same sequence on every rank


class Bounded:
    """Collectives over ``group`` (a CPU-capable group: gloo, mpi, ucc), each bounded by ``timeout``
    seconds; ``label`` starts every error message ("rank sync", "adaptive feedback")."""

    def __init__(self, group: Any, *, timeout: float, label: str) -> None:
        self.group = group
        self.timeout = timeout
        self.label = label
        self._instance = next(_instances)
        self._collectives = 0  # started so far, over every iteration: the same count on every rank

    def all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        """``tensor`` all-reduced in place with ``op``, waited for (bounded by the timeout)."""
        self._wait(self._all_reduce(tensor, op, what))

    def _all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> _Collective:
        """Starts ``all_reduce`` of ``tensor`` (the operation carries the timeout); ``what`` names it in errors."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timedelta(seconds=self.timeout)
        return self._started(what, lambda: self.group.allreduce([tensor], opts))

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
        completed = False  # seen completed after a wait that raised
        while True:
            until = deadline if noted else min(deadline, note_at)
            try:
                c.work.wait(timedelta(seconds=max(until - time.monotonic(), 0.001)))
                if noted is not None:  # all answered after all: the note is not needed any more
                    threading.Thread(
                        target=self._unnote, args=(c.seq, noted), name="mixer-sync-note", daemon=True
                    ).start()
                return
            except RuntimeError as exc:
                # A wait that timed out raises too, and the operation may complete (successfully) between
                # that and the look at it: once completed, the next wait gives its own outcome, an error
                # only if it failed.
                if completed or time.monotonic() >= deadline:
                    raise self._error(c, exc) from exc
                completed = c.work.is_completed()
            if noted is None and time.monotonic() >= note_at:
                # slow: say in the store that this rank got here, for the error of whoever gives up
                noted = threading.Thread(target=self._note, args=(c.seq,), name="mixer-sync-note", daemon=True)
                noted.start()

    def _error(self, c: _Collective, exc: RuntimeError) -> MixerError:
        import torch.distributed as dist

        waited = time.monotonic() - c.started
        size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        silent = self._silent(c.seq, rank, size)
        # A peer that gave up at its own timeout closes its connections a moment before this rank's
        # timer fires, so the backend here may say "connection closed", not "timed out": with a rank
        # that never arrived and about the timeout waited, it is the timeout all the same.
        timed_out = "timed out" in str(exc).lower() or (bool(silent) and waited >= 0.9 * self.timeout)
        if silent is None:
            who = f"one or more of the other {size - 1} rank(s) of the {size} did not answer"
        elif silent:
            who = f"rank(s) {', '.join(map(str, silent))} of the {size} in the group never reached it"
        else:
            who = f"all {size} ranks reached it"
        if timed_out:
            what = f"{c.what} (collective #{c.seq} of this loader) got no answer within sync_timeout={self.timeout:g} s"
            hint = (
                "a rank frozen (stopped, swapped out, partitioned) or busy elsewhere for longer; raise "
                "make_loader(sync_timeout=...) if that is expected"
            )
        else:
            what = f"{c.what} (collective #{c.seq} of this loader) failed"
            hint = "a rank died or its connection broke"
        return MixerError(f"{self.label} on rank {rank}: {what}; waited {waited:.1f} s; {who} ({hint}); backend: {exc}")

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


class _Collective:
    """One started collective of the sync: its work handle, what it is (for errors), its sequence
    number (the same on every rank) and when this rank started it."""

    __slots__ = ("work", "what", "seq", "started")

    def __init__(self, work: Any, what: str, seq: int, started: float) -> None:
        self.work, self.what, self.seq, self.started = work, what, seq, started


def handles_cpu(group: Any) -> bool:
    """Whether ``group``'s backend runs collectives on CPU tensors (gloo, MPI, UCC; not NCCL alone).
    Callers look it up on this module at call time, so a test can stand in an NCCL-only group."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    return any(name in backend for name in ("gloo", "mpi", "ucc"))
