"""``Source``: one stream of samples as configured (its shard patterns and how to read them).

A source's shards are listed once, in the main process, sorted; every reader then derives its part
of each source-epoch from :func:`mixer.shards.plan` without talking to the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from . import io
from .errors import ConfigError, MixerError

OnError = Literal["raise", "skip"]
Decode = Callable[[dict[str, Any]], Any]  # a 1-D int array, a mapping of named 1-D arrays, or None
Length = Callable[[dict[str, Any]], int] | str


class Source:
    """One stream of samples: a set of WebDataset shards and how to read them.

    ``urls``: a brace pattern (``shard-{000..127}.tar``), a list of patterns, a local folder or glob,
    or a remote prefix ending in ``/``; shards are ``.tar`` files, or ``.tar.gz`` / ``.tgz`` /
    ``.tar.xz`` ones decompressed as they stream (:mod:`mixer.codecs`). ``weight`` is the static
    target share (normalised over sources). ``size`` is the source's size in tokens for temperature/proportional schedules; when
    None it is estimated once, up front, identically for every reader (see :func:`profile`).
    ``decode(sample) -> 1-D int array`` and ``length(sample) -> int`` replace the default (tokens from
    ``tokens.npy``, else ``input_ids.npy``, else the UTF-8 bytes of ``txt``; length = token count).
    ``decode`` may also return a mapping of named 1-D arrays (multi-field samples, collated by
    ``Mixture(fields=...)``; ``length`` may then name the field that counts, default the first), or
    None to drop the sample (a filter; counted in ``dropped``).
    ``on_error``: ``"raise"`` stops on a bad shard or sample with an error naming it; ``"skip"``
    skips it, counts it (see :class:`Counters` for what a damaged shard loses) and warns once per shard.
    ``storage_options`` go to the fsspec filesystem of remote URLs (endpoint, credentials, ...);
    ``io_options`` (a mapping or :class:`mixer.io.IOOptions`: ``timeout``, ``retries``, ``backoff``,
    ``block_size``, ``read_ahead``) set how remote shards are read. ``allow_pipe=True`` accepts
    ``pipe:`` URLs (shell commands): only code can pass it, a config file cannot.
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
        io_options: Mapping[str, Any] | io.IOOptions | None = None,
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
        if length is not None and not callable(length) and not (isinstance(length, str) and length):
            raise ConfigError(f"{where}: length must be callable or the name of a decoded field (got {length!r})")
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
        self.allow_pipe = bool(allow_pipe)
        try:
            self.io_options = io.IOOptions.of(io_options)
            for p in patterns:
                io.check_url(p, allow_pipe=allow_pipe)
            listed = io.expand_urls(patterns, storage_options=self.storage_options)
        except MixerError as exc:
            raise type(exc)(f"{where}: {exc}") from exc
        self.shards: tuple[str, ...] = tuple(url for url, _ in listed)
        self.shard_bytes: tuple[int | None, ...] = tuple(nbytes for _, nbytes in listed)

    def __repr__(self) -> str:
        return f"Source({self.name!r}, {len(self.shards)} shards, weight={self.weight})"
