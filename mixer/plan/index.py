"""Building and loading shard indexes (``mixer index``, :func:`build_index`, :func:`load_index`).

An index (like Megatron-Energon's ``prepare`` step, MosaicML streaming's ``index.json`` or litdata's
index) records per shard its size, a validator (ETag, else modification time), the sample count, each
sample's byte range and token length (:mod:`mixer.plan.shard_index` holds the format). With one, a
mixture reads nothing up front (exact sizes in tokens, the length distribution for bucket edges) and
splits shards between readers by sample ranges, each reader reading only its byte ranges
(:func:`mixer.plan.shards.plan`).

Where: by default one file per directory of shards, ``<dir>/mixer-index.json.gz``, keyed by file
name (so the directory can move; several sources in one directory share it); or one file at a
chosen ``location`` (local or any fsspec URL), keyed by the shard's path relative to the file's
directory, else by its URL. Building is incremental: a shard whose size and validator match its
entry is not read again. Loading verifies every entry against the storage (``stat`` for local
shards; ``info()`` for remote ones, a HEAD request each, in parallel) and reports a stale or missing
entry by name; ``stale`` chooses what then happens. A mixture asks the storage once per job and
shares the answers with every rank (:mod:`mixer.plan.startup`, :func:`stat_shard`). What a process
loads is the index file's columnar twin, mapped (:mod:`mixer.plan.index_columns`): no object per
shard, one copy of its pages per node.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from mixer import storage
from mixer.errors import ConfigError, MixerError, SampleError, ShardError
from mixer.plan.index_columns import SUFFIX, Columns, Row, cache_path, open_columns, write_columns
from mixer.plan.shard_index import DEFAULT_NAME, EMPTY, Entry, ShardIndex, decode_columns, encode_file, entries_columns
from mixer.read.counters import Counters
from mixer.read.sample import _decoded
from mixer.read.tario import read_samples
from mixer.spec.source import Source
from mixer.state.checkpoint import qualname
from mixer.storage.backend import FsspecBackend
from mixer.storage.options import DEFAULT_MAX_CONNECTIONS
from mixer.storage.registry import SCHEMES, backend_for, local_path

__all__ = ["build_index", "load_index"]

log = logging.getLogger(__name__)

Stale = Literal["auto", "reindex", "refuse"]
WORKERS = 8  # shards indexed (or verified) at once: each thread holds one open shard
SHOWN = 5  # stale shards named in a message


def tokens_by(source: Source) -> str:
    """What the token lengths of an index were measured with: the decode and length policy."""
    length = source.length if isinstance(source.length, str) else qualname(source.length)
    return f"decode={qualname(source.decode)};length={length}"


def build_index(
    source: Source | str | Sequence[str],
    *,
    location: str | None = None,
    workers: int = WORKERS,
    progress: bool = False,
) -> ShardIndex:
    """Index ``source``'s shards (a :class:`~mixer.Source`, or shard patterns read with the default
    decode) and write the index (next to the shards, or at ``location``). Incremental: only shards
    that are new or changed since the index was written are read (``ShardIndex.reindexed`` names
    them). ``workers`` shards are read at once; ``progress`` shows a bar on stderr."""
    return _index(_as_source(source), location, "reindex", True, workers, progress, build=True)


def load_index(
    source: Source | str | Sequence[str],
    *,
    location: str | None = None,
    stale: Stale = "auto",
    verify: bool = True,
    workers: int = WORKERS,
    progress: bool = False,
) -> ShardIndex:
    """The index of ``source``'s listed shards, verified: an entry whose shard's size or validator
    changed, or a shard with no entry, is stale and reported by name. ``stale="reindex"`` reads those
    shards again (and rewrites the index where it can), ``"refuse"`` raises a :class:`ShardError`,
    ``"auto"`` re-indexes when the index location is writable and refuses otherwise.
    ``verify=False`` trusts the entries of remote shards whose listing gave no size (no request)."""
    if stale not in ("auto", "reindex", "refuse"):
        raise ConfigError(f"load_index: stale must be 'auto', 'reindex' or 'refuse', got {stale!r}")
    return _index(_as_source(source), location, stale, verify, workers, progress, build=False)


def _as_source(source: Source | str | Sequence[str]) -> Source:
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)) or (isinstance(source, Sequence) and source):
        first = source if isinstance(source, (str, os.PathLike)) else source[0]
        return Source(storage.redact(os.fspath(first)), source)  # type: ignore[arg-type]  # named by its pattern in messages
    raise ConfigError(f"index: expected a Source or shard patterns, got {source!r}")


def index_for(
    source: Source,
    listed: Sequence[tuple[str, int | None]],
    current: Sequence[tuple[int, str | None]] | None = None,
) -> ShardIndex:
    """The index a mixture uses for ``source`` (``Source.index``), over the listing it made.
    ``current``: every shard's (size, validator) as :func:`stat_shard` found them, when another
    rank already asked the storage (start-up once per job, :mod:`mixer.plan.startup`); None asks now."""
    location = source.index if isinstance(source.index, str) else None
    return _index(source, location, "auto", True, WORKERS, False, build=False, listed=listed, current=current)


def _index(
    source: Source,
    location: str | None,
    stale: Stale,
    verify: bool,
    workers: int,
    progress: bool,
    *,
    build: bool,
    listed: Sequence[tuple[str, int | None]] | None = None,
    current: Sequence[tuple[int, str | None]] | None = None,
) -> ShardIndex:
    if workers < 1:
        raise ConfigError(f"index: workers must be >= 1, got {workers}")
    if listed is None:
        try:
            listed = storage.expand_urls(list(source.urls), storage_options=dict(source.storage_options or {}))
        except MixerError as exc:
            raise type(exc)(f"source {source.name!r}: {exc}") from exc
    urls = [u for u, _ in listed]
    by_loc: dict[str, list[int]] = {}
    for i, url in enumerate(urls):
        by_loc.setdefault(location or _default_location(url), []).append(i)
    want = tokens_by(source)
    files = {loc: _read(loc, source, want) for loc in by_loc}
    rows = {loc: _rows(files[loc], [urls[i] for i in shards], loc) for loc, shards in by_loc.items()}
    if current is None:
        current = _current(source, [(u, n) for u, n in listed], files, by_loc, verify, workers)
    elif len(current) != len(urls):
        raise ConfigError(f"source {source.name!r}: index: {len(current)} shard states for {len(urls)} listed shards")
    todo: list[int] = []
    reasons: list[str] = []
    for loc, shards in by_loc.items():
        have = files[loc]
        for i, row in zip(shards, rows[loc].tolist()):
            size, validator = current[i]
            if row >= 0 and int(have.size[row]) == size and _same(have.validator(row), validator):
                continue
            todo.append(i)
            if row < 0:
                reasons.append(f"{storage.redact(urls[i])} (no entry)")
            else:
                now = f"{size} bytes, {validator}" if validator is not None else f"{size} bytes"
                was = f"{int(have.size[row])} bytes, {have.validator(row)}"
                reasons.append(f"{storage.redact(urls[i])} (indexed: {was}; now: {now})")
    touched = sorted({loc for loc, shards in by_loc.items() if set(shards) & set(todo)})
    if todo and not build:
        _judge(source, stale, touched, reasons)
    if todo:
        fresh = dict(
            zip(todo, _read_shards(source, [urls[i] for i in todo], [current[i] for i in todo], workers, progress))
        )
        for loc in touched:
            have, found = files[loc], rows[loc]
            entries = {have.key(r): Entry.from_json(have.as_json(r), loc) for r in range(len(have))}
            for i, row in zip(by_loc[loc], found.tolist()):
                entries[_key(urls[i], loc)] = fresh[i] if i in fresh else Entry.from_json(have.as_json(row), loc)
            files[loc] = _write(loc, source, entries, want, required=build or stale == "auto")
            rows[loc] = _rows(files[loc], [urls[i] for i in by_loc[loc]], loc)
    for loc, shards in by_loc.items():
        have = files[loc]
        for i, row in zip(shards, rows[loc].tolist()):
            if row in have.damage:
                log.warning(
                    "source %r: index: shard %s is damaged (%s): its %d sample(s) before the damage are read, not the "
                    "rest",
                    source.name,
                    storage.redact(urls[i]),
                    have.damage[row],
                    int(have.samples[row]),
                )
    return ShardIndex(
        storage.ShardList(urls),
        *_placed(files, rows, by_loc, len(urls)),
        want,
        tuple(by_loc),
        tuple(urls[i] for i in todo),
    )


def _rows(cols: Columns, urls: list[str], loc: str) -> np.ndarray:
    """The row of each shard in an index file's columns: by its name relative to the file (else,
    as files written with a ``location`` elsewhere key it, by its URL); -1 for no entry."""
    rows = cols.rows([_key(u, loc) for u in urls])
    missing = np.flatnonzero(rows < 0)
    if len(missing):
        rows[missing] = cols.rows([urls[j] for j in missing.tolist()])
    return rows


def _placed(
    files: dict[str, Columns], rows: dict[str, np.ndarray], by_loc: dict[str, list[int]], n: int
) -> tuple[tuple[Columns, ...], np.ndarray | None]:
    """The parts of a :class:`ShardIndex` and where each shard is in them (None: the shards are the
    rows of one index file in order, nothing per shard to keep)."""
    locs = list(by_loc)
    if len(locs) == 1:
        found = rows[locs[0]]
        if len(found) == len(files[locs[0]]) and np.array_equal(found, np.arange(len(found))):
            return (files[locs[0]],), None
    where = np.zeros((n, 2), dtype=np.int64)
    for p, loc in enumerate(locs):
        where[by_loc[loc], 0] = p
        where[by_loc[loc], 1] = rows[loc]
    return tuple(files[loc] for loc in locs), where


def _same(indexed: str, now: str | None) -> bool:
    """Whether a validator still holds. Validators of different kinds (an ETag from a server, a
    modification time from a file system: the same shards built locally, read over HTTP) cannot be
    compared, and only the size is checked then."""
    if now is None or indexed == now:
        return True
    return indexed.split(":", 1)[0] != now.split(":", 1)[0]


def _judge(source: Source, stale: Stale, locs: list[str], reasons: list[str]) -> None:
    """Stale entries were found: log them by name, or raise under ``refuse`` (or ``auto`` where
    the index cannot be rewritten)."""
    shown = "; ".join(reasons[:SHOWN]) + (f"; and {len(reasons) - SHOWN} more" if len(reasons) > SHOWN else "")
    where = ", ".join(storage.redact(x) for x in locs)
    locked = [x for x in locs if not _writable(x)]
    if stale == "refuse" or (stale == "auto" and locked):
        why = (
            "stale='refuse'"
            if stale == "refuse"
            else f"{', '.join(storage.redact(x) for x in locked)} cannot be written"
        )
        raise ShardError(
            f"source {source.name!r}: index {where} is stale for {len(reasons)} shard(s): {shown}. Not re-indexed "
            f"({why}): rebuild it with `mixer index` (or mixer.build_index), or pass stale='reindex'"
        )
    log.warning(
        "source %r: index %s is stale for %d shard(s), re-indexing them: %s", source.name, where, len(reasons), shown
    )


# ---- where, and what the storage says now ----------------------------------------------------


def _default_location(url: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + DEFAULT_NAME if "/" in url else DEFAULT_NAME


def _key(url: str, loc: str) -> str:
    folder = loc.rsplit("/", 1)[0] + "/" if "/" in loc else ""
    return url[len(folder) :] if folder and url.startswith(folder) else url


def _fs(url: str, source: Source) -> Any:
    scheme = SCHEMES.scheme_of(url)
    backend = SCHEMES.for_scheme(scheme)
    assert scheme is not None and isinstance(backend, FsspecBackend)
    opts = storage.IOOptions.of(source.io_options)
    return backend.filesystem(scheme, dict(source.storage_options or {}), opts.timeout, DEFAULT_MAX_CONNECTIONS)


def _read(loc: str, source: Source, want: str) -> Columns:
    """The entries of the index file at ``loc`` as columns (none when there is no file, or when it
    was measured with another decode: then every entry is stale): its columnar twin mapped when
    one mirrors the file as it is now, else the file parsed once and its twin written for the next
    reader (:mod:`mixer.plan.index_columns`)."""
    identity = _identity(loc, source)
    if identity is None:
        return EMPTY
    cols = next((c for c in map(lambda p: open_columns(p, identity), _twins(loc, identity)) if c is not None), None)
    if cols is None:
        try:
            path = local_path(loc)
            if path is not None:
                with open(path, "rb") as f:
                    data = f.read()
            else:
                data = _fs(loc, source).cat_file(loc)
        except FileNotFoundError:
            return EMPTY
        except OSError as exc:
            raise ShardError(f"source {source.name!r}: cannot read index {storage.redact(loc)}: {exc}") from exc
        cols = _twinned(decode_columns(data, storage.redact(loc), identity), loc)
    if cols.tokens_by != want:
        log.warning(
            "source %r: index %s measured token lengths with %s, the source uses %s: every entry is stale",
            source.name,
            storage.redact(loc),
            cols.tokens_by,
            want,
        )
        return EMPTY
    return cols


def _identity(loc: str, source: Source) -> str | None:
    """What tells this version of the index file at ``loc`` from another (None: there is none):
    size, modification time and inode of a local file (a rewrite is a new file), size and ETag
    (else modification time) of a remote one."""
    try:
        path = local_path(loc)
        if path is not None:
            st = os.stat(path)
            return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        info = _fs(loc, source).info(loc)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ShardError(f"source {source.name!r}: cannot read index {storage.redact(loc)}: {exc}") from exc
    lower = {str(k).lower(): v for k, v in info.items()}
    tag = next((str(lower[k]) for k in ("etag", "last_modified", "lastmodified", "mtime") if lower.get(k)), "")
    return f"{info.get('size')}:{tag.strip()}"


def _twins(loc: str, identity: str) -> list[str]:
    """Where the columnar twin of the index file at ``loc`` may be: beside it (a local file), then
    in this machine's cache (a remote or read-only location); nowhere for a remote file whose
    storage gives neither ETag nor modification time (a new version could not be told from the
    twin's: such a file is parsed at every load)."""
    if identity.endswith(":"):
        return []
    path = local_path(loc)
    beside = [path + SUFFIX] if path is not None else []
    return [*beside, cache_path(loc, identity)]


def _twinned(cols: Columns, loc: str) -> Columns:
    """``cols`` written as the twin of ``loc`` and mapped from there (the first place that takes
    it); kept in memory when none does (then only this process holds it)."""
    assert cols.identity is not None
    for path in _twins(loc, cols.identity):
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write_columns(cols, path)
        except OSError as exc:
            log.debug("index %s: cannot write its columns to %s (%s)", storage.redact(loc), path, exc)
            continue
        mapped = open_columns(path, cols.identity)
        if mapped is not None:
            return mapped
    return cols


def _writable(loc: str) -> bool:
    path = local_path(loc)
    if path is not None:
        return os.access(path if os.path.exists(path) else os.path.dirname(path) or ".", os.W_OK)
    return backend_for(loc).read_only is None  # object stores: try, and say so if it fails


def _write(loc: str, source: Source, entries: dict[str, Entry], want: str, *, required: bool) -> Columns:
    """Write the index file at ``loc`` (and its twin); returns its entries as columns."""
    data = encode_file(entries, want, gz=loc.endswith(".gz"))
    path, read_only = local_path(loc), backend_for(loc).read_only
    try:
        if path is not None:
            folder = os.path.dirname(path) or "."
            fd, tmp = tempfile.mkstemp(prefix=".mixer-index-", dir=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
            except BaseException:
                os.unlink(tmp)
                raise
        elif read_only is not None:
            raise OSError(read_only)
        else:
            _fs(loc, source).pipe_file(loc, data)
    except (OSError, NotImplementedError) as exc:
        if required:
            raise ShardError(f"source {source.name!r}: cannot write index {storage.redact(loc)}: {exc}") from exc
        log.warning(
            "source %r: cannot rewrite index %s (%s); re-indexed in memory only", source.name, storage.redact(loc), exc
        )
        return entries_columns(entries, want, None)
    identity = _identity(loc, source)
    cols = entries_columns(entries, want, identity)
    return _twinned(cols, loc) if identity is not None else cols


def _current(
    source: Source,
    listed: list[tuple[str, int | None]],
    files: dict[str, Columns],
    by_loc: dict[str, list[int]],
    verify: bool,
    workers: int,
) -> list[tuple[int, str | None]]:
    """Every shard's (size, validator) now: local shards by ``stat``, remote ones by ``info()`` (in
    parallel), except, with ``verify=False``, remote shards with an entry: the listing's size
    (or the entry's when the listing gave none) and no validator check."""
    known: dict[int, Row] = {}
    if not verify:
        for loc, shards in by_loc.items():
            for i in shards:
                e = files[loc].get(_key(listed[i][0], loc)) or files[loc].get(listed[i][0])
                if e is not None:
                    known[i] = e

    def one(i: int) -> tuple[int, str | None]:
        url, size = listed[i]
        if i in known and local_path(url) is None:
            return (size if size is not None else known[i].size), None
        return stat_shard(url, source)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mixer-index") as pool:
        return list(pool.map(one, range(len(listed))))


def stat_shard(url: str, source: Source) -> tuple[int, str]:
    """A shard's size and validator now, what loading an index checks its entry against: one
    ``stat`` for a local shard, one ``info()`` (a HEAD request) for a remote one."""
    path = local_path(url)
    try:
        if path is not None:
            st = os.stat(path)
            return st.st_size, f"mtime:{st.st_mtime_ns}"
        info = _fs(url, source).info(url)
    except OSError as exc:
        raise ShardError(f"source {source.name!r}: cannot stat shard {storage.redact(url)}: {exc}") from exc
    lower = {str(k).lower(): v for k, v in info.items()}
    for key in ("etag", "last_modified", "lastmodified", "mtime", "modified"):
        if lower.get(key) is not None:
            return int(info["size"]), f"{'etag' if key == 'etag' else 'mtime'}:{str(lower[key]).strip()}"
    return int(info["size"]), "none"


# ---- reading shards ---------------------------------------------------------------------------


def _read_shards(
    source: Source, urls: list[str], current: list[tuple[int, str | None]], workers: int, progress: bool
) -> list[Entry]:
    from tqdm import tqdm  # only when shards are read

    with (
        ThreadPoolExecutor(max_workers=min(workers, len(urls)), thread_name_prefix="mixer-index") as pool,
        tqdm(
            total=len(urls), unit="shard", desc=f"indexing {source.name}", disable=not progress, file=sys.stderr
        ) as bar,
    ):
        futures = [pool.submit(_index_shard, source, u, c) for u, c in zip(urls, current)]
        out = []
        try:
            for f in futures:
                out.append(f.result())
                bar.update(1)
        finally:
            for f in futures:
                f.cancel()
        return out


def _index_shard(source: Source, url: str, current: tuple[int, str | None]) -> Entry:
    """Read one shard and measure every sample (decoded as the readers decode it)."""
    size, validator = current
    if validator is None:
        size, validator = stat_shard(url, source)
    offsets: list[int] = []
    lengths: list[int] = []
    scratch = Counters()
    end = 0
    damage = None
    kwargs = {
        "storage_options": dict(source.storage_options or {}),
        "allow_pipe": source.allow_pipe,
        **storage.IOOptions.of(source.io_options).open_kwargs(),
    }
    try:
        with storage.open_shard(url, **kwargs) as stream:
            for raw in read_samples(stream, url=storage.redact(url)):
                offsets.append(raw["__offset__"])
                end = raw["__end__"]
                try:
                    decoded = _decoded(source, raw, scratch)
                except SampleError:
                    decoded = None  # the readers meet it again and apply the source's on_error
                lengths.append(decoded[1] if decoded is not None else 0)
    except ShardError as exc:
        if source.on_error == "raise":
            raise ShardError(f"source {source.name!r}: indexing shard {storage.redact(url)}: {exc}") from exc
        damage = str(exc)
    return Entry.make(
        size=size,
        validator=validator,
        offsets=np.asarray([*offsets, end], dtype=np.int64),
        lengths=np.asarray(lengths, dtype=np.int64),
        damage=damage,
    )
