"""A group of batches as it crosses from a reader actor to its trainer: one flat buffer and, per
batch, where it lies in that buffer and what the batch carries.

Ray costs about 2-2.5 ms of CPU per call whatever it carries (measured here on a local cluster), so a
reader sends its batches in groups (up to ``batches_per_call``, under :data:`MAX_GROUP_BYTES`), and a
group is ONE numpy buffer: Ray moves it through its object store without pickling it (a buffer out
of band, copied once into the store on the reader's side), where pickling each batch's tensor would
cost a shared-memory segment per batch (see :mod:`mixer.batching.batch`). The reader collates
straight into the group's buffer (:class:`GroupBuffer` is the mixture's ``Slots``), so making a
group copies nothing.

On the trainer the buffer is a read-only view of the object store; :func:`unpack` copies it once
into memory of the trainer's own (pinned when the loader pins), so a batch handed out is writable,
like an in-process loader's, and never holds an object of the store alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mixer.batching.batch import _META_VALUES, Batch, BatchMeta
from mixer.errors import MixerError

#: The most bytes one group's buffer holds: a batch larger than this travels alone.
MAX_GROUP_BYTES = 64 << 20

#: One batch of a group: (class, first element in the buffer, elements, the constructor's other
#: arguments, the metadata's values).
Entry = tuple[type, int, int, tuple[Any, ...], tuple[Any, ...]]


def group_limit(batches_per_call: int, batch_bytes: int) -> int:
    """Batches one call may return: ``batches_per_call``, fewer when they would pass :data:`MAX_GROUP_BYTES`."""
    return max(1, min(batches_per_call, MAX_GROUP_BYTES // max(batch_bytes, 1)))


class _Writer:
    __slots__ = ("group",)

    def __init__(self, group: GroupBuffer) -> None:
        self.group = group

    def out(self, n: int) -> np.ndarray | None:
        g = self.group
        if g.used + n > len(g.buffer):
            return None  # the collate makes its own buffer; pack() copies it in
        view = g.buffer[g.used : g.used + n]
        g.used += n
        return view

    def seal(self) -> None:
        return None  # the batch is found in the group by its address (pack)


class GroupBuffer:
    """The buffer a reader actor collates one group into (a :class:`mixer.mixing.mixture.Slots`).
    ``reset(elements)`` before each group; reused from group to group, because Ray has copied the
    previous group out of it by the time the actor runs its next call."""

    def __init__(self, dtype: Any) -> None:
        self.buffer = np.empty(0, dtype=dtype)
        self.used = 0

    def reset(self, elements: int) -> None:
        if len(self.buffer) < elements:
            self.buffer = np.empty(elements, dtype=self.buffer.dtype)
        self.used = 0

    def writer(self, worker: int) -> _Writer:
        return _Writer(self)


def pack(batches: Sequence[Batch], group: GroupBuffer) -> tuple[np.ndarray, list[Entry]]:
    """The group's buffer and its entries. A batch collated outside the buffer (it did not fit) is
    appended to it here."""
    buffer = group.buffer
    base, itemsize = buffer.ctypes.data, buffer.itemsize
    entries: list[Entry] = []
    outside: list[np.ndarray] = []
    end = group.used
    for b in batches:
        flat = b.buffer
        n = flat.numel()
        offset = (flat.data_ptr() - base) // itemsize
        if not 0 <= offset <= group.used - n:
            outside.append(flat.numpy())
            offset, end = end, end + n
        entries.append((type(b), offset, n, b._args(), _META_VALUES(b.meta)))
    data = buffer[: group.used] if not outside else np.concatenate([buffer[: group.used], *outside])
    return data, entries


def unpack(data: np.ndarray, entries: Sequence[Entry], *, pin: bool) -> list[Batch]:
    """The batches of a group, their buffers views of one copy of ``data`` made here."""
    if not entries:
        return []
    own = torch.empty(len(data), dtype=torch.from_numpy(data[:0].copy()).dtype, pin_memory=pin)
    np.copyto(own.numpy(), data)
    batches = []
    for cls, offset, n, args, meta in entries:
        if offset + n > len(own):
            raise MixerError(f"a group of {len(own)} elements names a batch at {offset}+{n}: transport broken")
        batches.append(cls(own[offset : offset + n], *args, meta=BatchMeta(*meta)))
    return batches
