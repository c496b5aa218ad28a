"""Equal batch counts across data-parallel ranks when the stream is finite.

With ``stop="first_exhausted"`` or ``"all_exhausted"`` each rank's stream ends when *its* share of
the data runs out, so ranks naturally end after different numbers of batches; a rank that stops
early leaves the others waiting in the training step's next collective until the process-group
timeout kills the job. :class:`StopSync` makes every rank hand out the same number of batches:

* before handing out a batch, each rank contributes 1 ("I have one"), 0 ("my stream ended") or -1
  ("reading failed here") to an ``all_reduce(MIN)`` over the data-parallel group; the batch is
  handed out only when the minimum is 1, so all ranks stop together, after the same batch;
* the reduction for batch ``k + 1`` is started (``async_op=True``) right before batch ``k`` is
  handed out, so it runs during the training step: the rank looks one batch ahead;
* a rank whose stream ended still takes part in every reduction until all agree to stop, so a rank
  with no data at all yields nothing and returns at once, and never hangs;
* the batches the other ranks still had are *dropped*: never handed out, never counted in the
  loader's bookkeeping (its ``state_dict()`` stays that of the last batch handed out), but read to
  the end of the stream, counted per source (:meth:`StopSync.dropped`) and logged with a warning
  (so such a rank leaves its loop later, by the time it takes to read them: never silent, bounded
  by how unevenly the ranks' shares end);
* when one rank's reading fails, every rank stops: the failing rank re-raises its error and the
  others raise :class:`~mixer.errors.MixerError` instead of waiting for a batch that never comes.

The reduction runs over a CPU tensor: on the group itself when its backend handles CPU tensors
(gloo, or ``"cpu:gloo,cuda:nccl"``), else on a gloo group over the same ranks created once when the
loader is built (a collective among them), so it never touches the GPU stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import ConfigError, MixerError

if TYPE_CHECKING:
    from .batch import Batch
    from .mixture import Mixture

log = logging.getLogger(__name__)

HAVE, ENDED, FAILED = 1, 0, -1


def stop_sync(mixture: Mixture, *, sync_stop: bool | None = None, sync_group: Any = None) -> StopSync | None:
    """The :class:`StopSync` a loader over ``mixture`` needs, or None.

    ``sync_stop=None`` (default): on when the mixture is finite (``stop != "never"``), has more than
    one rank and a process group is initialized. ``True``: the same, but a missing process group is
    an error. ``False``: off (each rank ends with its own stream). ``sync_group``: the data-parallel
    group (default: the default group); its size and this process's rank in it must match the
    mixture's ``world_size`` and ``rank``.
    """
    if sync_stop is not None and not isinstance(sync_stop, bool):
        raise ConfigError(f"sync_stop must be True, False or None (got {sync_stop!r})")
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
    return StopSync(group, mixture.names)


def _flag(pending: Batch | None, error: Exception | None) -> int:
    return FAILED if error is not None else ENDED if pending is None else HAVE


def _handles_cpu(group: Any) -> bool:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    return any(name in backend for name in ("gloo", "mpi", "ucc"))


class StopSync:
    """Hands out batches only while every rank of ``group`` has one (see the module docstring);
    :meth:`dropped` counts what this rank read but could not hand out."""

    def __init__(self, group: Any, names: tuple[str, ...]) -> None:
        self.group = group
        self.names = names
        self.reset()

    def reset(self) -> None:
        self.dropped_batches = 0
        self._dropped = np.zeros((len(self.names), 2), dtype=np.int64)  # samples, tokens

    def dropped(self) -> dict[str, Any]:
        """What this rank read after the ranks agreed to stop, in the latest pass:
        ``{"batches": n, "sources": {name: {"samples": n, "tokens": n}}}``."""
        return {
            "batches": self.dropped_batches,
            "sources": {n: {"samples": int(s), "tokens": int(t)} for n, (s, t) in zip(self.names, self._dropped.tolist())},
        }

    def agreed(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        import torch.distributed as dist

        self.reset()
        flag = torch.zeros(1, dtype=torch.int32)

        def post(value: int) -> Any:
            flag.fill_(value)
            return dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

        it = iter(batches)
        pending, error = self._fetch(it)
        work = post(_flag(pending, error))
        if error is not None:
            work.wait()
            raise error
        while True:
            work.wait()
            agreed = int(flag.item())
            if agreed == FAILED:
                raise MixerError("another data-parallel rank failed while reading its data; stopping this rank too (see that rank's error)")
            if agreed == ENDED:
                break
            batch = pending
            pending, error = self._fetch(it)
            work = post(_flag(pending, error))
            yield batch  # type: ignore[misc]
            if error is not None:
                # every rank handed out the same batches so far; now all of them stop
                work.wait()
                raise error
        self._drain(pending, it)

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
                "equal batch counts across ranks: another rank's stream ended first, so this rank dropped its last %d "
                "batch(es) (%d samples, %d tokens; per source: %s)",
                self.dropped_batches, int(d[:, 0].sum()), int(d[:, 1].sum()),
                ", ".join(f"{name} {int(s)}" for name, s in zip(self.names, d[:, 0]) if s),
            )
