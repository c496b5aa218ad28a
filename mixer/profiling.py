"""The up-front look at a source: lengths for bucket edges and its size in tokens (once per job)."""

from __future__ import annotations

import logging

import numpy as np
from dataclasses import dataclass

from . import storage
from ._warn import warn
from .budget import TokenBudget
from .errors import MixerError, SampleError, ShardError
from .budget import Packed
from .source import ListedSource, Source
from .stream import Counters, _decoded, _fit, _skip_or_raise
from .tario import read_samples

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """What one up-front look at a source measured: a sample of lengths (for bucket edges) and the
    size in tokens, given or estimated as ``total shard bytes * tokens per byte`` measured on the
    samples read (shards whose byte size the listing did not give are assumed average-sized).
    ``skipped``: samples the look skipped under ``on_error="skip"`` (the readers meet them again,
    skip them again and count them in ``skipped_samples``)."""

    lengths: np.ndarray
    tokens_per_byte: float
    size: float
    estimated: bool
    skipped: int = 0


def profile(listed: ListedSource, budget: TokenBudget | Packed, *, max_samples: int = 2048, max_shards: int = 3) -> Profile:
    """Read up to ``max_samples`` samples from up to ``max_shards`` shards spread over the sorted
    list. Runs once in the main process; the result travels to every reader with the mixture.

    Every sample read is judged as a reader judges it (:func:`make_sample`'s decode, length policy
    for ``budget`` and ``on_error``): a sample too long for the budget is the same error naming
    source, shard and key, raised or skipped (and counted in ``skipped``) by the source's policy.
    The lengths recorded are those decoded, before truncation, so the size counts source tokens."""
    source, shards = listed.source, listed.shards
    n = len(shards)
    picks = sorted({round(i * (n - 1) / max(max_shards - 1, 1)) for i in range(min(max_shards, n))})
    per_shard = max(1, max_samples // len(picks))
    lengths: list[int] = []
    scratch = Counters()  # the policy's counts while profiling (skipped_samples is reported)
    warned: set[int] = set()

    def warn_once(shard: int, message: str) -> None:
        if shard not in warned:
            warned.add(shard)
            warn(f"{message} (seen while profiling the source)")

    nbytes = 0
    told: list[int] = []  # shard sizes the servers gave while we read (remote shards listed without sizes)
    for shard in picks:
        url = shards[shard]
        start = None
        end = 0
        got: list[int] = []
        stream = None
        try:
            with storage.open_shard(url, storage_options=dict(source.storage_options or {}), allow_pipe=source.allow_pipe, **storage.IOOptions.of(source.io_options).open_kwargs()) as stream:
                for i, raw in enumerate(read_samples(stream, url=storage.redact(url))):
                    if i >= per_shard:
                        break
                    if start is None:
                        start = raw["__offset__"]
                    end = raw["__end__"]
                    try:
                        decoded = _decoded(source, raw, scratch)
                        if decoded is None:  # the decode filtered the sample out
                            continue
                        _fit(source, budget, scratch, raw, *decoded)
                    except SampleError as exc:
                        _skip_or_raise(source, scratch, raw, shard, exc, warn_once)
                        continue
                    got.append(decoded[1])
                size_told = getattr(stream, "size", None)
                if size_told is not None:
                    told.append(int(size_told))
        except ShardError as exc:
            # The readers meet this shard again and apply (and count) the policy there; the samples
            # read whole before the damage still tell lengths.
            if source.on_error == "raise":
                raise ShardError(f"source {source.name!r}: {exc}") from exc
            warn(f"source {source.name!r}: profiling skips shard {storage.redact(url)}: {exc}")
        lengths += got
        scale = getattr(stream, "ratio", 1.0)  # compressed shards: offsets are uncompressed, listed sizes not
        nbytes += round((end - (start or 0)) * scale)
    skipped = scratch.skipped_samples
    if not lengths:
        also = f" ({skipped} skipped as bad)" if skipped else ""
        raise ShardError(f"source {source.name!r}: no samples found in shards {[storage.redact(shards[p]) for p in picks]}{also}")
    if skipped:
        log.warning("source %r: profiling skipped %d bad sample(s) of %d read (on_error='skip')", source.name, skipped, len(lengths) + skipped)
    arr = np.asarray(lengths, dtype=np.int64)
    tpb = float(arr.sum()) / max(nbytes, 1)
    if source.size is not None:
        return Profile(arr, tpb, source.size, False, skipped)
    known = [b for b in listed.shard_bytes if b is not None]
    if len(known) < n:
        pool: list[float] = [*known, *told] or [nbytes / len(picks)]
        mean = sum(pool) / len(pool)
        total = sum(known) + mean * (n - len(known))
    else:
        total = float(sum(known))
    size = max(total * tpb, 1.0)
    log.info("source %r: estimated size %.3g tokens (%.4f tokens/byte over %d samples)", source.name, size, tpb, arr.size)
    return Profile(arr, tpb, size, True, skipped)


def list_source(source: Source) -> ListedSource:
    """List a source's shards, sorted: the I/O of building a mixture, done once in the main process."""
    try:
        listed = storage.expand_urls(list(source.urls), storage_options=dict(source.storage_options or {}))
    except MixerError as exc:
        raise type(exc)(f"source {source.name!r}: {exc}") from exc
    return ListedSource(source, tuple(url for url, _ in listed), tuple(nbytes for _, nbytes in listed))
