"""The profile cache: one small JSON file per source profile in a directory, named by a digest of
what the profile is a function of, so a restarted job reads no shard and a changed listing misses.

The key (:func:`cache_key`) covers: the source's shard listing (every URL, with its byte size
where the listing gave one), for local shards the size and modification time of the shards the
profile reads, the source's ``decode``/``length`` (a function by module, name and a digest of its
code; a field name as itself), its ``on_error``, the batching's length policy (kind, ``max_tokens``,
``max_length``, ``overlong``, longest sample) and the profiling parameters (``max_samples``,
``max_shards``, ``max_bytes``). Not covered, by nature: a remote shard rewritten in place under the same URL when
the listing gave no sizes (brace patterns over HTTP/S3 list no sizes), and what a ``decode`` reads
besides its code (a tokenizer file, a global): clear the directory after changing those. A
``decode`` that is not a plain function (a ``functools.partial``, a callable object, a closure over
anything but numbers and strings) has no key: such a source is profiled every time.

The same directory keeps the shard listings of sources that list a remote prefix or glob
(:func:`listing_key`: the patterns and the storage options but credentials), so that a restarted job
sends no LIST either. A listing is a snapshot: shards added under the prefix later are not seen
until its entry (``listing-<digest>.json``) is removed; building the mixture logs each listing taken
from the cache, with the file to remove.

Writes are atomic (a temporary file in the same directory, then ``os.replace``), so concurrent
jobs sharing the directory never read half a file; an unreadable or foreign entry is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import marshal
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import ListedSource, Source
from mixer.storage.registry import local_path

log = logging.getLogger(__name__)

VERSION = 1  # of the key and the file; a new version misses every older entry
_PLAIN = (int, float, str, bool, bytes, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def function_key(fn: Any) -> str | None:
    """A stable name for what ``fn`` computes: module, qualified name and a digest of its code (and
    of its defaults and closure when they are plain values); None when there is no such name."""
    if fn is None or isinstance(fn, str):
        return repr(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(c.cell_contents for c in (fn.__closure__ or ()))
    extra = (fn.__defaults__ or (), tuple(sorted((fn.__kwdefaults__ or {}).items())), cells)
    if not _plain(extra):
        return None
    digest = hashlib.sha256(marshal.dumps(code) + repr(extra).encode()).hexdigest()[:16]
    return f"{fn.__module__}:{fn.__qualname__}:{digest}"


def cache_key(
    listed: ListedSource,
    budget: TokenBudget | Packed,
    picks: Sequence[int],
    *,
    max_samples: int,
    max_shards: int,
    max_bytes: int | None = None,
) -> str | None:
    """The digest naming ``listed``'s profile (see the module docstring), or None when the source's
    ``decode`` or ``length`` has no stable name."""
    source = listed.source
    decode, length = function_key(source.decode), function_key(source.length)
    if decode is None or length is None:
        return None
    local = []
    for i in picks:
        path = local_path(listed.shards[i])
        if path is not None:
            try:
                st = os.stat(path)
            except OSError:
                continue  # profiling meets it and says so
            local.append([i, st.st_size, st.st_mtime_ns])
    head = {
        "version": VERSION,
        "decode": decode,
        "length": length,
        "on_error": source.on_error,
        "budget": [type(budget).__name__, budget.max_tokens, budget.max_length, budget.overlong, budget.longest],
        "max_samples": max_samples,
        "max_shards": max_shards,
        "local": local,
        "shards": len(listed.shards),
    }
    if max_bytes is not None:  # (None: the default bound, absent from the key)
        head["max_bytes"] = max_bytes
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    for url, nbytes in zip(listed.shards, listed.shard_bytes):
        h.update(f"\n{url}\t{nbytes}".encode())
    return h.hexdigest()


_CREDENTIAL = re.compile(r"(?i)(key|secret|token|passw|credential|signature|auth|cookie)")


def listing_key(source: Source) -> str:
    """The name of ``source``'s cached shard listing: a digest of its URL patterns and its storage
    options (endpoint, region...; values under credential-like names are left out, so rotating a
    key does not miss and no secret is hashed into a file name)."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in sorted(value.items()) if not _CREDENTIAL.search(str(k))}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(type(value))

    head = {"version": VERSION, "urls": list(source.urls), "storage": plain(dict(source.storage_options or {}))}
    return "listing-" + hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()


class ProfileCache:
    """Profiles on disk under ``directory`` (created when first written), one ``<key>.json`` each."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry stored under ``key``, or None (absent, unreadable, another version)."""
        try:
            data = json.loads((self.directory / f"{key}.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("profile cache: ignoring unreadable entry %s: %s", self.directory / f"{key}.json", exc)
            return None
        if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
            return None
        return data

    def store(self, key: str, entry: dict[str, Any]) -> None:
        """Write ``entry`` under ``key`` atomically; a failure to write is logged, never raised (the
        profile is still good, only the next start-up reads again)."""
        data = {"version": VERSION, "key": key, **entry}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, separators=(",", ":"))
                os.replace(tmp, self.directory / f"{key}.json")
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("profile cache: cannot write %s: %s", self.directory, exc)


def lengths_of(entry: dict[str, Any]) -> np.ndarray:
    return np.asarray(entry["lengths"], dtype=np.int64)
