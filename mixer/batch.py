"""The batch a training step receives, and the collate that builds it.

All integer fields live in ONE flat int32 (or int64) buffer, and a batch pickles as that buffer (by
value, as a numpy array) plus shapes. Measured here: torch's default tensor pickling moves every
tensor into a new shared-memory segment, ~6.6 ms per batch of ~100 samples, which doubled the
pipeline's total CPU per sample with 2 DataLoader workers; copying a few hundred KB through the
worker's pipe costs a small fraction of that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import transport

_DTYPES = {"int32": (np.int32, torch.int32), "int64": (np.int64, torch.int64)}


class Batch:
    """Padded tokens ``[B, L]`` (``pad_id`` past each length), ``lengths [B]``, ``source [B]`` (index
    into ``Mixture.sources``), the ``keys`` of the samples, and ``info``: a small dict the mixture
    attaches (global step, per-source counters, state) for the loader's bookkeeping.

    ``filler`` is True for a *filler* batch: under ``torchrun`` with a finite mixture, a rank whose
    data ended before the other ranks' hands out fillers until every rank has ended, so that all
    ranks take the same number of steps (see :mod:`mixer.distributed`). A filler is a copy of a real
    batch (same shapes and kinds of values, finite loss) whose samples are *not* delivered by it:
    the training step must still run (DDP's gradient all-reduce needs every rank) but weigh its loss
    by 0 (``loss = loss * 0`` when ``batch.filler``). Its ``info`` holds only ``{"filler": True}``.

    ``pin_memory()`` and ``to()`` move the one buffer and rebuild the views, so DataLoader's
    ``pin_memory=True`` pins it with a single copy.
    """

    __slots__ = ("buffer", "batch_size", "seq_len", "keys", "info", "tokens", "lengths", "source", "slot")

    def __init__(self, buffer: torch.Tensor, batch_size: int, seq_len: int, keys: list[str], info: dict[str, Any] | None = None) -> None:
        self.buffer = buffer
        # (pool id, worker, slot, stamp) while the buffer lives in a worker's shared slot.
        self.slot: tuple[int, int, int, int] | None = None
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.keys = keys
        self.info = info if info is not None else {}
        n = batch_size * seq_len
        self.tokens = buffer[:n].view(batch_size, seq_len)
        self.lengths = buffer[n : n + batch_size]
        self.source = buffer[n + batch_size : n + 2 * batch_size]

    def __len__(self) -> int:
        return self.batch_size

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses (mixer.layout) share this machinery: they rebuild from (buffer, *_meta()).
        cls, meta = type(self), self._meta()
        if self.slot is not None:
            return (_from_slot, (cls, *self.slot, self.buffer.numel(), meta))
        if self.buffer.device.type == "cpu":
            return (_from_numpy, (cls, self.buffer.numpy(), meta))
        return (cls, (self.buffer, *meta))

    def _meta(self) -> tuple[Any, ...]:
        """What the constructor takes after the buffer."""
        return (self.batch_size, self.seq_len, self.keys, self.info)

    def _with_buffer(self, buffer: torch.Tensor) -> Batch:
        return type(self)(buffer, *self._meta())

    def pin_memory(self, device: Any = None) -> Batch:
        return self._with_buffer(self.buffer.pin_memory() if device is None else self.buffer.pin_memory(device))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._with_buffer(self.buffer.to(device, non_blocking=non_blocking))

    def is_pinned(self) -> bool:
        return self.buffer.is_pinned()

    @property
    def filler(self) -> bool:
        return bool(self.info.get("filler", False))

    def as_filler(self) -> Batch:
        """A filler copy of this batch (own buffer, ``info == {"filler": True}``)."""
        copy = self._with_buffer(self.buffer.clone())
        copy.info = {"filler": True}
        return copy

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens."""
        return int(self.lengths.sum())

    @property
    def padding_efficiency(self) -> float:
        slots = self.batch_size * self.seq_len
        return self.num_tokens / slots if slots else 1.0

    def __repr__(self) -> str:
        return f"Batch(B={self.batch_size}, L={self.seq_len}, tokens={self.num_tokens}, device={self.buffer.device})"


def _from_slot(cls: type[Batch], pool_id: int, worker: int, slot: int, stamp: int, n: int, meta: tuple[Any, ...]) -> Batch:
    data = transport.pool(pool_id).copy_out(worker, slot, stamp, n)
    return cls(torch.from_numpy(data), *meta)


def _from_numpy(cls: type[Batch], buffer: np.ndarray, meta: tuple[Any, ...]) -> Batch:
    return cls(torch.from_numpy(buffer), *meta)


def collate(
    token_arrays: Sequence[np.ndarray],
    lengths: np.ndarray,
    sources: np.ndarray,
    keys: list[str],
    *,
    pad_id: int = 0,
    dtype: str = "int32",
    info: dict[str, Any] | None = None,
    out: Callable[[int], np.ndarray | None] | None = None,
) -> Batch:
    """Pad ``token_arrays`` (already cut to ``lengths``) into one preallocated buffer: a new array,
    or the one ``out(num_elements)`` provides (a worker's shared slot).

    One concatenate and one masked assignment place every token: no per-sample tensors and no Python
    loop over tokens.
    """
    np_dtype, _ = _DTYPES[dtype]
    b = len(token_arrays)
    seq_len = int(lengths.max()) if b else 0
    n = b * seq_len
    flat = out(n + 2 * b) if out is not None else None
    if flat is None:
        flat = np.empty(n + 2 * b, dtype=np_dtype)
    grid = flat[:n].reshape(b, seq_len)
    grid.fill(pad_id)
    if b:
        mask = np.arange(seq_len) < lengths[:, None]
        grid[mask] = np.concatenate(token_arrays, dtype=np_dtype, casting="unsafe")
    flat[n : n + b] = lengths
    flat[n + b :] = sources
    return Batch(torch.from_numpy(flat), b, seq_len, keys, info)
