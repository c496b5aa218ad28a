"""``Source`` (configuration, listed and validated once) and ``SourceStream`` (one reader's samples).

A source's shards are listed once, in the main process, sorted; every reader then derives its part
of each source-epoch from :func:`mixer.shards.plan` without talking to the others.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from . import io
from .bucket import TokenBudget
from .decode import Sample, default_tokens
from .errors import ConfigError, MixerError, SampleError, ShardError
from .shards import ShardSlice, plan
from .tario import read_samples
from .world import World, seed_for

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
Decode = Callable[[dict[str, Any]], np.ndarray]
Length = Callable[[dict[str, Any]], int]


class Source:
    """One stream of samples: a set of WebDataset shards and how to read them.

    ``urls``: a brace pattern (``shard-{000..127}.tar``), a list of patterns, a local folder or glob,
    or a remote prefix ending in ``/``. ``weight`` is the static target share (normalised over
    sources). ``size`` is the source's size in tokens for temperature/proportional schedules; when
    None it is estimated once, up front, identically for every reader (see :func:`profile`).
    ``decode(sample) -> 1-D int array`` and ``length(sample) -> int`` replace the default (tokens from
    ``tokens.npy``, else ``input_ids.npy``, else the UTF-8 bytes of ``txt``; length = token count).
    ``on_error``: ``"raise"`` stops on a bad shard or sample with an error naming it; ``"skip"``
    skips it, counts it and warns once per shard.
    """

    def __init__(
        self,
        name: str,
        urls: str | Sequence[str],
        *,
        weight: float = 1.0,
        size: float | None = None,
        decode: Decode | None = None,
        length: Length | None = None,
        on_error: OnError = "raise",
        storage_options: Mapping[str, Any] | None = None,
        group: str | None = None,
        allow_pipe: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"source name must be a non-empty string (got {name!r})")
        where = f"source {name!r}"
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{where}: weight must be a finite number >= 0 (got {weight!r})")
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size) or size <= 0):
            raise ConfigError(f"{where}: size must be a positive number of tokens or None (got {size!r})")
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"{where}: on_error must be 'raise' or 'skip' (got {on_error!r})")
        if decode is not None and not callable(decode):
            raise ConfigError(f"{where}: decode must be callable (got {decode!r})")
        if length is not None and not callable(length):
            raise ConfigError(f"{where}: length must be callable (got {length!r})")
        patterns = [urls] if isinstance(urls, str) else list(urls)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ConfigError(f"{where}: urls must be a non-empty pattern or list of patterns (got {urls!r})")
        self.name = name
        self.urls = patterns
        self.weight = float(weight)
        self.size = None if size is None else float(size)
        self.decode = decode
        self.length = length
        self.on_error: OnError = on_error
        self.storage_options = dict(storage_options or {})
        self.group = group
        try:
            for p in patterns:
                io.check_url(p, allow_pipe=allow_pipe)
            listed = io.expand_urls(patterns, storage_options=self.storage_options)
        except MixerError as exc:
            raise type(exc)(f"{where}: {exc}") from exc
        self.shards: tuple[str, ...] = tuple(url for url, _ in listed)
        self.shard_bytes: tuple[int | None, ...] = tuple(nbytes for _, nbytes in listed)

    def __repr__(self) -> str:
        return f"Source({self.name!r}, {len(self.shards)} shards, weight={self.weight})"


@dataclass(frozen=True)
class Profile:
    """What one up-front look at a source measured: a sample of lengths (for bucket edges) and the
    size in tokens, given or estimated as ``total shard bytes * tokens per byte`` measured on the
    samples read (shards whose byte size the listing did not give are assumed average-sized)."""

    lengths: np.ndarray
    tokens_per_byte: float
    size: float
    estimated: bool


def profile(source: Source, *, max_samples: int = 2048, max_shards: int = 3) -> Profile:
    """Read up to ``max_samples`` samples from up to ``max_shards`` shards spread over the sorted
    list. Runs once in the main process; the result travels to every reader with the mixture."""
    n = len(source.shards)
    picks = sorted({round(i * (n - 1) / max(max_shards - 1, 1)) for i in range(min(max_shards, n))})
    per_shard = max(1, max_samples // len(picks))
    lengths: list[int] = []
    nbytes = 0
    for shard in picks:
        url = source.shards[shard]
        start = None
        end = 0
        with io.open_shard(url, storage_options=source.storage_options) as stream:
            for i, raw in enumerate(read_samples(stream, url=url)):
                if i >= per_shard:
                    break
                if start is None:
                    start = raw["__offset__"]
                end = raw["__end__"]
                try:
                    lengths.append(_length_of(source, raw, _decode(source, raw)))
                except SampleError:
                    if source.on_error == "raise":
                        raise
        nbytes += end - (start or 0)
    if not lengths:
        raise ShardError(f"source {source.name!r}: no samples found in shards {[io.redact(source.shards[p]) for p in picks]}")
    arr = np.asarray(lengths, dtype=np.int64)
    tpb = float(arr.sum()) / max(nbytes, 1)
    if source.size is not None:
        return Profile(arr, tpb, source.size, False)
    known = [b for b in source.shard_bytes if b is not None]
    if len(known) < n:
        sampled = [io.shard_nbytes(source.shards[p], storage_options=source.storage_options) for p in picks]
        mean = (sum(known) + sum(sampled)) / (len(known) + len(sampled))
        total = sum(known) + mean * (n - len(known))
    else:
        total = float(sum(known))
    size = max(total * tpb, 1.0)
    log.info("source %r: estimated size %.3g tokens (%.4f tokens/byte over %d samples)", source.name, size, tpb, arr.size)
    return Profile(arr, tpb, size, True)


def _decode(source: Source, raw: dict[str, Any]) -> np.ndarray:
    tokens = source.decode(raw) if source.decode is not None else default_tokens(raw)
    if source.decode is not None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise SampleError(
                f"shard {io.redact(raw.get('__url__', '?'))}, key {raw.get('__key__')!r}: decode must return a 1-D "
                f"integer array (got dtype {tokens.dtype}, shape {tokens.shape})"
            )
    return tokens


def _length_of(source: Source, raw: dict[str, Any], tokens: np.ndarray) -> int:
    return int(source.length(raw)) if source.length is not None else len(tokens)


class Counters:
    """Per-source counters kept by every reader (cumulative, plain ints). ``samples``, ``tokens``
    (real), ``padded`` (slots) and ``batches`` count what was delivered in batches; ``read`` counts
    samples taken from shards, some of which may still wait in shuffle or bucket buffers."""

    FIELDS = (
        "samples", "tokens", "padded", "batches", "read", "bytes", "shards_opened", "shards_finished",
        "epochs", "truncated", "dropped", "skipped_samples", "skipped_shards", "retries",
    )
    __slots__ = FIELDS

    def __init__(self) -> None:
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in self.FIELDS]


class SourceStream:
    """One reader's samples of one source: its shard slices, epoch after epoch (or one epoch when
    ``finite``), through a shuffle buffer. Over one source-epoch the readers of all ranks and workers
    together yield every sample exactly once (barring skips, which are counted)."""

    def __init__(
        self,
        source: Source,
        index: int,
        world: World,
        *,
        seed: int,
        budget: TokenBudget,
        shuffle_buffer: int,
        finite: bool,
        counters: Counters,
    ) -> None:
        self.source = source
        self.index = index
        self.world = world
        self.seed = seed
        self.budget = budget
        self.shuffle_buffer = shuffle_buffer
        self.finite = finite
        self.counters = counters
        self.epoch = 0
        # A private generator (never the global one): cheap per-sample draws for the shuffle buffer.
        self.rng = random.Random(seed_for(seed, "shuffle", source.name, world.reader))
        self._warned_shards: set[int] = set()
        self._iter = self._shuffled()

    def __iter__(self) -> Iterator[Sample]:
        return self._iter

    def __next__(self) -> Sample:
        return next(self._iter)

    def _slices(self, epoch: int) -> list[ShardSlice]:
        return plan(len(self.source.shards), self.world, seed=self.seed, source=self.source.name, epoch=epoch, sizes=self.source.shard_bytes)

    def _epochs(self) -> Iterator[Sample]:
        while True:
            slices = self._slices(self.epoch)
            got = False
            for sl in slices:
                for sample in self._read_slice(sl):
                    got = True
                    yield sample
            self.counters.epochs += 1
            self.epoch += 1
            if self.finite:
                return
            if not got:
                # This reader's part of an epoch was empty (e.g. fewer samples in a shared shard than
                # readers sharing it): stop rather than spin reopening shards; the mixture drops the
                # source for this reader and says so.
                log.warning("source %r: reader %d got no samples in epoch %d", self.source.name, self.world.reader, self.epoch - 1)
                return

    def _shuffled(self) -> Iterator[Sample]:
        size = self.shuffle_buffer
        if size <= 1:
            yield from self._epochs()
            return
        buf: list[Sample] = []
        rand = self.rng.random
        for sample in self._epochs():
            if len(buf) < size:
                buf.append(sample)
                continue
            j = int(rand() * size)
            out, buf[j] = buf[j], sample
            yield out
        self.rng.shuffle(buf)
        yield from buf

    def _read_slice(self, sl: ShardSlice) -> Iterator[Sample]:
        source, counters = self.source, self.counters
        url = source.shards[sl.shard]
        decode = source.decode
        length_fn = source.length
        longest = self.budget.longest
        cap_explicit = self.budget.max_length is not None
        drop = self.budget.overlong == "drop"
        part, parts = sl.part, sl.parts
        counters.shards_opened += 1
        pos = 0
        try:
            with io.open_shard(url, storage_options=source.storage_options) as stream:
                for i, raw in enumerate(read_samples(stream, url=url)):
                    pos = raw["__end__"]
                    if parts > 1 and i % parts != part:
                        continue
                    try:
                        if decode is None and length_fn is None:
                            tokens = default_tokens(raw)
                            n = len(tokens)
                        else:
                            tokens = _decode(source, raw)
                            n = _length_of(source, raw, tokens)
                        if n > longest:
                            if not cap_explicit:
                                raise SampleError(
                                    f"shard {io.redact(url)}, key {raw['__key__']!r}: length {n} exceeds max_tokens="
                                    f"{self.budget.max_tokens}; set TokenBudget(max_length=...) to truncate or drop such samples"
                                )
                            if drop or length_fn is not None:
                                counters.dropped += 1
                                continue
                            tokens = tokens[:longest]
                            n = longest
                            counters.truncated += 1
                    except SampleError as exc:
                        if source.on_error == "raise":
                            raise SampleError(f"source {source.name!r}: {exc}") from exc
                        counters.skipped_samples += 1
                        self._warn_once(sl.shard, f"source {source.name!r}: skipping bad sample(s) in shard {io.redact(url)}: {exc}")
                        continue
                    counters.read += 1
                    yield Sample(raw["__key__"], tokens, n, sl.shard, raw["__offset__"])
                counters.retries += getattr(stream, "retries", 0)
        except ShardError as exc:
            if source.on_error == "raise":
                raise ShardError(f"source {source.name!r}: {exc}") from exc
            counters.skipped_shards += 1
            self._warn_once(sl.shard, f"source {source.name!r}: skipping the rest of shard {io.redact(url)}: {exc}")
        else:
            counters.shards_finished += 1
        finally:
            counters.bytes += pos

    def _warn_once(self, shard: int, message: str) -> None:
        if shard not in self._warned_shards:
            self._warned_shards.add(shard)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
