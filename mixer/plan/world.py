"""Who is reading: the data-parallel rank, the DataLoader worker, and seeds derived from them."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixer import _native
from mixer.errors import ConfigError, StateError
from mixer.state.checkpoint import expect_keys


@dataclass(frozen=True, kw_only=True)
class World:
    """One reader's place: data-parallel ``rank`` of ``world_size``, DataLoader ``worker`` of ``num_workers``.

    ``num_workers`` is the DataLoader's count, where 0 (reading in the main process) counts as one reader.
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, world_size): got rank={self.rank}, world_size={self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ConfigError(
                f"worker must be in [0, num_workers): got worker={self.worker}, num_workers={self.num_workers}"
            )

    @property
    def readers(self) -> int:
        """Readers over all ranks and workers; every sample of a source-epoch goes to exactly one of them."""
        return self.world_size * self.num_workers

    @property
    def reader(self) -> int:
        """This reader's index in ``range(readers)``."""
        return self.rank * self.num_workers + self.worker


def resolve_rank(rank: int | None, world_size: int | None, dp_group: Any = None) -> tuple[int, int]:
    """The data-parallel rank and size: explicit values, else ``dp_group``, else the default process
    group if initialized, else the ``RANK``/``WORLD_SIZE`` environment (torchrun), else 0/1.

    Tensor- and pipeline-parallel peers must pass their data-parallel group (or explicit values) so
    that they receive identical data.
    """
    if (rank is None) != (world_size is None):
        raise ConfigError(f"rank and world_size must be given together (got rank={rank}, world_size={world_size})")
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    import torch.distributed as dist

    if dp_group is not None:
        return dist.get_rank(dp_group), dist.get_world_size(dp_group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def worker_place() -> tuple[int, int]:
    """(worker id, worker count) of the current DataLoader worker; (0, 1) in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return 0, 1
    return info.id, info.num_workers


def seed_for(*parts: object) -> int:
    """A 64-bit seed from any parts (seed, epoch, rank, worker, purpose...), stable across processes,
    platforms and Python versions (unlike ``hash``), so every reader derives the same numbers."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def rng_for(*parts: object) -> np.random.Generator:
    """A private generator seeded by :func:`seed_for`; never the global RNGs."""
    return np.random.Generator(np.random.PCG64(seed_for(*parts)))


_take: Any = _native.loops.take if _native.loops is not None else None  # None: the same lines in Python

NATIVE: bool = _take is not None
"""Whether `Draws.take` swaps in C (`mixer/_native/_loops.c`); False: the same lines in Python."""


class Draws:
    """Uniform draws in [0, 1) from a private PCG64 generator, handed out one at a time from blocks.

    A scalar numpy draw costs ~10x reading a float from a list, and shuffle buffers draw once per
    sample, so draws come in blocks of ``BLOCK``. Each double takes exactly one 64-bit output of
    PCG64, so the whole state is :attr:`taken`, the number of draws handed out: a restore seeds the
    same generator (a Draws is always built from the same parts), jumps to the current block with
    PCG64's ``advance`` (O(log n), not a replay) and redraws it."""

    BLOCK = 256

    def __init__(self, *parts: object) -> None:
        self._seed = seed_for(*parts)
        self._gen = np.random.Generator(np.random.PCG64(self._seed))
        self._blocks = 0  # blocks drawn so far
        self._refill()

    def _refill(self) -> None:
        self._block: list[float] = self._gen.random(self.BLOCK).tolist()
        self._blocks += 1
        self._pos = 0

    def random(self) -> float:
        if self._pos == self.BLOCK:
            self._refill()
        x = self._block[self._pos]
        self._pos += 1
        return x

    def take(self, items: list[Any]) -> Any:
        """Remove an item of ``items`` drawn uniformly with one draw, the last taking its place, and
        return it (a shuffle buffer's pop, once per sample: `random` inlined; the swap in C)."""
        pos = self._pos
        if pos == self.BLOCK:
            self._refill()
            pos = 0
        self._pos = pos + 1
        if NATIVE:
            return _take(items, self._block[pos])
        j = int(self._block[pos] * len(items))
        out = items[j]
        items[j] = items[-1]
        items.pop()
        return out

    @property
    def taken(self) -> int:
        """Draws handed out since the generator was seeded."""
        return (self._blocks - 1) * self.BLOCK + self._pos

    def seek(self, taken: int) -> None:
        """Continue as a Draws of the same parts does after handing out ``taken`` draws."""
        if isinstance(taken, bool) or not isinstance(taken, (int, np.integer)) or taken < 0:
            raise StateError(f"draws state: 'taken' must be an integer >= 0 (got {taken!r})")
        start = int(taken) // self.BLOCK
        bits = np.random.PCG64(self._seed)
        bits.advance(start * self.BLOCK)
        self._gen = np.random.Generator(bits)
        self._blocks = start
        self._refill()
        self._pos = int(taken) - start * self.BLOCK

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("draws", state, ("taken",))
        self.seek(state["taken"])
