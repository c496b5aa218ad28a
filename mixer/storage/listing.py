"""Listing the shards of a source: brace patterns, local folders and globs, remote prefixes and globs."""

from __future__ import annotations

import functools
import glob as globmod
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from braceexpand import braceexpand

from mixer.errors import ShardError
from mixer.storage.compressed import SHARD_SUFFIXES, is_shard_name
from mixer.storage.faults import Backoff, retrying
from mixer.storage.filesystems import filesystem
from mixer.storage.urls import check_url, is_local, local_path, redact, scheme_of

__all__ = ["expand_urls", "lists_remotely"]

_T = TypeVar("_T")


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def expand_urls(
    patterns: str | Sequence[str], *, storage_options: dict[str, Any] | None = None
) -> list[tuple[str, int | None]]:
    """The shard list of one source: ``[(url, size in bytes or None)]``, sorted by URL, without duplicates.

    Per pattern: brace patterns (``shard-{000..099}.tar``) expand without listing anything (local ones are
    ``stat``-ed, so a missing local shard fails here; remote sizes stay None); a local folder gives its
    shards (``*.tar``, ``*.tar.gz``, ``*.tgz``, ``*.tar.xz``: see `mixer.storage.compressed`); a local glob
    (``*``, ``?``, ``[``) is globbed; a remote prefix ending in ``/`` (``s3://bucket/dir/``) is listed once,
    keeping its shards with their sizes (of compressed shards: compressed sizes); a remote glob
    (not for http, where ``?`` starts a query) is listed once too. A pattern that matches nothing is a
    `ShardError`. ``pipe:`` patterns (refused earlier by `check_url` unless allowed) are only brace-expanded.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [os.fspath(patterns)]
    found: dict[str, int | None] = {}
    for pattern in patterns:
        pattern = os.fspath(pattern)
        matched = _expand_one(pattern, storage_options)
        if not matched:
            raise ShardError(f"no shards match {redact(pattern)!r}")
        for url, size in matched:
            if found.get(url) is None:
                found[url] = size
    return sorted(found.items())


def lists_remotely(patterns: str | Sequence[str]) -> bool:
    """Whether expanding ``patterns`` sends a listing request: a remote prefix ending in ``/`` or a
    remote glob among them (what `expand_urls` lists; brace patterns and local paths list nothing remote)."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [os.fspath(patterns)]
    for pattern in map(os.fspath, patterns):
        scheme = scheme_of(pattern)
        if scheme is None or scheme == "pipe" or is_local(scheme):
            continue
        web = scheme in ("http", "https")
        for url in braceexpand(pattern):
            if (re.split(r"[?#]", url, maxsplit=1)[0] if web else url).endswith("/"):
                return True
            if not web and _has_magic(url[len(scheme) + 3 :]):
                return True
    return False


def _expand_one(pattern: str, storage_options: dict[str, Any] | None) -> list[tuple[str, int | None]]:
    scheme = scheme_of(pattern)
    if scheme == "pipe":
        return [(url, None) for url in braceexpand(pattern)]
    if is_local(scheme):
        prefix = pattern[:7] if scheme == "file" else ""
        return [(prefix + path, size) for path, size in _expand_local(local_path(pattern), pattern)]
    assert scheme is not None
    check_url(pattern)
    out: list[tuple[str, int | None]] = []
    fs = None
    for url in braceexpand(pattern):
        web = scheme in ("http", "https")
        listing = (re.split(r"[?#]", url, maxsplit=1)[0] if web else url).endswith("/")
        globbing = not web and _has_magic(url[len(scheme) + 3 :])
        if not (listing or globbing):
            out.append((url, None))
            continue
        fs = fs or filesystem(scheme, storage_options, 60.0)
        if listing:
            entries = _retried(functools.partial(_ls, fs, url), f"listing {redact(url)}")
            entries = [e for e in entries if e.get("type", "file") == "file" and is_shard_name(str(e["name"]))]
        else:
            hits = _retried(functools.partial(fs.glob, url, detail=True), f"globbing {redact(url)}")
            entries = [e for e in hits.values() if e.get("type", "file") == "file"]
        for e in entries:
            size = e.get("size")
            out.append((fs.unstrip_protocol(str(e["name"])), int(size) if size is not None else None))
    return out


def _retried(call: Callable[[], _T], what: str) -> _T:
    """A listing call under the streams' retry policy (with the default retries and backoff)."""
    return retrying(call, lambda: what, retries=5, backoff=Backoff(0.5))


def _ls(fs: Any, url: str) -> list[dict[str, Any]]:
    try:
        return list(fs.ls(url, detail=True))
    except FileNotFoundError:  # an empty or missing prefix: "no shards match" names the pattern
        return []


def _expand_local(pattern: str, original: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for path in braceexpand(pattern):
        if os.path.isdir(path):
            tars = sorted(p for p in globmod.glob(os.path.join(globmod.escape(path), "*")) if is_shard_name(p))
            if not tars:
                raise ShardError(
                    f"folder {path!r} (from {original!r}) holds no shards ({', '.join('*' + x for x in SHARD_SUFFIXES)})"
                )
            out.extend((p, os.stat(p).st_size) for p in tars if os.path.isfile(p))
        elif _has_magic(path):
            out.extend((p, os.stat(p).st_size) for p in sorted(globmod.glob(path)) if os.path.isfile(p))
        else:
            try:
                out.append((path, os.stat(path).st_size))
            except OSError as exc:
                raise ShardError(f"shard {path!r} (from {original!r}): {exc.strerror or exc}") from exc
    return out
