"""Start-up once per job: every source's shards listed, the shard indexes verified and the sources
looked at by one rank, and what it found shared with the others.

Building a :class:`~mixer.Mixture` asks the storage three things before the first batch:

* the listing of each source (:func:`mixer.storage.expand_urls`): a LIST request per remote prefix
  or glob, a ``stat`` per local shard;
* for a source with a shard index (``Source.index``), each shard's size and validator now, to check
  the index's entries against (:func:`mixer.plan.index.stat_shard`: a HEAD request or a ``stat`` each);
* the up-front look at the sources that need one (:mod:`mixer.plan.profiling`): a few ranged GETs each.

:func:`start_up` asks them once per job. Under ``torch.distributed`` (``Mixture(profile_share=)``,
see :func:`mixer.plan.profiling.profile_sources` for when it shares), rank 0 of the group asks
everything and broadcasts what it found, listings, shard states and profiles (and the bucket
edges the mixture derives from them), in one ``broadcast_object_list``; the other ranks send the
storage nothing for it (they read the index files themselves, one GET each). So a job of 1,024
ranks sends the LISTs and HEADs a job of one sends, and an error on rank 0 (a prefix that lists
nothing, a shard that cannot be read) is raised on every rank.

The listings and the shard states are asked for concurrently: at most ``max_connections``
requests at once (the smallest :class:`mixer.IOOptions` value of the sources, default 64), with the
results, and the first error in source order, as asking one at a time would give. With a profile
cache (``Mixture(profile_cache=)``) the listing of a source that lists a remote prefix or glob is
kept there too (:func:`mixer.plan.profile_cache.listing_key`), so a restarted job sends no LIST:
the listing is a snapshot, and shards added under the prefix since are seen once its entry is removed.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from mixer import storage
from mixer.errors import ConfigError, MixerError
from mixer.plan.index import _default_location, stat_shard
from mixer.plan.profile_cache import ProfileCache, listing_key
from mixer.plan.profiling import Profile, _broadcast, _share_group, listed_from, profile_sources
from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import ListedSource, Source
from mixer.storage.listing import lists_remotely

__all__ = ["Found", "list_sources", "start_up", "survey"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")
_D = TypeVar("_D")

AHEAD = 4
"""Requests queued per thread beyond those running: a million shards to ``stat`` never hold a
million futures at once."""


@dataclass(frozen=True)
class Found:
    """What the storage said of one source at start-up, all a rank needs to build its
    :class:`~mixer.spec.source.ListedSource` without asking again: the listing (sorted URLs and their
    byte sizes where it gave them) and, for a source with a shard index, every shard's (size,
    validator) now. Pickled compactly (the URLs as a :class:`mixer.storage.ShardList`)."""

    shards: Sequence[str]
    sizes: tuple[int | None, ...]
    states: tuple[tuple[int, str | None], ...] | None = None

    def listing(self) -> list[tuple[str, int | None]]:
        return list(zip(self.shards, self.sizes))


def start_up(
    sources: Sequence[Source],
    budget: TokenBudget | Packed,
    *,
    cache: str | os.PathLike[str] | None = None,
    share: bool | None = None,
    group: Any = None,
    derive: Callable[[list[Profile]], _D],
) -> tuple[list[ListedSource], list[Profile], _D]:
    """Every source listed (its index loaded and verified) and profiled, and ``derive(profiles)``
    (what the mixture computes from the profiles alone: its bucket edges), once per job (see the
    module docstring): by this process alone, or by rank 0 of ``group`` and broadcast when the
    start-up is shared (``share``, as :func:`~mixer.plan.profiling.profile_sources` takes it). A
    collective when shared: every rank of the group must build the mixture."""
    shared = _share_group(share, group)
    if shared is None:
        listed = list_sources(sources, cache=cache)
        profiles = profile_sources(listed, budget, cache=cache, share=False)
        return listed, profiles, derive(profiles)
    names = [s.name for s in sources]
    mine: list[list[ListedSource]] = []  # rank 0's own, kept rather than built again from what it sends

    def work() -> tuple[list[str], list[Found], list[Profile], _D]:
        started = time.perf_counter()
        found = survey(sources, cache=cache)
        mine.append(_listed(sources, found))
        profiles = profile_sources(mine[0], budget, cache=cache, share=False)
        derived = derive(profiles)
        log.debug(
            "start-up: %d sources listed, verified and looked at in %.2f s; sharing it with the group",
            len(sources),
            time.perf_counter() - started,
        )
        return names, found, profiles, derived

    theirs, found, profiles, derived = _broadcast(work, [], shared[0])
    if theirs != names:
        raise ConfigError(
            f"sources: this rank builds the mixture of {_shown(names)}, rank 0 of the group of {_shown(theirs)}; "
            "every rank must list the same sources in the same order"
        )
    listed = mine[0] if mine else _listed(sources, found)
    return listed, list(profiles), derived


def list_sources(sources: Sequence[Source], *, cache: str | os.PathLike[str] | None = None) -> list[ListedSource]:
    """Every source listed (concurrently, see :func:`survey`) and its shard index loaded and verified."""
    return _listed(sources, survey(sources, cache=cache))


def _listed(sources: Sequence[Source], found: Sequence[Found]) -> list[ListedSource]:
    """The sources as the mixture holds them, from what the storage said of them; their index files
    (a GET each when remote) read concurrently, as :func:`survey` asks, except that sources sharing
    an index file are loaded one after another, in source order (each may re-index its shards and
    rewrite the file: at once, one would drop the other's entries)."""
    if not any(s.index for s in sources):  # nothing to read: the shard lists only
        return [listed_from(s, f.listing(), f.states) for s, f in zip(sources, found)]
    out: list[ListedSource | None] = [None] * len(sources)

    def load(group: list[int]) -> None:
        for i in group:
            out[i] = listed_from(sources[i], found[i].listing(), found[i].states)

    limit = _connections(sources)
    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="mixer-index") as pool:
        _in_order(pool, load, _sharing_files(sources, found), limit * AHEAD)
    return [ls for ls in out if ls is not None]


def _sharing_files(sources: Sequence[Source], found: Sequence[Found]) -> list[list[int]]:
    """The sources in groups that share no index file with another group (a source without an index
    is a group of its own), each group in source order, the groups by their first source."""
    owner: dict[str, int] = {}  # index file -> the group (by its first source) that reads it
    parent = list(range(len(sources)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (s, f) in enumerate(zip(sources, found)):
        if not s.index:
            continue
        files = {s.index} if isinstance(s.index, str) else {_default_location(url) for url in f.shards}
        for name in files:
            j = owner.setdefault(name, i)
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(len(sources)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def _connections(sources: Sequence[Source]) -> int:
    """Requests a start-up sends at once: the smallest ``max_connections`` of the sources."""
    return max(1, min(storage.IOOptions.of(s.io_options).max_connections for s in sources))


def survey(
    sources: Sequence[Source], *, cache: str | os.PathLike[str] | None = None, concurrency: int | None = None
) -> list[Found]:
    """What the storage says of every source: its listing (from ``cache`` where it keeps it), and for
    a source with a shard index each shard's size and validator. ``concurrency`` requests at once
    (None: the smallest ``max_connections`` of the sources); the first error in source order is
    raised, naming its source, as asking one source at a time would."""
    if not sources:
        return []
    limit = concurrency or _connections(sources)
    store = ProfileCache(cache) if cache is not None else None
    with ThreadPoolExecutor(
        max_workers=max(1, limit), thread_name_prefix="mixer-list"
    ) as pool:  # (threads start as needed)
        listings = _in_order(pool, lambda s: _listing(s, store), sources, limit * AHEAD)
        indexed = [(i, url) for i, s in enumerate(sources) if s.index for url, _ in listings[i]]
        states = _in_order(pool, lambda job: stat_shard(job[1], sources[job[0]]), indexed, limit * AHEAD)
    per_source: dict[int, list[tuple[int, str | None]]] = collections.defaultdict(list)
    for (i, _), state in zip(indexed, states):
        per_source[i].append(state)
    return [
        Found(
            storage.ShardList(url for url, _ in listing),
            tuple(size for _, size in listing),
            tuple(per_source[i]) if s.index else None,
        )
        for i, (s, listing) in enumerate(zip(sources, listings))
    ]


def _listing(source: Source, store: ProfileCache | None) -> list[tuple[str, int | None]]:
    """``source``'s shards as :func:`mixer.storage.expand_urls` lists them, or as the cache kept them."""
    key = listing_key(source) if store is not None and lists_remotely(source.urls) else None
    if store is not None and key is not None:
        entry = store.load(key)
        kept = _kept(entry)
        if kept is not None:
            log.info(
                "source %r: %d shard(s) from the listing cached in %s (remove it to list again)",
                source.name,
                len(kept),
                store.directory / f"{key}.json",
            )
            return kept
    try:
        listing = storage.expand_urls(list(source.urls), storage_options=dict(source.storage_options or {}))
    except MixerError as exc:
        raise type(exc)(f"source {source.name!r}: {exc}") from exc
    if store is not None and key is not None:
        store.store(key, {"shards": [[url, size] for url, size in listing]})
    return listing


def _kept(entry: dict[str, Any] | None) -> list[tuple[str, int | None]] | None:
    """A cached listing, or None when there is none or it is not one (then the source is listed)."""
    if entry is None:
        return None
    try:
        kept = [(str(url), None if size is None else int(size)) for url, size in entry["shards"]]
    except (KeyError, TypeError, ValueError):
        return None
    return kept or None


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[_T], _R], items: Iterable[_T], ahead: int) -> list[_R]:
    """``[fn(x) for x in items]`` on ``pool``, at most ``ahead`` queued at once, results in order; the
    first error in that order is raised and what is still queued is cancelled."""
    out: list[_R] = []
    pending: collections.deque[Future[_R]] = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                out.append(pending.popleft().result())
        while pending:
            out.append(pending.popleft().result())
    finally:
        for f in pending:
            f.cancel()
    return out


def _shown(names: Sequence[str]) -> str:
    return f"{len(names)} sources {list(names[:3])}{' ...' if len(names) > 3 else ''}"
