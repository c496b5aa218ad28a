"""The device feed: batches copied to the accelerator ahead of the training step.

On CUDA each batch is copied from pinned host memory on a side stream with ``non_blocking=True``,
``prefetch`` batches ahead of the one being handed out. Handing a batch out makes the consumer's
current stream wait (on the GPU, not the CPU) on an event recorded right after that batch's copy, and
calls ``record_stream`` on the device tensors, so that the caching allocator does not give their
memory to a later copy while the training step may still read them. A :class:`~mixer.Batch` holds all
its integer fields in one flat buffer, so a batch costs one copy.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from mixer._warn import warn
from mixer.batching.batch import Batch
from mixer.errors import ConfigError

T = TypeVar("T")

DeviceLike = str | torch.device | int


def resolve_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``, checked: ``"cuda"`` (or ``"cuda:N"``) needs a usable CUDA
    device, and a bare ``"cuda"`` means the current CUDA device (what ``torch.cuda.set_device`` chose,
    as every rank under ``torchrun`` should do first)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device: not a torch device ({device!r}): {exc}") from exc
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={str(device)!r}: CUDA is not available here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}); pass device='cpu' to keep batches on the host"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ConfigError(f"device={str(device)!r}: no such CUDA device (this process sees {count})")
    return torch.device("cuda", index)


class DeviceFeed(Generic[T]):
    """What :func:`to_device` returns (the one way to build one): iterates ``batches`` with every
    tensor moved to ``device``.

    Each ``iter()`` starts a new pass over ``batches`` (a :class:`~mixer.Loader` restarts its
    stream), with its own side stream. ``copies``, ``bytes_copied`` and, with ``timing=True``,
    ``copy_seconds`` (GPU time of the copies, from CUDA events) accumulate over all passes.
    """

    def __init__(self, batches: Iterable[T], device: DeviceLike, *, prefetch: int = 2, timing: bool = False) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch: batches copied ahead must be an int >= 1 (got {prefetch!r})")
        self.batches = batches
        self.device = resolve_device(device)
        self.prefetch = prefetch
        self.timing = timing
        self.copies = 0
        self.bytes_copied = 0
        self._copy_seconds = 0.0
        self._timers: collections.deque[tuple[Any, Any]] = collections.deque()
        self.stream: Any = None  # the side stream of the latest pass (CUDA)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        if self.device.type == "cuda":
            return self._side_stream_feed(_CudaOps(self.device))
        return self._blocking_feed()

    @property
    def copy_seconds(self) -> float:
        """GPU time spent in this feed's copies (``timing=True``; waits for copies still running)."""
        self._collect_timers(wait=True)
        return self._copy_seconds

    def _collect_timers(self, *, wait: bool) -> None:
        while self._timers and (wait or self._timers[0][1].query()):
            start, end = self._timers.popleft()
            end.synchronize()
            self._copy_seconds += start.elapsed_time(end) / 1e3

    def _blocking_feed(self) -> Iterator[T]:
        # The CPU, and devices without a stream API here (mps, xpu, meta...): an ordinary synchronous
        # copy, and none at all for what is already there (host batches to "cpu": the same objects).
        device = self.device
        for item in self.batches:
            if all(t.device == device for t in _tensors(item)):
                yield item
                continue
            moved, tensors = _move(item, self.device, non_blocking=False)
            self.copies += 1
            self.bytes_copied += sum(t.numel() * t.element_size() for t in tensors)
            yield moved

    def _side_stream_feed(self, ops: _CudaOps) -> Iterator[T]:
        source = iter(self.batches)
        stream = self.stream = ops.new_stream()
        # (device item, its device tensors, copy-done event, host item). After hand-out the host
        # item may go: torch's pinned-memory allocator records its own event for a non_blocking copy
        # and does not reuse the block before that copy is done.
        pending: collections.deque[tuple[T, list[torch.Tensor], Any, T]] = collections.deque()
        done = False
        warned = False
        while True:
            # Copy ahead first: copies of the next `prefetch` batches are queued on the side stream
            # before the consumer queues the step that reads this one.
            while not done and len(pending) <= self.prefetch:
                host = next(source, _END)
                if host is _END:
                    done = True
                    break
                if not ops.is_pinned(host):
                    if not warned:
                        warned = True
                        warn(
                            "to_device: batch is not in pinned memory, pinning it in the training loop's thread; "
                            "pass pin_memory=True to the DataLoader (make_loader(device=...) does) so the pin thread "
                            "does it",
                            UserWarning,
                        )
                    host = ops.pin(host)
                with ops.use(stream):
                    start = ops.event(stream, self.timing) if self.timing else None
                    moved, tensors = ops.move(host)
                    copied = ops.event(stream, self.timing)
                if start is not None:
                    self._timers.append((start, copied))
                self.copies += 1
                self.bytes_copied += sum(t.numel() * t.element_size() for t in tensors)
                pending.append((moved, tensors, copied, host))
            if not pending:
                return
            moved, tensors, copied, _host = pending.popleft()
            consumer = ops.current_stream()
            ops.wait(consumer, copied)
            for t in tensors:
                ops.record_stream(t, consumer)
            del _host, tensors, copied
            if self.timing:
                self._collect_timers(wait=False)
            yield moved
            # Drop this frame's reference: the consumer decides when the batch's memory can go.
            del moved


def to_device(batches: Iterable[T], device: DeviceLike, *, prefetch: int = 2, timing: bool = False) -> DeviceFeed[T]:
    """``batches`` (a :class:`~mixer.Loader`, a DataLoader, any iterable of :class:`~mixer.Batch`,
    tensors, or tuples / lists / dicts of them) with every tensor on ``device``.

    * ``"cuda"`` / ``"cuda:N"``: copies from pinned memory on a side stream, ``prefetch`` (>= 1)
      batches ahead, synchronised as the module docstring says. Without CUDA this is a
      :class:`~mixer.ConfigError` at the call, not a silent fallback.
    * ``"cpu"``: host batches pass through unchanged (the same objects; device tensors are copied).
    * any other device: a synchronous ``.to(device)`` per batch.

    Counters that a :class:`~mixer.Loader` keeps (what the last batch handed out carried) run ahead
    by up to ``prefetch`` batches when the Loader is wrapped from outside; ``make_loader(...,
    device=...)`` puts the feed inside the Loader so they stay exact.
    """
    return DeviceFeed(batches, device, prefetch=prefetch, timing=timing)


class _End:
    pass


_END: Any = _End()


class _CudaOps:
    """The stream operations of the feed, in one place (the tests check the protocol with a stand-in)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self, stream: Any, timing: bool) -> Any:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def is_pinned(self, item: Any) -> bool:
        return all(t.is_pinned() for t in _tensors(item))

    def pin(self, item: Any) -> Any:
        return _pin(item)

    def move(self, item: Any) -> tuple[Any, list[torch.Tensor]]:
        return _move(item, self.device, non_blocking=True)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def _map_leaves(item: Any, leaf: Callable[[Any], Any]) -> Any:
    """``item`` rebuilt with ``leaf`` applied to every Batch and tensor in it (through NamedTuples,
    lists, tuples and dicts); anything else is kept as it is."""
    if isinstance(item, (Batch, torch.Tensor)):
        return leaf(item)
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a NamedTuple
        return type(item)(*(_map_leaves(v, leaf) for v in item))
    if isinstance(item, (list, tuple)):
        return type(item)(_map_leaves(v, leaf) for v in item)
    if isinstance(item, dict):
        return type(item)((k, _map_leaves(v, leaf)) for k, v in item.items())
    return item


def _move(item: Any, device: torch.device, *, non_blocking: bool) -> tuple[Any, list[torch.Tensor]]:
    """``item`` with its tensors on ``device``, and the list of the new device tensors."""
    out: list[torch.Tensor] = []

    def move(x: Batch | torch.Tensor) -> Batch | torch.Tensor:
        moved = x.to(device, non_blocking=non_blocking)
        out.append(moved.buffer if isinstance(moved, Batch) else moved)
        return moved

    return _map_leaves(item, move), out


def _tensors(item: Any) -> Iterator[torch.Tensor]:
    if isinstance(item, Batch):
        yield item.buffer
    elif isinstance(item, torch.Tensor):
        yield item
    elif isinstance(item, (list, tuple)):
        for v in item:
            yield from _tensors(v)
    elif isinstance(item, dict):
        for v in item.values():
            yield from _tensors(v)


def _pin(item: Any) -> Any:
    return _map_leaves(item, lambda x: x.pin_memory())
