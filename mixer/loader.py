"""``make_loader``: a DataLoader over a Mixture, with deterministic worker seeding and bookkeeping.

The main process keeps what the last batch from each worker carried (its counters), so statistics
need no extra IPC: they ride along with the batches.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .batch import Batch
from .mixture import Mixture
from .source import Counters
from .world import seed_for


def _seed_worker_globals(worker_id: int) -> None:
    """Seed the global RNGs inside each worker from the worker's own torch seed, so that user code
    (a custom ``decode``) that uses them is reproducible; mixer itself never uses them."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


class Loader:
    """Iterates ``Batch`` objects from a ``Mixture`` through ``torch.utils.data.DataLoader``
    (``batch_size=None``: the mixture already batches). Batches arrive in order: worker ``w`` of
    ``W`` delivers global steps ``w, w + W, ...``."""

    def __init__(
        self,
        mixture: Mixture,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        timeout: float = 0,
        multiprocessing_context: Any = None,
    ) -> None:
        self.mixture = mixture
        self.num_workers = num_workers
        generator = torch.Generator()
        generator.manual_seed(seed_for(mixture.seed, "dataloader", mixture.rank) % 2**63)
        self.dataloader = DataLoader(
            mixture,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=persistent_workers and num_workers > 0,
            timeout=timeout,
            worker_init_fn=_seed_worker_globals if num_workers > 0 else None,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            generator=generator,
        )
        self._last_counters: dict[int, list[list[int]]] = {}
        self.batches = 0

    def __iter__(self) -> Iterator[Batch]:
        self._last_counters = {}
        self.batches = 0
        for batch in self.dataloader:
            self._last_counters[batch.info["worker"]] = batch.info["counters"]
            self.batches += 1
            yield batch

    def counters(self) -> dict[str, dict[str, int]]:
        """Cumulative per-source counters summed over the workers, as of the last batch handed out."""
        n = len(self.mixture.sources)
        total = np.zeros((n, len(Counters.FIELDS)), dtype=np.int64)
        for rows in self._last_counters.values():
            total += np.asarray(rows, dtype=np.int64)
        return {name: dict(zip(Counters.FIELDS, map(int, row))) for name, row in zip(self.mixture.names, total)}


def make_loader(
    mixture: Mixture,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    timeout: float = 0,
    multiprocessing_context: Any = None,
) -> Loader:
    """A :class:`Loader` over ``mixture``."""
    return Loader(
        mixture,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
        timeout=timeout,
        multiprocessing_context=multiprocessing_context,
    )
