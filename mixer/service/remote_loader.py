"""``make_remote_loader``: a :class:`~mixer.Loader` whose readers are a service's actors.

Everything on the training side is the in-process loader's own code (:class:`mixer.runtime.loader.Loader`):
the round robin over readers, the bookkeeping of each reader's state, ``state_dict()`` /
``load_state_dict()`` (the same format: a state saved by either loader resumes on the other, with
the same number of readers, or on any other through elastic resume), statistics, the device feed,
the rank sync with its fillers and adaptive feedback. Only where the batches come from differs: the
service's reader actors, through :class:`mixer.service.stream.RemoteStream`, instead of DataLoader
workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from mixer.batching.batch import Batch
from mixer.errors import ConfigError
from mixer.mixing.adaptive import Adaptive
from mixer.observe.stats import DEFAULT_WINDOW
from mixer.plan.world import resolve_rank
from mixer.runtime.device import DeviceLike
from mixer.runtime.distributed import DEFAULT_SYNC_TIMEOUT, SyncEnd
from mixer.runtime.feedback import SharesTable
from mixer.runtime.loader import Loader
from mixer.runtime.transport import ungrouped
from mixer.service.connection import count, positive_seconds
from mixer.service.groups import group_limit
from mixer.service.service import MixerService
from mixer.service.stream import RemoteStream
from mixer.state.checkpoint import Resume

#: Seconds a trainer waits for one reader's group (or its start) before it raises MixerError.
DEFAULT_TIMEOUT = 300.0


class RemoteLoader(Loader):
    """A :class:`~mixer.Loader` over a :class:`~mixer.service.MixerService`'s readers for one
    trainer; built by :func:`make_remote_loader` (which documents the options)."""

    def _setup_remote(
        self,
        service: MixerService,
        rank: int,
        *,
        pin_memory: bool,
        device: DeviceLike | None,
        device_prefetch: int,
        stats_window: int,
        sync_stop: bool | None,
        sync_end: SyncEnd,
        sync_group: Any,
        sync_timeout: float,
        timeout: float,
        batches_per_call: int,
        calls_in_flight: int,
    ) -> None:
        self.service = service
        mixture = service.mixture_for(rank)
        readers = service.readers_per_trainer
        # readers_per_trainer=0 is make_loader(num_workers=0): one reader, asked when a batch is needed.
        self._calls_in_flight = calls_in_flight if readers > 0 else 0
        self._setup_delivery(
            mixture,
            num_workers=readers,
            in_flight=self._calls_in_flight if readers > 0 else None,
            persistent=False,
            forked=True,  # the shares reach the readers with each call (mixer.service.stream)
            device=device,
            device_prefetch=device_prefetch,
            stats_window=stats_window,
            sync_stop=sync_stop,
            sync_end=sync_end,
            sync_group=sync_group,
            sync_timeout=sync_timeout,
        )
        self.pin_memory = (pin_memory or (self.device is not None and self.device.type == "cuda")) and (
            torch.cuda.is_available()
        )
        # One batch per call under an Adaptive schedule, as a DataLoader worker sends it: the lag
        # counts calls in flight as DataLoader counts prefetch_factor requests.
        batch_bytes = mixture.max_batch_elements * np.dtype(mixture.dtype).itemsize
        self._limit = 1 if isinstance(mixture.schedule, Adaptive) else group_limit(batches_per_call, batch_bytes)
        self.timeout = timeout
        self._stream: RemoteStream | None = None
        self._report = {"restarts": 0, "calls": 0, "wait_s": 0.0}

    def _open(self, resume: Resume | None, table: SharesTable | None) -> tuple[Iterator[Batch], Callable[[], None]]:
        self._started = True
        stream = self._stream = RemoteStream(
            self.service,
            self.mixture.rank,
            resume=resume,
            table=table,
            limit=self._limit,
            calls_in_flight=self._calls_in_flight,
            timeout=self.timeout,
            pin=self.pin_memory,
        )
        self._report = {"restarts": 0, "calls": 0, "wait_s": 0.0}

        def close() -> None:
            stream.close()
            self._report = self.service_report()

        return ungrouped(stream.groups(), self._readers), close

    def service_report(self) -> dict[str, Any]:
        """The latest pass's transport: ``{"service": name, "readers": n, "restarts": n, "calls": n,
        "wait_s": s}``: readers started again after a failure, calls made to the readers, and the
        seconds this trainer spent waiting for their groups (its stall on the service)."""
        s = self._stream
        counts = self._report if s is None else {"restarts": s.restarts, "calls": s.calls, "wait_s": s.wait_s}
        return {"service": self.service.name, "readers": self._readers, **counts}


def make_remote_loader(
    service: MixerService | str,
    *,
    rank: int | None = None,
    pin_memory: bool = False,
    device: DeviceLike | None = None,
    device_prefetch: int = 2,
    stats_window: int = DEFAULT_WINDOW,
    sync_stop: bool | None = None,
    sync_end: SyncEnd = "pad",
    sync_group: Any = None,
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
    timeout: float = DEFAULT_TIMEOUT,
    batches_per_call: int = 32,
    calls_in_flight: int = 2,
) -> RemoteLoader:
    """A loader for trainer ``rank`` of ``service`` (a :class:`MixerService`, or the name of one
    made by another process of this Ray cluster): the same batches in the same order as
    ``make_loader(mixture, num_workers=service.readers_per_trainer)`` on that rank, and states of
    the same format (see :mod:`mixer.service.remote_loader`).

    ``rank`` (default: the process group's rank, or ``RANK`` under torchrun; its world size must be
    the service's). ``pin_memory``, ``device``, ``device_prefetch``, ``stats_window``, ``sync_stop``,
    ``sync_end``, ``sync_group`` and ``sync_timeout`` as for :func:`mixer.make_loader`. Transport:
    each reader has up to ``calls_in_flight`` (2) calls outstanding, each for a group of up to
    ``batches_per_call`` (32) batches (1 under an :class:`~mixer.Adaptive` schedule), so a reader
    makes at most ``calls_in_flight x batches_per_call`` batches ahead (``readers_per_trainer=0``:
    none in flight, as ``num_workers=0``). ``timeout`` (300 s): the longest wait for one reader's
    group or start before :class:`~mixer.MixerError`; a reader restarted by Ray re-runs up to
    ``state_every`` batches within it."""
    if isinstance(service, str):
        service = MixerService.connect(service)
    if not isinstance(service, MixerService):
        raise ConfigError(f"make_remote_loader: expected a MixerService or its name (got {type(service).__name__})")
    if rank is None:
        rank, world = resolve_rank(None, None)
        if world != service.world_size:
            raise ConfigError(
                f"make_remote_loader: this process is rank {rank} of {world}, but service {service.name!r} serves "
                f"{service.world_size} trainer(s); pass rank= explicitly"
            )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < service.world_size:
        raise ConfigError(f"make_remote_loader: rank must be in [0, {service.world_size}) (got {rank!r})")
    loader = RemoteLoader.__new__(RemoteLoader)
    loader._setup_remote(
        service,
        rank,
        pin_memory=pin_memory,
        device=device,
        device_prefetch=device_prefetch,
        stats_window=stats_window,
        sync_stop=sync_stop,
        sync_end=sync_end,
        sync_group=sync_group,
        sync_timeout=sync_timeout,
        timeout=positive_seconds(timeout, "make_remote_loader timeout"),
        batches_per_call=count(batches_per_call, "make_remote_loader batches_per_call", least=1),
        calls_in_flight=count(calls_in_flight, "make_remote_loader calls_in_flight", least=1),
    )
    return loader
