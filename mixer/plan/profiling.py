"""The up-front look at a source: lengths for bucket edges and its size in tokens, made once per job.

What a source needs: its size in tokens (for the schedule) unless ``Source.size`` gives it, and a
sample of lengths when the bucket edges are derived from it (``TokenBudget`` without ``buckets``).
A source that needs neither is not read at all. The others (:func:`profile_sources`):

* are looked up in the profile cache first (:mod:`mixer.plan.profile_cache`, ``Mixture(profile_cache=)``):
  a hit reads no shard;
* are read in parallel, at most :data:`MAX_CONCURRENT` sources at once, results in source order;
  an error is raised for the first failing source in source order, naming it, as a sequential look
  would, and the warnings are emitted in source order from the calling thread;
* read at most :data:`MAX_TOTAL_SAMPLES` lengths over all sources (each at least :data:`MIN_SAMPLES`),
  so a mixture of hundreds of sources does not read (and decode) 2,048 samples of each;
* read at most :data:`MAX_BYTES` of each source, and beyond 32 sources :data:`MAX_TOTAL_BYTES`
  over all of them (each at least :data:`MIN_BYTES`), whatever the samples weigh: a source's shards
  are read no further than that bound, local and remote alike, so 1,000 sources read about 130 MB;
* read only what they use: remote shards as ranged requests with an end byte, sized from what the
  samples read so far measure (:class:`mixer.storage.windows.WindowedStream`), stopping at ``max_samples``;
* under ``torch.distributed`` (``Mixture(profile_share=)``), are profiled by rank 0 of the group
  only, and the result (or the error) is broadcast to the other ranks, which read nothing (a
  mixture shares its listings and index checks the same way: :mod:`mixer.plan.startup`).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, Literal, cast

import numpy as np

from mixer import _warn, storage
from mixer.errors import ConfigError, MixerError, SampleError, ShardError
from mixer.plan.profile_cache import ProfileCache, cache_key, lengths_of
from mixer.read.counters import Counters
from mixer.read.sample import _decoded, _fit, _skip_or_raise
from mixer.read.tario import read_samples
from mixer.read.text import Measure, TextDecode, chunk_lengths
from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import ListedSource, Source
from mixer.storage.compressed import codec_of
from mixer.storage.registry import backend_for
from mixer.storage.windows import MIN_WINDOW, WindowedStream

log = logging.getLogger(__name__)

MAX_SAMPLES = 2048  # lengths read per source (spread over its shards)
MAX_TOTAL_SAMPLES = 65_536
"""Lengths read over all the sources looked at together: beyond 32 sources each reads fewer than
:data:`MAX_SAMPLES`, down to :data:`MIN_SAMPLES`, so start-up grows far slower than the source count
(at 100 sources, 655 each: 16 equal-mass bucket edges still rest on ~40 lengths apiece)."""
MIN_SAMPLES = 512
MAX_SHARDS = 3  # shards read per source: the first, the middle and the last
MAX_BYTES = 4 << 20
"""Shard bytes one source's look reads at most (split evenly over the shards it reads): 2,048
samples of up to 2 kB (~400 int32 tokens); a source of longer samples reads fewer."""
MAX_TOTAL_BYTES = 128 << 20
"""Shard bytes read over all the sources looked at together: beyond 32 sources each reads at most
``max(MIN_BYTES, MAX_TOTAL_BYTES / sources)`` (131 kB each at 1,000)."""
MIN_BYTES = 128 << 10
"""The least byte bound of one source's look (two :data:`MIN_WINDOW` requests: at this bound a
source reads two shards, the first and the last, one request each)."""
MAX_CONCURRENT = 64
"""Sources profiled at once (threads; each holds at most one open shard), and no more than the
smallest ``max_connections`` of the sources (:class:`mixer.IOOptions`): enough to hide 50-100 ms of
time to first byte over a thousand sources, within the connections the sources allow."""
FIRST_WINDOW = 1 << 20  # the most the first request for a source asks for, before any sample is measured
FIRST_BYTES_PER_SAMPLE = 2048  # ... sized for the samples wanted at this many bytes each (token samples are ~1-2 kB)
SLACK = 1.15  # requests ask for this much more than the samples measured so far predict

Origin = Literal["read", "cache", "given", "index"]


@dataclass(frozen=True)
class Profile:
    """What one up-front look at a source measured: a sample of lengths (for bucket edges) and the
    size in tokens, given or estimated as ``total shard bytes * tokens per byte`` measured on the
    samples read (shards whose byte size the listing did not give are assumed average-sized).
    ``skipped``: samples the look skipped under ``on_error="skip"`` (the readers meet them again,
    skip them again and count them in ``skipped_samples``); ``retries``: retried requests.
    ``origin``: ``"read"`` from the shards, ``"cache"`` from the profile cache (nothing read),
    ``"given"`` (``Source.size`` given and no lengths needed: nothing read, ``lengths`` empty), or
    ``"index"`` (from the source's shard index: nothing read, the size exact)."""

    lengths: np.ndarray
    tokens_per_byte: float
    size: float
    estimated: bool
    skipped: int = 0
    retries: int = 0
    origin: Origin = "read"


def needs_profile(source: Source, budget: TokenBudget | Packed) -> bool:
    """Whether ``source`` must be looked at: its size is not given, or the bucket edges are derived
    from lengths (a ``TokenBudget`` without ``buckets``; ``Packed`` has no edges)."""
    return source.size is None or (isinstance(budget, TokenBudget) and budget.buckets is None)


def _picks(n: int, max_shards: int) -> list[int]:
    return sorted({round(i * (n - 1) / max(max_shards - 1, 1)) for i in range(min(max_shards, n))})


def _open(url: str, source: Source, want: int, size: int | None, limit: int | None) -> BinaryIO:
    """The shard from its first byte; ``limit``: it ends before that byte (None: at its end)."""
    kwargs = {
        "storage_options": dict(source.storage_options or {}),
        "allow_pipe": source.allow_pipe,
        **storage.IOOptions.of(source.io_options).open_kwargs(),
    }
    if not backend_for(url).remote or codec_of(url) is not None:
        # Local: the same bytes a remote look gets, so both give the same profile; compressed: from the start.
        return storage.open_shard(url, end_offset=limit, **kwargs)

    def open_range(start: int, end: int) -> BinaryIO:
        return storage.open_shard(url, start_offset=start, end_offset=end, **kwargs)

    return cast(BinaryIO, WindowedStream(open_range, want=want, size=size, end=limit))


def _bound(url: str, size: int | None, limit: int | None) -> int | None:
    """The byte a look at one shard stops before: None when the bound does not cut the shard (or
    cannot: compressed shards and pipes are read from their start, without an end byte)."""
    if (
        limit is None
        or (size is not None and size <= limit)
        or codec_of(url) is not None
        or not backend_for(url).ranged
    ):
        return None
    return limit


def _cut_by_bound(exc: ShardError, limit: int | None) -> bool:
    """Whether ``exc`` is the tar reader running out of bytes at the look's own bound (the samples
    before it were whole), not damage: the shard goes on past the bound."""
    return limit is not None and bool(getattr(exc, "truncated", False)) and int(getattr(exc, "stop", -1)) >= limit


def _given(p: Profile, source: Source) -> Profile:
    if source.size is not None:
        return replace(p, size=source.size, estimated=False)
    if p.origin == "read":
        log.info(
            "source %r: estimated size %.3g tokens (%.4f tokens/byte over %d samples)",
            source.name,
            p.size,
            p.tokens_per_byte,
            p.lengths.size,
        )
    return p


def _look(
    listed: ListedSource,
    budget: TokenBudget | Packed,
    *,
    max_samples: int = MAX_SAMPLES,
    max_shards: int = MAX_SHARDS,
    max_bytes: int | None = None,
    warn: Callable[[str], None] = _warn.warn,
) -> Profile:
    """Read up to ``max_samples`` samples from up to ``max_shards`` shards spread over the sorted
    list (the same number from each), and of each shard at most ``max_bytes / shards`` bytes from
    its start (None: no bound; a shard whose first sample is longer is read up to four times as far,
    and again, until it gives one); the size is always the estimate. Runs once per job; the
    result travels to every reader with the mixture. Remote shards are read with ranged requests that
    end about where the last sample wanted ends (the first request of a source asks for
    :data:`FIRST_BYTES_PER_SAMPLE` per sample wanted, at most :data:`FIRST_WINDOW` bytes; later ones
    for what the samples measured so far predict).

    Every sample read is judged as a reader judges it (:func:`~mixer.read.sample.make_sample`'s decode, length policy
    for ``budget`` and ``on_error``): a sample too long for the budget is the same error naming
    source, shard and key, raised or skipped (and counted in ``skipped``) by the source's policy.
    The lengths recorded are those decoded, before truncation, so the size counts source tokens.
    ``warn``: where the warnings go (the parallel look collects them, to emit them in order)."""
    source, shards = listed.source, listed.shards
    n = len(shards)
    picks = _picks(n, max_shards)
    per_shard = max(1, max_samples // len(picks))
    shard_limit = None if max_bytes is None else max(1, max_bytes // len(picks))
    text = Measure(source.decode, len(picks)) if isinstance(source.decode, TextDecode) else None
    lengths: list[int] = []
    scratch = Counters()  # the policy's counts while profiling (skipped_samples is reported)
    warned: set[int] = set()

    def warn_once(shard: int, message: str) -> None:
        if shard not in warned:
            warned.add(shard)
            warn(f"{message} (seen while profiling the source)")

    nbytes = 0
    seen_bytes = seen_samples = 0  # measured so far: sizes the next requests
    retries = 0
    told: list[int] = []  # shard sizes the servers gave while we read (remote shards listed without sizes)
    for shard in picks:
        url = shards[shard]
        limit = _bound(url, listed.shard_bytes[shard], shard_limit)
        start = None
        end = 0
        count = 0
        got: list[int] = []
        stream = None
        bps = seen_bytes / seen_samples if seen_samples else 0.0
        want = (
            math.ceil((per_shard + 1) * bps * SLACK) if bps else min(FIRST_WINDOW, per_shard * FIRST_BYTES_PER_SAMPLE)
        )
        while True:
            whole = cut = False  # read to max_samples, the shard's end or the bound, without damage; at the bound
            try:
                with _open(url, source, want, listed.shard_bytes[shard], limit) as stream:
                    for raw in read_samples(stream, url=storage.redact(url)):
                        if start is None:
                            start = raw["__offset__"]
                        end = raw["__end__"]
                        count += 1
                        if isinstance(stream, WindowedStream):  # what the samples still wanted will take
                            stream.want = math.ceil((per_shard - count + 1) * (end - start) / count * SLACK)
                        try:
                            if text is not None:  # its size in characters; tokens estimated below
                                got.append(text.add(raw, shard))
                            else:
                                decoded = _decoded(source, raw, scratch)
                                if decoded is not None:  # else the decode filtered the sample out
                                    _fit(source, budget, scratch, raw, *decoded)
                                    got.append(decoded[1])
                        except SampleError as exc:
                            _skip_or_raise(source, scratch, raw, shard, exc, warn_once)
                        if count >= per_shard:
                            break
                whole = True
            except ShardError as exc:
                if _cut_by_bound(exc, limit):  # the bound, not damage: the samples before it are whole
                    whole = cut = True
                # The readers meet this shard again and apply (and count) the policy there; the samples
                # read whole before the damage still tell lengths.
                elif source.on_error == "raise":
                    raise ShardError(f"source {source.name!r}: {exc}") from exc
                else:
                    warn(f"source {source.name!r}: profiling skips shard {storage.redact(url)}: {exc}")
            retries += int(getattr(stream, "retries", 0) or 0)
            if cut and count == 0:  # a first sample longer than the bound: look four times as far
                assert limit is not None
                size = listed.shard_bytes[shard]
                limit = _bound(url, size if size is not None else getattr(stream, "size", None), 4 * limit)
                want, stream = limit or want, None
                continue
            size_told = getattr(stream, "size", None) if whole else None
            if size_told is not None:
                told.append(int(size_told))
            break
        lengths += got
        scale = getattr(stream, "ratio", 1.0)  # compressed shards: offsets are uncompressed, listed sizes not
        nbytes += round((end - (start or 0)) * scale)
        if count:
            seen_bytes += end - (start or 0)
            seen_samples += count
    skipped = scratch.skipped_samples
    if not lengths:
        also = f" ({skipped} skipped as bad)" if skipped else ""
        raise ShardError(
            f"source {source.name!r}: no samples found in shards {[storage.redact(shards[p]) for p in picks]}{also}"
        )
    if skipped:
        log.warning(
            "source %r: profiling skipped %d bad sample(s) of %d read (on_error='skip')",
            source.name,
            skipped,
            len(lengths) + skipped,
        )
    arr = np.asarray(lengths, dtype=np.int64)
    if text is not None:  # documents' tokens, estimated; the lengths are those of their chunks
        arr = text.tokens(arr)
    tpb = float(arr.sum()) / max(nbytes, 1)
    if text is not None:
        arr = chunk_lengths(arr, text.decode.chunk_length(budget.longest))
    known = [b for b in listed.shard_bytes if b is not None]
    if len(known) < n:
        pool: list[float] = [*known, *told] or [nbytes / len(picks)]
        mean = sum(pool) / len(pool)
        total = sum(known) + mean * (n - len(known))
    else:
        total = float(sum(known))
    # Always the estimate (a cached look serves the source with or without a given size).
    return Profile(arr, tpb, max(total * tpb, 1.0), True, skipped, retries)


def list_source(source: Source) -> ListedSource:
    """List a source's shards, sorted: the I/O of building a mixture, done once in the main process
    (with its shard index loaded and verified, when ``Source.index`` asks for one). A mixture lists
    all its sources at once, once per job (:mod:`mixer.plan.startup`)."""
    try:
        listed = storage.expand_urls(list(source.urls), storage_options=dict(source.storage_options or {}))
    except MixerError as exc:
        raise type(exc)(f"source {source.name!r}: {exc}") from exc
    return listed_from(source, listed)


def listed_from(
    source: Source,
    listed: Sequence[tuple[str, int | None]],
    states: Sequence[tuple[int, str | None]] | None = None,
) -> ListedSource:
    """``source`` with the shards its listing gave (``[(url, size or None)]``, sorted), and its shard
    index loaded and verified when ``Source.index`` asks for one: against ``states`` (each shard's
    size and validator, :func:`mixer.plan.index.stat_shard`) when given, else asking the storage."""
    if source.index:  # [index] exact sizes, and the sample ranges the readers split by
        from mixer.plan.index import index_for

        idx = index_for(source, listed, states)
        return ListedSource(source, idx.shards, idx.sizes, idx)
    return ListedSource(source, storage.ShardList(url for url, _ in listed), tuple(nbytes for _, nbytes in listed))


def _from_index(ls: ListedSource, budget: TokenBudget | Packed) -> Profile:
    """[index] The profile an index gives without reading: exact size, lengths from the index."""
    idx = ls.index
    tokens = float(idx.tokens.sum())
    lengths = idx.length_sample()
    decode = ls.source.decode
    if isinstance(decode, TextDecode):  # an index counts documents: the stream delivers their chunks
        lengths = chunk_lengths(lengths, decode.chunk_length(budget.longest))
    return Profile(lengths, tokens / max(int(idx.sizes.sum()), 1), max(tokens, 1.0), False, origin="index")


def profile_sources(
    listed: Sequence[ListedSource],
    budget: TokenBudget | Packed,
    *,
    cache: str | os.PathLike[str] | None = None,
    share: bool | None = None,
    group: Any = None,
    max_samples: int = MAX_SAMPLES,
    max_shards: int = MAX_SHARDS,
    concurrency: int | None = None,
    max_total: int = MAX_TOTAL_SAMPLES,
    max_bytes: int = MAX_BYTES,
    max_total_bytes: int = MAX_TOTAL_BYTES,
) -> list[Profile]:
    """The profile of every source, in source order (see the module docstring): ``"given"`` for a
    source that needs none (:func:`needs_profile`), else from ``cache`` (a directory, or None for
    no cache) or read, ``concurrency`` (None: :data:`MAX_CONCURRENT`, at most the sources' smallest
    ``max_connections``) sources at once, each at most ``max_samples`` lengths and together about
    ``max_total`` (see :data:`MAX_TOTAL_SAMPLES`), and each at most ``max_bytes`` shard bytes and
    together about ``max_total_bytes`` (see :data:`MAX_TOTAL_BYTES`; fewer shards when a source's
    bound is under three :data:`MIN_WINDOW` requests). ``share``: None shares the look over the
    process group ``group`` (None: the default group) when one with more than one rank is
    initialized; True requires one; False looks on every rank. Sharing is a collective: every rank
    of the group must build the mixture."""
    todo = [i for i, ls in enumerate(listed) if needs_profile(ls.source, budget) and ls.index is None]
    out: list[Profile] = [
        _given(_from_index(ls, budget), ls.source)
        if ls.index is not None and needs_profile(ls.source, budget)
        else Profile(np.zeros(0, dtype=np.int64), math.nan, float(ls.source.size or 0.0), False, origin="given")
        for ls in listed
    ]
    if not todo:
        return out
    shared = _share_group(share, group)
    max_samples = min(max_samples, max(MIN_SAMPLES, max_total // len(todo)))
    max_bytes = min(max_bytes, max(MIN_BYTES, max_total_bytes // len(todo)))
    max_shards = max(1, min(max_shards, max_bytes // MIN_WINDOW))
    if concurrency is None:
        connections = min(storage.IOOptions.of(listed[i].source.io_options).max_connections for i in todo)
        concurrency = min(MAX_CONCURRENT, connections)

    def look() -> list[Profile]:
        return _look_all([listed[i] for i in todo], budget, cache, max_samples, max_shards, max_bytes, concurrency)

    looked = (
        look()
        if shared is None
        else _broadcast(look, [(listed[i].name, len(listed[i].shards)) for i in todo], shared[0])
    )
    for i, p in zip(todo, looked):
        out[i] = _given(p, listed[i].source)
    return out


def _look_all(
    todo: list[ListedSource],
    budget: TokenBudget | Packed,
    cache: str | os.PathLike[str] | None,
    max_samples: int,
    max_shards: int,
    max_bytes: int,
    concurrency: int,
) -> list[Profile]:
    store = ProfileCache(cache) if cache is not None else None
    keys: list[str | None] = [None] * len(todo)
    results: list[Profile | None] = [None] * len(todo)
    if store is not None:
        for j, ls in enumerate(todo):
            keys[j] = key = cache_key(
                ls,
                budget,
                _picks(len(ls.shards), max_shards),
                max_samples=max_samples,
                max_shards=max_shards,
                # Keys of looks under the default bound stay those written before there was one (the
                # bound binds there only on sources of samples over 2 kB).
                max_bytes=max_bytes if max_bytes < MAX_BYTES else None,
            )
            entry = store.load(key) if key is not None else None
            if entry is not None:
                results[j] = Profile(
                    lengths_of(entry),
                    float(entry["tokens_per_byte"]),
                    float(entry["size"]),
                    True,
                    int(entry["skipped"]),
                    0,
                    "cache",
                )
    misses = [j for j, r in enumerate(results) if r is None]
    if not misses:
        return [r for r in results if r is not None]
    warned: list[list[str]] = [[] for _ in todo]
    pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(misses))), thread_name_prefix="mixer-profile")
    try:
        futures = {
            j: pool.submit(
                _look,
                todo[j],
                budget,
                max_samples=max_samples,
                max_shards=max_shards,
                max_bytes=max_bytes,
                warn=warned[j].append,
            )
            for j in misses
        }
        for j in misses:  # in source order: the warnings, and the error a sequential look would raise first
            try:
                results[j] = p = futures[j].result()
            finally:
                for message in warned[j]:
                    _warn.warn(message)
            key = keys[j]
            if store is not None and key is not None:
                store.store(
                    key,
                    {
                        "lengths": p.lengths.tolist(),
                        "tokens_per_byte": p.tokens_per_byte,
                        "size": p.size,
                        "skipped": p.skipped,
                    },
                )
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [r for r in results if r is not None]


def _share_group(share: bool | None, group: Any) -> tuple[Any] | None:
    """``(group,)`` when the look is shared over ``group`` (None: the default group), else None."""
    if share is False:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if share:
            raise ConfigError("profile_share=True needs an initialized torch.distributed process group")
        return None
    return (group,) if dist.get_world_size(group) > 1 else None


def _broadcast(look: Callable[[], Sequence[Any]], what: list[tuple[str, int]], group: Any) -> list[Any]:
    """``look()`` on rank 0 of ``group``, its result (or its error) broadcast to the other ranks,
    which check that they list the same sources alike. Over CPU objects: a group whose backend has
    no CPU collectives (NCCL) gets a gloo group over the same ranks, as :mod:`mixer.runtime.distributed` does."""
    import torch.distributed as dist

    from mixer import collective

    if not collective.handles_cpu(group):  # NCCL only: object collectives would need each rank's GPU set already
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", what, look())
        except BaseException as exc:
            error = exc
            box[0] = ("error", what, _portable(exc))
    dist.broadcast_object_list(box, src=src, group=group)
    if error is not None:
        raise error
    kind, theirs, value = box[0]
    if kind == "error":
        raise value
    for (name, n), (_, m) in zip(what, theirs):
        if n != m:
            raise ConfigError(
                f"source {name!r}: this rank lists {n} shard(s), rank 0 of the group {m}; every rank must see the "
                "same shards"
            )
    return list(value)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else a :class:`MixerError` with its message."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:  # noqa: BLE001 (an exception whose constructor needs more than its message)
        pass
    for cls in (ShardError, SampleError, ConfigError, MixerError):
        if isinstance(exc, cls):
            return cls(str(exc))
    return MixerError(f"{type(exc).__name__}: {exc}")


def check_profile_cache(value: Any) -> str | os.PathLike[str] | None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"profile_cache: must be a directory path or None, got {value!r} ({type(value).__name__})")
    if isinstance(value, str) and not value:
        raise ConfigError("profile_cache: must be a directory path or None, got ''")
    return value


def check_profile_share(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"profile_share: must be true, false or None, got {value!r} ({type(value).__name__})")
    return value
