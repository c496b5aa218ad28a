"""One mixer reader in a Ray actor: the reader a DataLoader worker would run, run elsewhere.

A reader's batches are a pure function of its place (:class:`mixer.plan.world.World`), the mixture
and its state, so the actor holds nothing to checkpoint: its trainer tells it where to start
(``start``: a place and a reader state, the format of a loader state's entry) and asks for groups
of batches (``take``). Every call carries the trainer's *token* for the current start; a call with
another token (sent before a restart of the actor, or by a trainer that has since started again)
makes no batch and returns :data:`STALE`, so that a reader restarted by Ray, which comes back
without a reader, never hands out batches of an unknown position.

The actor also keeps the service's description (the mixture as the process that made the service
pickled it, and its shape), so that a process that connects by name learns everything from reader
``0`` of trainer ``0`` (see :mod:`mixer.service.service`).
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from mixer.batching.batch import Batch
from mixer.errors import MixerError
from mixer.mixing.mixture import Mixture
from mixer.plan.world import World
from mixer.runtime.feedback import SharesTable
from mixer.service.groups import GroupBuffer, pack

#: What ``take`` returns for a call whose token is not the current start's.
STALE = "stale"

#: ``(n, update_every, lag, capacity, first, rows)``: an adaptive shares table to replicate.
SharesInit = tuple[int, int, int, int, int, list[list[float]]]


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (Ray sends it back to the trainer), else a MixerError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return MixerError(f"{type(exc).__name__}: {exc}")


class ReaderActor:
    """The class behind every reader actor (made a Ray actor by :class:`mixer.service.MixerService`)."""

    def __init__(self, blob: bytes, shape: dict[str, Any]) -> None:
        self.blob = blob
        self.shape = dict(shape)
        self.mixture: Mixture = pickle.loads(blob)
        self.group = GroupBuffer(np.dtype(self.mixture.dtype))
        self.token: Any = None
        self.batches: Any = None
        self.table: SharesTable | None = None

    def describe(self) -> dict[str, Any]:
        """Where this actor runs (its process id, for tests and diagnostics) and the service's shape."""
        return {"pid": os.getpid(), **self.shape}

    def service(self) -> tuple[bytes, dict[str, Any]]:
        """The pickled mixture and the service's shape (what a process connecting by name needs)."""
        return self.blob, dict(self.shape)

    def set_shape(self, shape: dict[str, Any]) -> None:
        self.shape = dict(shape)

    def start(
        self,
        token: Any,
        world: tuple[int, int, int, int],
        state: dict[str, Any] | None,
        shares: SharesInit | None,
    ) -> int:
        """Run the reader at ``world`` (rank, world_size, worker, num_workers) from ``state`` (None:
        the start of its stream) for calls carrying ``token``; returns this process's id."""
        self.token = self.batches = None
        rank, world_size, worker, num_workers = world
        place = World(rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)
        self.table = None
        if shares is not None:
            n, update_every, lag, capacity, first, rows = shares
            self.table = SharesTable(n, update_every=update_every, lag=lag, capacity=capacity)
            self.table.extend(first, rows)
        reader = self.mixture.open_reader(place, pool=self.group, table=self.table, state=state)
        self.batches = iter(reader)
        self.token = token
        return os.getpid()

    def take(self, token: Any, limit: int, shares: tuple[int, Sequence[Sequence[float]]] | None) -> Any:
        """Up to ``limit`` batches: ``(buffer, entries, last, error, traceback)``; ``last``: the stream
        ended; ``error``: what the reader raised after the batches made before it (then it is done)."""
        if token != self.token:
            return STALE
        if self.batches is None:  # this start's stream ended (or failed): nothing more, as DataLoader would
            return self.group.buffer[:0], [], True, None, None
        if shares is not None and self.table is not None:
            self.table.extend(*shares)
        self.group.reset(limit * self.mixture.max_batch_elements)
        made: list[Batch] = []
        last, error, where = False, None, None
        try:
            for _ in range(limit):
                made.append(next(self.batches))
        except StopIteration:
            last = True
        except Exception as exc:
            error, where = _sendable(exc), traceback.format_exc()
        if last or error is not None:
            self.batches = None
        data, entries = pack(made, self.group)
        return data, entries, last, error, where

    def release(self, token: Any) -> None:
        """The trainer left this start: close the reader (its open shards) if it is still the current one."""
        if token == self.token:
            self.token = self.batches = None
