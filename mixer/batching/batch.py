"""The batches a training step receives: padded tokens (:class:`Batch`), packed documents
(:class:`PackedBatch`) and samples of several named fields (:class:`FieldBatch`).

All of a batch lives in ONE flat buffer of the mixture's int dtype (int32 or int64), and a batch
pickles as that buffer (by value, as a numpy array, or through a worker's shared slot, see
:mod:`mixer.runtime.transport`) plus shapes. Measured here: torch's default tensor pickling moves every
tensor into a new shared-memory segment, ~6.6 ms per batch of ~100 samples, which doubled the
pipeline's total CPU per sample with 2 DataLoader workers; copying a few hundred KB through the
worker's pipe costs a small fraction of that. ``pin_memory()`` / ``to()`` move the buffer in one copy.

The views of a :class:`LayoutBatch` are described by a *spec*: ``(name, dtype, shape)`` regions in
order, each starting on an 8-byte boundary, so a region of another dtype (float32 audio in an int32
buffer, int32 ``cu_seqlens`` in an int64 one) is a reinterpreting view of the same memory. How the
buffer is filled is :mod:`mixer.batching.collate`'s.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mixer.spec.dtypes import _DTYPES, FIELD_DTYPES  # noqa: F401 (imported from here too)
from mixer.state.checkpoint import Position

_ALIGN = 8  # bytes: every region starts here, so any field dtype can view it

Spec = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(slots=True)
class BatchMeta:
    """What a batch tells the loader's bookkeeping (and the training loop) about itself.

    ``step``: the global step (the same meaning on every worker and rank); ``worker``: the reader
    that made it; ``tokens``: its real tokens; ``counters``: that reader's cumulative per-source
    counters (rows of :attr:`mixer.read.counters.Counters.FIELDS`), this batch included; ``target``: the
    schedule's share per source at this step. For exact resume (see :mod:`mixer.state.checkpoint`):
    ``snapshot``, the reader's full state every ``state_every`` batches (None otherwise; the loader
    takes it off before handing the batch out); ``skips``, shards given up since the reader's last
    batch; ``resumed_counters``, on a resumed reader's first batch, its counters at the resume
    point. ``filler``: a filler batch (see :class:`Batch`), which delivers nothing. ``position``: set
    by the loader as it hands the batch out, the loader's position as of this batch
    (:class:`mixer.state.checkpoint.Position`), which ``Loader.state_dict(upto=batch)`` turns into
    the state to save once this batch is trained; it stays in the process that handed the batch out
    (a pickled batch leaves it behind).

    Treat it as read-only (the loader sets ``position`` and takes ``snapshot`` off as it hands the
    batch out, on the batch's own metadata, then never changes it again). It travels with every batch
    from a worker as a tuple of its values (see :meth:`Batch.__reduce__`): plain numbers and lists,
    no class lookup, and not frozen, because a frozen dataclass's constructor costs about 1 us more
    per batch to rebuild."""

    step: int = 0
    worker: int = 0
    tokens: int = 0
    counters: Sequence[Sequence[int]] = ()
    target: Sequence[float] = ()
    snapshot: dict[str, Any] | None = None
    skips: Sequence[Sequence[int]] = ()
    resumed_counters: Sequence[Sequence[int]] | None = None
    filler: bool = False
    position: Position | None = None


# Pickled as its values (no class lookup per batch), all but the position: it is the handing-out
# process's (it holds the readers' snapshots by reference) and it is set after the batch travelled.
_META_VALUES = operator.attrgetter(*(name for name in BatchMeta.__slots__ if name != "position"))
FILLER = BatchMeta(filler=True)
_NO_META = BatchMeta()  # a batch built outside a mixture (tests, custom collate)


class Batch:
    """Padded tokens ``[B, L]`` (``pad_id`` past each length), ``lengths [B]``, ``source [B]`` (index
    into ``Mixture.sources``), the ``keys`` of the samples, and ``meta``: a :class:`BatchMeta` the
    mixture attaches (global step, per-source counters, resume bookkeeping).

    ``filler`` is True for a *filler* batch: under ``torchrun`` with a finite mixture, a rank whose
    data ended before the other ranks' hands out fillers until every rank has ended, so that all
    ranks take the same number of steps (see :mod:`mixer.runtime.distributed`). A filler is a copy of a real
    batch (same shapes and kinds of values, finite loss) whose samples are *not* delivered by it:
    the training step must still run (DDP's gradient all-reduce needs every rank) but weigh its loss
    by 0 (``loss = loss * 0`` when ``batch.filler``). Its ``meta`` is :data:`FILLER`.

    ``pin_memory()`` and ``to()`` move the one buffer and rebuild the views, so DataLoader's
    ``pin_memory=True`` pins it with a single copy.
    """

    __slots__ = ("buffer", "batch_size", "seq_len", "keys", "meta", "tokens", "lengths", "source", "slot")

    def __init__(
        self, buffer: torch.Tensor, batch_size: int, seq_len: int, keys: list[str], *, meta: BatchMeta | None = None
    ) -> None:
        self.buffer = buffer
        # (pool id, worker, slot, stamp, view) while the buffer lives in a worker's shared slot.
        self.slot: tuple[Any, ...] | None = None
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.keys = keys
        self.meta = meta if meta is not None else _NO_META
        n = batch_size * seq_len
        self.tokens = buffer[:n].view(batch_size, seq_len)
        self.lengths = buffer[n : n + batch_size]
        self.source = buffer[n + batch_size : n + 2 * batch_size]

    def __len__(self) -> int:
        return self.batch_size

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses (LayoutBatch) share this machinery: they rebuild from (buffer, *_args(), meta).
        cls, args, meta = type(self), self._args(), _META_VALUES(self.meta)
        if self.slot is not None:
            return (_from_slot, (cls, self.slot, self.buffer.numel(), args, meta))
        if self.buffer.device.type == "cpu":
            return (_from_numpy, (cls, self.buffer.numpy(), args, meta))
        return (_rebuild, (cls, self.buffer, args, meta))

    def _args(self) -> tuple[Any, ...]:
        """What the constructor takes between the buffer and the metadata."""
        return (self.batch_size, self.seq_len, self.keys)

    def _with_buffer(self, buffer: torch.Tensor) -> Batch:
        return type(self)(buffer, *self._args(), meta=self.meta)

    def pin_memory(self, device: Any = None) -> Batch:
        return self._with_buffer(self.buffer.pin_memory() if device is None else self.buffer.pin_memory(device))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._with_buffer(self.buffer.to(device, non_blocking=non_blocking))

    def is_pinned(self) -> bool:
        return self.buffer.is_pinned()

    @property
    def filler(self) -> bool:
        return self.meta.filler

    def as_filler(self) -> Batch:
        """A filler copy of this batch (own buffer, ``meta`` :data:`FILLER`)."""
        copy = self._with_buffer(self.buffer.clone())
        copy.meta = FILLER
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


def _from_slot(cls: type[Batch], slot: tuple[Any, ...], n: int, args: tuple[Any, ...], meta: tuple[Any, ...]) -> Batch:
    *where, view = slot  # the slot's last entry views it (the runtime's transport made it)
    data = view(*where, n)
    return cls(torch.from_numpy(data), *args, meta=BatchMeta(*meta))


def _from_numpy(cls: type[Batch], buffer: np.ndarray, args: tuple[Any, ...], meta: tuple[Any, ...]) -> Batch:
    return cls(torch.from_numpy(buffer), *args, meta=BatchMeta(*meta))


def _rebuild(cls: type[Batch], buffer: torch.Tensor, args: tuple[Any, ...], meta: tuple[Any, ...]) -> Batch:
    return cls(buffer, *args, meta=BatchMeta(*meta))


# ---- views over one flat buffer -------------------------------------------------------------


def _extents(spec: Spec, itemsize: int) -> tuple[list[tuple[int, int, int]], int]:
    """Per region (first element, end element, element count of its own dtype) in units of the
    buffer's ``itemsize``; and the buffer's total elements."""
    out = []
    pos = 0  # bytes
    for _, dtype, shape in spec:
        count = math.prod(shape)
        nbytes = -(-count * np.dtype(FIELD_DTYPES[dtype][0]).itemsize // _ALIGN) * _ALIGN
        out.append((pos // itemsize, (pos + nbytes) // itemsize, count))
        pos += nbytes
    return out, pos // itemsize


def _torch_views(buffer: torch.Tensor, spec: Spec) -> dict[str, torch.Tensor]:
    extents, _ = _extents(spec, buffer.element_size())
    return {
        name: buffer[a:b].view(FIELD_DTYPES[dtype][1])[:count].view(shape)
        for (name, dtype, shape), (a, b, count) in zip(spec, extents)
    }


class LayoutBatch(Batch):
    """A :class:`~mixer.Batch` whose views are described by a spec (see the module docstring):
    ``batch[name]`` is the view called ``name``; ``views`` all of them. Pickling, ``pin_memory()``
    and ``to()`` are :class:`~mixer.Batch`'s: one buffer moves, the views are rebuilt."""

    __slots__ = ("spec", "views", "extra")

    def __init__(
        self,
        buffer: torch.Tensor,
        spec: Spec,
        keys: list[str],
        extra: tuple[Any, ...] = (),
        *,
        meta: BatchMeta | None = None,
    ) -> None:
        self.buffer = buffer
        self.slot: tuple[Any, ...] | None = None
        self.spec = spec
        self.keys = keys
        self.meta = meta if meta is not None else _NO_META
        self.extra = extra
        self.views = _torch_views(buffer, spec)
        self.lengths = self.views["lengths"]
        self.source = self.views["source"]
        self.batch_size = len(self.lengths)
        self._bind()

    def _bind(self) -> None:
        pass

    def _args(self) -> tuple[Any, ...]:
        return (self.spec, self.keys, self.extra)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.views[name]
        except KeyError:
            raise KeyError(f"{type(self).__name__} has no view {name!r} (it has {sorted(self.views)})") from None


class PackedBatch(LayoutBatch):
    """Documents packed back to back (see :class:`~mixer.Packed`); every field is a view of one buffer.

    * ``tokens [T]``: flat. ``T`` is the real token count (``seq_len=None``: no padding at all) or
      ``rows * seq_len``, each row's tail after its last document filled with ``pad_id``;
      ``rows`` is the ``[rows, seq_len]`` view (``[1, T]`` without rows).
    * ``cu_seqlens [n + 1]`` (int32): where the ``n`` segments (documents, or pieces of a split
      document) start in ``tokens``, then ``T``. A row's padding tail belongs to the segment before
      it, after that document's real tokens (a causal kernel never lets a real token see it).
      ``max_seqlen``: the longest segment (an int, as the kernels take it).
    * ``position_ids [T]``: ``i - cu_seqlens[segment of i]``: restarting at 0 at every segment.
    * ``lengths [n]``: real tokens per segment; ``source [n]``; ``offsets [n]``: where each segment
      starts inside its document (0 unless it continues a split document); ``keys``: per segment.
    """

    __slots__ = ("position_ids", "cu_seqlens", "offsets", "max_seqlen")

    def _bind(self) -> None:
        self.tokens = self.views["tokens"]
        self.position_ids = self.views["position_ids"]
        self.cu_seqlens = self.views["cu_seqlens"]
        self.offsets = self.views["offsets"]
        self.seq_len, self.max_seqlen = self.extra

    @property
    def rows(self) -> torch.Tensor:
        return self.tokens.view(-1, self.seq_len) if self.seq_len else self.tokens.view(1, -1)

    @property
    def padding_efficiency(self) -> float:
        slots = self.tokens.numel()
        return self.num_tokens / slots if slots else 1.0

    def __repr__(self) -> str:
        return (
            f"PackedBatch(T={self.tokens.numel()}, docs={self.batch_size}, max_seqlen={self.max_seqlen}, "
            f"tokens={self.num_tokens}, device={self.buffer.device})"
        )


class FieldBatch(LayoutBatch):
    """Samples of several named fields (see :class:`~mixer.Field`); every tensor is a view of one buffer.

    ``batch["audio"]`` is ``[B, L_audio]`` padded with that field's pad value, ``batch["audio_lengths"]``
    ``[B]``; the same for every field. ``lengths [B]``: what the budget and the token shares counted
    per sample (its ``length``); ``source [B]``; ``keys``. ``seq_len``: the longest ``length``, so
    ``padding_efficiency`` is that of the counted field, as in the counters.
    """

    __slots__ = ()

    def _bind(self) -> None:
        (self.seq_len,) = self.extra

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for name, _, shape in self.spec if len(shape) == 2)

    @property
    def tokens(self) -> torch.Tensor:  # type: ignore[override]
        raise AttributeError(f"FieldBatch has no 'tokens': its fields are batch[name] for name in {self.fields}")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={tuple(self.views[n].shape)}" for n in self.fields)
        return f"FieldBatch(B={self.batch_size}, {shapes}, device={self.buffer.device})"
