"""The two mixing loops, as generator stages. Each picks sources with level 1 (a selector, at the
shares ``probs()`` gives) and cuts batches with level 2 (:mod:`mixer.batching.batchers`), and yields
:class:`Cut`\\ s: a batch's samples, their sources and what it delivers (the layout's
:meth:`~mixer.batching.collate.Layout.account`), for the reader to count and collate.

* :func:`mix_batches` (``mix="batch"``): every batch comes from one source, one batcher per source.
* :func:`mix_samples` (``mix="sample"``): each sample's source is picked on its own; one batcher,
  shared by every source, holds ``(source, sample)`` pairs.

When a source's stream passes into its next source-epoch (``stop="never"``) it calls its
``on_epoch``, which both loops set to the batcher's ``close_epoch``: what the batcher holds of that
source leaves before the new epoch's first sample is added, so that within a source no sample is
delivered twice before every sample of its epoch was delivered once.

Both read their inputs as they go, owned by the caller: ``probs()`` is asked before every pick
(progress moves once per batch, so it may cache; it also keeps ``holds`` current), ``active`` masks
the sources with data left, and ``retire(i)`` takes source ``i`` out when it has no more and says
whether the stream goes on. The selector has counted a batch (or its samples) before the batch is
yielded, so a state taken while the consumer holds a cut is the state after that batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple, Protocol

import numpy as np

from mixer.batching.batchers import Batcher, PackedGroup
from mixer.batching.collate import Delivered, Layout
from mixer.read.decode import Sample


class Cut(NamedTuple):
    """One batch as level 2 cut it, not yet collated."""

    samples: Sequence[Sample]  # a PackedGroup for packed batches
    sources: np.ndarray  # int64 source index per sample
    delivered: Delivered


class SampleStream(Protocol):
    """What the loops need of a source's stream (:class:`~mixer.stream.source_stream.SourceStream`):
    its samples, and ``on_epoch``, called when it passes into its next source-epoch."""

    on_epoch: Callable[[], object] | None

    def __iter__(self) -> Iterator[Sample]: ...

    def __next__(self) -> Sample: ...


class Picker(Protocol):
    """What the loops need of level 1 (:mod:`mixer.mixing.selector`)."""

    def choose(self, probs: np.ndarray, active: np.ndarray) -> int: ...

    def update(self, source: int, amount: float, probs: np.ndarray) -> None: ...


def mix_batches(
    streams: Sequence[SampleStream],
    batchers: Sequence[Batcher[Sample]],
    selector: Picker,
    layout: Layout,
    *,
    probs: Callable[[], np.ndarray],
    holds: Sequence[int],
    caps: Sequence[int],
    token_caps: Sequence[int],
    active: np.ndarray,
    retire: Callable[[int], bool],
    count_tokens: bool,
) -> Iterator[Cut]:
    """Batches, each from the source the selector picks, which is then told the real tokens
    (``count_tokens``) or the samples the batch delivered. ``holds[i]``: what source ``i``'s
    batcher may hold, in padded tokens, before it releases a batch early; ``caps[i]`` in items and
    ``token_caps[i]`` in padded tokens: its part of the reader's buffer budget."""
    for stream, batcher in zip(streams, batchers):
        stream.on_epoch = batcher.close_epoch
    while active.any():
        p = probs()
        i = selector.choose(p, active)
        samples = _next_batch(streams[i], batchers[i], holds[i], caps[i], token_caps[i])
        if samples is None:
            if not retire(i):
                return
            continue
        delivered = layout.account(samples)
        selector.update(i, int(delivered.tokens.sum()) if count_tokens else len(samples), p)
        yield Cut(samples, np.full(len(samples), i, dtype=np.int64), delivered)


def _next_batch(
    stream: SampleStream, batcher: Batcher[Sample], hold: int, cap: int, token_cap: int
) -> list[Sample] | None:
    """The source's next batch: one ready or released, else read until one is; at the end of the
    source's data whatever its batcher still holds, then None. ``ready`` is empty while reading,
    so checking ``count`` and ``held`` after each add keeps buffers and ready batches within
    ``cap`` and ``token_cap`` whenever a batch leaves. (A stream passing into its next epoch
    closes the batcher's epoch before it hands out the sample: ``add`` then finds batches ready.)"""
    ready = batcher.ready
    if ready or batcher.expire() or batcher.release(hold, cap, token_cap):
        return ready.popleft()
    add = batcher.add
    most = min(hold, token_cap)
    for sample in stream:
        if add(sample, sample.length) or (
            (batcher.held > most or batcher.count > cap) and batcher.release(hold, cap, token_cap)
        ):
            return ready.popleft()
    return next(batcher.drain(), None)


def mix_samples(
    streams: Sequence[SampleStream],
    batcher: Batcher[tuple[int, Sample]],
    selector: Picker,
    layout: Layout,
    *,
    probs: Callable[[], np.ndarray],
    caps: Sequence[int],
    token_caps: Sequence[int],
    active: np.ndarray,
    retire: Callable[[int], bool],
    count_tokens: bool,
    drain: bool,
    closes: Sequence[bool] | None = None,
) -> Iterator[Cut]:
    """Batches of samples whose sources the selector picks one sample at a time (and is told each
    sample's length, or 1), cut by one shared ``batcher``, which releases a batch early when it
    holds more than ``caps[0]`` items or ``token_caps[0]`` padded tokens (its part of the reader's
    buffer budget). ``drain``: when the sources are done, the batches still held follow (a finite
    pass delivering everything). ``closes[i]``: whether source ``i``'s epochs are closed (default:
    all; see :func:`mixer.batching.batchers.closing_sources`)."""
    for i, stream in enumerate(streams):
        stream.on_epoch = partial(batcher.close_epoch, i) if closes is None or closes[i] else None
    live = bool(active.any())  # (asked again only when a source retires: per sample it costs)

    def ready() -> Iterator[Cut]:
        # The batches ready, and those the wait bound of the sources with short epochs lets out as
        # ages move (expire: once per batch left).
        while batcher.ready or batcher.expire():
            yield _cut(batcher.ready.popleft(), layout)

    # What the pass would hand out next before taking another sample: nothing on a fresh start; on a
    # resume saved between two batches that the wait bound let out, the rest of them, as then.
    yield from ready()
    while live:
        p = probs()
        i = selector.choose(p, active)
        sample = next(streams[i], None)
        if sample is None:
            if not retire(i):
                break
            live = bool(active.any())
            continue
        selector.update(i, sample.length if count_tokens else 1, p)
        if batcher.add((i, sample), sample.length) or (
            (batcher.count > caps[0] or batcher.held > token_caps[0])
            and batcher.release(1 << 62, caps[0], token_caps[0])
        ):
            yield from ready()
    if drain:
        for rest in batcher.drain():
            yield _cut(rest, layout)


def _cut(group: list[tuple[int, Sample]], layout: Layout) -> Cut:
    samples, sources = unzip_sources(group)
    return Cut(samples, sources, layout.account(samples))


def unzip_sources(group: list[tuple[int, Sample]]) -> tuple[list[Sample], np.ndarray]:
    """A group of ``(source, sample)`` pairs as its samples (a :class:`PackedGroup` stays one, with
    the same placement) and their sources."""
    samples = [s for _, s in group]
    sources = np.fromiter((j for j, _ in group), dtype=np.int64, count=len(group))
    if isinstance(group, PackedGroup):
        return group.with_items(samples), sources
    return samples, sources
