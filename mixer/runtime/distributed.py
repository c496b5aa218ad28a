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
and, where the process group's store can tell, the ranks that never reached the collective (see
:mod:`mixer.collective`, which adaptive mixing's feedback all-reduce uses too). The error replaces
the 30 minutes of gloo's default timeout and gloo's bare ``RuntimeError``.

DataLoader workers forked after the process group was made inherit its sockets, so a killed rank's
connections stay open until its workers end too; their parent-death watchdog ends them within
``mixer.runtime.loader.PARENT_POLL_S`` (0.2 s), which bounds that delay. They are not closed in the worker:
an inherited descriptor's number is still owned by objects copied with the process, and closing it
would let a later file reuse a number that those objects then close.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from mixer import collective
from mixer.collective import ARRIVED_AFTER_S, Bounded, _Collective  # noqa: F401 (ARRIVED_AFTER_S: documented here)
from mixer.errors import ConfigError, MixerError

if TYPE_CHECKING:
    from mixer.batching.batch import Batch
    from mixer.mixing.mixture import Mixture

log = logging.getLogger(__name__)

HAVE, ENDED, FAILED = 1, 0, -1
SyncEnd = Literal["pad", "drop"]
SYNC_ENDS = ("pad", "drop")
DEFAULT_SYNC_TIMEOUT = 600.0
AGREE = "the all_reduce that agrees on the next batch"


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
    if (
        isinstance(sync_timeout, bool)
        or not isinstance(sync_timeout, (int, float))
        or not (0 < sync_timeout < math.inf)
    ):
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
            "make_loader(..., sync_group=<the data-parallel group>) (the dp_group given to the Mixture), or "
            "sync_stop=False"
        )
    if not collective.handles_cpu(group):
        group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
    return StopSync(group, mixture.names, end=sync_end, timeout=float(sync_timeout))


def max_over_ranks(
    mixture: Mixture, *, group: Any = None, timeout: float = DEFAULT_SYNC_TIMEOUT
) -> Callable[[np.ndarray], np.ndarray] | None:
    """An elastic resume's agreement (:data:`mixer.mixing.elastic.Agree`): the elementwise max of a few
    integers over the mixture's ranks, one bounded ``all_reduce`` over ``group`` (default: the default
    group; a gloo group over the same ranks when its backend has no CPU collectives). None when the
    mixture has one rank or no process group of its ranks is initialized: the resume then reads every
    saved state for those integers."""
    if mixture.world_size == 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    if (dist.get_rank(group), dist.get_world_size(group)) != (mixture.rank, mixture.world_size):
        log.warning(
            "elastic resume: the mixture is rank %d of %d but this process is rank %d of %d in the %s; each rank "
            "reads every saved state (pass make_loader(sync_group=<the data-parallel group>) to agree over it)",
            mixture.rank,
            mixture.world_size,
            dist.get_rank(group),
            dist.get_world_size(group),
            "given sync_group" if group is not dist.group.WORLD else "default process group",
        )
        return None

    def agree(values: np.ndarray) -> np.ndarray:
        cpu = (
            group
            if collective.handles_cpu(group)
            else dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        )
        t = torch.from_numpy(np.array(values, dtype=np.int64))
        Bounded(cpu, timeout=float(timeout), label="elastic resume").all_reduce(
            t, dist.ReduceOp.MAX, "the all_reduce that agrees on the saved run's step and last epochs"
        )
        return t.numpy()

    return agree


def _flag(pending: Batch | None, error: Exception | None) -> int:
    return FAILED if error is not None else ENDED if pending is None else HAVE


class StopSync(Bounded):
    """Hands out batches so that every rank of ``group`` hands out the same number (see the module
    docstring); :meth:`report` counts the fillers handed out or the batches dropped."""

    def __init__(
        self, group: Any, names: tuple[str, ...], *, end: SyncEnd = "pad", timeout: float = DEFAULT_SYNC_TIMEOUT
    ) -> None:
        super().__init__(group, timeout=timeout, label="rank sync")
        self.names = names
        self.end: SyncEnd = end
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
                "sources": {
                    n: {"samples": int(s), "tokens": int(t)} for n, (s, t) in zip(self.names, self._dropped.tolist())
                },
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
            return self._all_reduce(flag, dist.ReduceOp.MIN, AGREE)

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
            return self._all_reduce(flags, dist.ReduceOp.MAX, AGREE)

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
                "(batch.filler is True: weigh their loss by 0) while the other ranks finished theirs",
                self.fillers,
            )

    def _finish(self, c: _Collective, error: Exception) -> None:
        """This rank's own reading failed: let the others know (they raise their MixerError), then
        re-raise the reading error, never masked by a failure of the sync itself."""
        try:
            self._wait(c)
        except MixerError as exc:
            log.warning("while stopping after a reading error on this rank: %s", exc)
        raise error

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
                self.dropped_batches,
                int(d[:, 0].sum()),
                int(d[:, 1].sum()),
                ", ".join(f"{name} {int(s)}" for name, s in zip(self.names, d[:, 0]) if s),
            )


def _other_failed() -> MixerError:
    return MixerError(
        "another data-parallel rank failed while reading its data; stopping this rank too (see that rank's error)"
    )
