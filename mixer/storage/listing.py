"""Listing the shards of a source: brace patterns, local folders and globs, remote prefixes and globs
(each pattern as its scheme's backend lists it: `mixer.storage.backend.Backend.expand`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mixer.errors import ShardError
from mixer.storage.registry import SCHEMES
from mixer.storage.urls import redact

__all__ = ["expand_urls", "lists_remotely"]


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
        scheme = SCHEMES.scheme_of(pattern)
        matched = SCHEMES.for_scheme(scheme).expand(pattern, scheme, storage_options)
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
        scheme = SCHEMES.scheme_of(pattern)
        if SCHEMES.for_scheme(scheme).lists(pattern, scheme):
            return True
    return False
