"""``Source``: one stream of samples as configured (its shard patterns and how to read them).

Configuration only: constructing a ``Source`` checks it and touches no data. Its shards are listed
when a :class:`~mixer.Mixture` is built (once, in the main process, sorted: :class:`ListedSource`);
every reader then derives its part of each source-epoch from :func:`mixer.plan.shards.plan` without
talking to the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

import numpy as np

from mixer import _check, storage
from mixer.errors import ConfigError
from mixer.state.checkpoint import qualname

OnError = Literal["raise", "skip"]
Decode = Callable[[dict[str, Any]], Any]  # a 1-D int array, a mapping of named 1-D arrays, or None
Length = Callable[[dict[str, Any]], int] | str


@dataclass(frozen=True)
class Source:
    """One stream of samples: a set of WebDataset shards and how to read them.

    ``urls``: a brace pattern (``shard-{000..127}.tar``), a list of patterns, a local folder or glob,
    or a remote prefix ending in ``/``; shards are ``.tar`` files, or ``.tar.gz`` / ``.tgz`` /
    ``.tar.xz`` ones decompressed as they stream (:mod:`mixer.storage.compressed`). ``weight`` is the
    static target share (normalised over sources). ``size`` is the source's size in tokens for
    temperature/proportional schedules; when None it is estimated once, up front, identically for every
    reader (see :func:`~mixer.plan.profiling.profile_sources`).
    ``decode(sample) -> 1-D int array`` and ``length(sample) -> int`` replace the default (tokens from
    ``tokens.npy``, else ``input_ids.npy``, else the UTF-8 bytes of ``txt``; length = token count).
    ``decode`` may also return a mapping of named 1-D arrays (multi-field samples, collated by
    ``Mixture(fields=...)``; ``length`` may then name the field that counts, default the first), or
    None to drop the sample (a filter; counted in ``dropped``).
    ``on_error``: ``"raise"`` stops on a bad shard or sample with an error naming it; ``"skip"``
    skips it, counts it (see :class:`~mixer.read.counters.Counters` for what a damaged shard loses) and
    warns once per shard.
    ``storage_options`` go to the fsspec filesystem of remote URLs (endpoint, credentials, ...);
    ``io_options`` (a mapping or :class:`mixer.IOOptions`: ``timeout``, ``retries``, ``backoff``,
    ``block_size``, ``read_ahead``) set how remote shards are read. ``allow_pipe=True`` accepts
    ``pipe:`` URLs (shell commands): only code can pass it, a config file cannot.
    ``index``: use a shard index (:mod:`mixer.plan.index`, ``mixer index``): ``True`` for the index files
    next to the shards, or the path or URL of one index file. With it nothing is read up front
    (exact sizes and lengths) and readers split shards by sample ranges, reading only their bytes; a
    stale index is re-indexed where it can be rewritten, else refused (:func:`mixer.load_index`).

    Frozen and I/O-free: ``urls`` is kept as a tuple of patterns, ``io_options`` as an
    :class:`~mixer.IOOptions`; the shards are listed by the mixture (:class:`ListedSource`).
    """

    name: str
    urls: str | Sequence[str]
    _: KW_ONLY
    weight: float = 1.0
    size: float | None = None
    decode: Decode | None = None
    length: Length | None = None
    on_error: OnError = "raise"
    storage_options: Mapping[str, Any] | None = None
    group: str | None = None
    allow_pipe: bool = False
    io_options: Mapping[str, Any] | storage.IOOptions | None = None
    index: bool | str | None = None

    def __post_init__(self) -> None:
        _check.string(self.name, "Source.name")
        w = f"Source({self.name!r})"
        urls = self.urls
        if isinstance(urls, str):
            urls = (_check.string(urls, f"{w}.urls"),)
        elif isinstance(urls, Sequence) and urls:
            urls = tuple(_check.string(u, _check.at(f"{w}.urls", i)) for i, u in enumerate(urls))
        else:
            _check.fail(f"{w}.urls", f"must be a pattern or a non-empty list of patterns, got {_check.show(urls)}")
        _set(self, "urls", urls)
        _set(self, "weight", float(_check.number(self.weight, f"{w}.weight", minimum=0)))
        _set(
            self,
            "size",
            _check.optional(self.size, lambda v, p: float(_check.number(v, p, minimum=0, strict=True)), f"{w}.size"),
        )
        _check.optional(self.decode, _check.callable_, f"{w}.decode")
        if (
            self.length is not None
            and not callable(self.length)
            and not (isinstance(self.length, str) and self.length.isidentifier())
        ):
            _check.fail(
                f"{w}.length", f"must be callable or the name of a decoded field, got {_check.show(self.length)}"
            )
        _check.choice(self.on_error, f"{w}.on_error", ("raise", "skip"))
        _set(
            self,
            "storage_options",
            dict(_check.mapping(self.storage_options, f"{w}.storage_options"))
            if self.storage_options is not None
            else {},
        )
        _check.optional(self.group, _check.string, f"{w}.group")
        _check.boolean(self.allow_pipe, f"{w}.allow_pipe")
        if (
            self.index is not None
            and not isinstance(self.index, bool)
            and not (isinstance(self.index, str) and self.index)
        ):
            _check.fail(
                f"{w}.index",
                f"must be true, false, None or the path or URL of an index file, got {_check.show(self.index)}",
            )
        try:
            _set(self, "io_options", storage.IOOptions.of(self.io_options))
        except ConfigError as exc:  # IOOptions says "io_options: <rule>" or "io_options.<key>: <rule>"
            raise ConfigError(f"{w}.{exc}") from None
        for i, url in enumerate(urls):
            try:
                storage.check_url(url, allow_pipe=self.allow_pipe)
            except ConfigError as exc:
                raise ConfigError(f"{_check.at(f'{w}.urls', i)}: {exc}") from None

    def describe(self) -> dict[str, Any]:
        """What decides this source's samples (for the mixture's fingerprint); not how they are
        fetched (``storage_options``, ``io_options``, ``allow_pipe``)."""
        length = self.length if isinstance(self.length, str) else qualname(self.length)
        out = {
            "name": self.name,
            "weight": self.weight,
            "size": self.size,
            "decode": qualname(self.decode),
            "length": length,
            "on_error": self.on_error,
            "group": self.group,
        }
        if self.index:  # an index changes which reader reads what (sample ranges)
            out["index"] = True
        return out


@dataclass(frozen=True)
class ListedSource:
    """A source with its shards listed (sorted; byte sizes where the listing gave them), as the
    mixture lists it once in the main process and hands it to every reader; ``index``: its loaded
    shard index (:class:`mixer.plan.shard_index.ShardIndex`) when the source uses one. ``shards`` is a
    :class:`mixer.storage.ShardList` (a few bytes per shard, none for a brace range), so a source of
    1e5 shards does not cost every worker a tuple of 1e5 strings."""

    source: Source
    shards: Sequence[str]  # a storage.ShardList (compact), or any sequence of URLs
    shard_bytes: Sequence[int | None] | np.ndarray  # an array (the index's column) for an indexed source
    index: Any = None

    @property
    def name(self) -> str:
        return self.source.name

    def describe(self) -> dict[str, Any]:
        return {**self.source.describe(), "shards": list(self.shards)}


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass normalising its own field
