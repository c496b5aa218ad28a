"""Opening one shard: `open_shard` (any URL, at a byte offset, decompressed where the name says so)
and `ReadAhead` (one reader's shards in turn, the next ones already downloading)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO, cast

from mixer.errors import ConfigError, MixerError, ShardError
from mixer.storage.backend import Request
from mixer.storage.compressed import DecompressingStream, codec_of
from mixer.storage.options import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_CONNECTIONS, IOOptions
from mixer.storage.registry import SCHEMES
from mixer.storage.remote import RemoteStream
from mixer.storage.urls import check_url, redact
from mixer.storage.windows import WindowedStream

__all__ = ["ReadAhead", "open_shard", "stream_size"]


def open_shard(
    url: str,
    *,
    start_offset: int = 0,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 60.0,
    retries: int = 5,
    backoff: float = 0.5,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    allow_pipe: bool = False,
    end_offset: int | None = None,
) -> BinaryIO:
    """A readable binary stream of the shard at ``url``, positioned at ``start_offset``.

    Local paths and ``file://`` give a plain buffered file (with ``retries = 0``). Remote URLs give a
    `RemoteStream`: resumable, with a timeout on every open and read, and retries of transient faults
    from the exact byte where the stream broke (see there). The stream is opened eagerly, so a missing
    or forbidden shard raises `ShardError` here. ``pipe:`` commands need ``allow_pipe=True``. A remote
    stream holds one of the process's ``max_connections`` while its response is open, and gives it
    up to another stream whose reader waits while nobody reads it (`mixer.storage.pool`).

    A compressed shard (``.tar.gz``, ``.tgz``, ``.tar.xz``) gives a `mixer.storage.compressed.DecompressingStream`:
    ``start_offset`` is then an offset into the uncompressed tar, reached by reading the shard from its
    start and dropping what comes before (see `mixer.storage.compressed` for what that costs).

    ``end_offset``: the stream ends before this byte (of the file, so not for compressed shards nor
    ``pipe:``), and a remote shard is asked for no more: its requests carry the end byte
    (``Range: bytes=start-(end-1)``), so a reader that wants a prefix costs the server that prefix.
    """
    codec = codec_of(url)
    if end_offset is not None:
        scheme = SCHEMES.scheme_of(url)
        if codec is not None or not SCHEMES.for_scheme(scheme).ranged:
            raise ConfigError(
                f"{redact(url)}: end_offset needs an uncompressed shard file (not {codec or f'{scheme}:'})"
            )
        if end_offset < start_offset:
            raise ConfigError(f"{redact(url)}: end_offset must be >= start_offset ({start_offset}), got {end_offset}")
    stream = _new_stream(
        url,
        start_offset=0 if codec else start_offset,
        storage_options=storage_options,
        timeout=timeout,
        retries=retries,
        backoff=backoff,
        block_size=block_size,
        max_connections=max_connections,
        allow_pipe=allow_pipe,
        end_offset=end_offset,
    )
    if isinstance(stream, RemoteStream):
        stream.open_body()
    return _decoded(stream, url, codec, start_offset)


def _decoded(stream: BinaryIO, url: str, codec: str | None, start_offset: int) -> BinaryIO:
    """``stream`` itself, or for a compressed shard its uncompressed bytes from ``start_offset``."""
    if codec is None:
        return stream
    if start_offset < 0:
        stream.close()
        raise ConfigError(f"{redact(url)}: start_offset must be >= 0 (got {start_offset})")
    return cast(BinaryIO, DecompressingStream(stream, url=redact(url), codec=codec, start_offset=start_offset))


def _new_stream(
    url: str,
    *,
    start_offset: int,
    storage_options: dict[str, Any] | None,
    timeout: float,
    retries: int,
    backoff: float,
    block_size: int,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    allow_pipe: bool,
    end_offset: int | None = None,
) -> BinaryIO:
    """`open_shard` up to, not including, the first request of a remote shard (local files and pipes
    are opened)."""
    if start_offset < 0:
        raise ConfigError(f"{redact(url)}: start_offset must be >= 0 (got {start_offset})")
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1 (got {block_size})")
    if timeout <= 0 or retries < 0 or backoff < 0:
        raise ConfigError(f"need timeout > 0, retries >= 0 and backoff >= 0 (got {timeout}, {retries}, {backoff})")
    check_url(url, allow_pipe=allow_pipe)
    scheme = SCHEMES.scheme_of(url)
    request = Request(
        url, scheme, start_offset, end_offset, storage_options, timeout, retries, backoff, block_size, max_connections
    )
    return SCHEMES.for_scheme(scheme).open(request)


class ReadAhead:
    """Opens one reader's shards one after another, with the next ``options.read_ahead`` remote
    shards already downloading while the current one is read: several shards of one reader are
    open at once, so the latency of each request and the first ``block_size`` bytes of each body
    overlap with the decoding of the shard before.

    ``open(url, start_offset, upcoming, end_offset)`` returns the shard's stream exactly as `open_shard` would
    (raising what it would: a shard begun ahead that turned out missing is a `ShardError` here, at
    its turn, under its retry policy and the caller's error policy), using the download begun ahead
    when it starts at that offset; then it begins the first ``read_ahead`` of ``upcoming`` (the URLs
    that follow, consumed lazily) and drops begun downloads no longer among them. Memory stays
    bounded: a shard begun ahead holds at most about 3 x ``block_size`` bytes until it is opened
    (its response then waits, flow-controlled). Connections are bounded too: a shard begun ahead
    waits its turn for one of the process's ``max_connections`` (`mixer.storage.pool`), behind
    every stream whose reader waits. Local files and pipes are opened on demand. A
    `ShardError` from a remote open carries ``retries``, the retries made before it gave up.
    Not thread-safe; ``close()`` drops every download begun ahead (the streams handed out are the
    caller's to close).

    ``window``: read the shard as ranged requests of that many bytes at first (doubling), not one
    open-ended request, and begin nothing ahead: for a source read too rarely to keep its shard open
    (see `mixer.storage.windows`). Remote shards only (HTTP, S3); others open as without it.
    """

    def __init__(
        self,
        *,
        options: IOOptions | Mapping[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        allow_pipe: bool = False,
    ) -> None:
        self.options = IOOptions.of(options)
        self._kwargs: dict[str, Any] = {
            "storage_options": storage_options,
            "allow_pipe": allow_pipe,
            **self.options.open_kwargs(),
        }
        self._begun: dict[str, RemoteStream] = {}

    def open(
        self,
        url: str,
        start_offset: int = 0,
        upcoming: Iterable[str] = (),
        end_offset: int | None = None,
        window: int | None = None,
    ) -> BinaryIO:
        codec = codec_of(url)  # a compressed shard is always read from its first byte
        if window is not None and codec is None and SCHEMES.for_url(url).pumped:
            return self._windowed(url, start_offset, end_offset, window)
        stream = self._begun.pop(url, None)
        if stream is not None and (start_offset != 0 or end_offset is not None) and codec is None:
            stream.close()
            stream = None
        if stream is None:
            start = 0 if codec else start_offset
            stream = cast(RemoteStream, _new_stream(url, start_offset=start, end_offset=end_offset, **self._kwargs))
        nxt = [u for u in itertools.islice(upcoming, self.options.read_ahead) if u != url]
        for u in [u for u in self._begun if u not in nxt]:
            self._begun.pop(u).close()
        try:
            if isinstance(stream, RemoteStream):
                stream.open_body()
        except ShardError as exc:
            exc.retries = stream.retries  # type: ignore[attr-defined]
            raise
        finally:
            # Only now: the shard needed first gets its answer before the ones after it compete.
            for u in nxt:
                if u not in self._begun and SCHEMES.for_url(u).pumped:
                    self._begin(u)
        return _decoded(cast(BinaryIO, stream), url, codec, start_offset)

    def _windowed(self, url: str, start_offset: int, end_offset: int | None, window: int) -> BinaryIO:
        """The shard as ranged requests of ``window`` bytes, doubling up to 4 x ``block_size``
        (`mixer.storage.windows`); nothing begun ahead."""
        self.close()
        kwargs = self._kwargs

        def open_range(start: int, end: int) -> BinaryIO:
            return open_shard(url, start_offset=start, end_offset=end, **kwargs)

        stream = WindowedStream(
            open_range, want=window, start=start_offset, end=end_offset, grow=2.0, max_want=4 * self.options.block_size
        )
        try:
            return cast(BinaryIO, stream.open())
        except ShardError as exc:
            exc.retries = stream.retries  # type: ignore[attr-defined]
            stream.close()
            raise

    def _begin(self, url: str) -> None:
        try:
            stream = cast(RemoteStream, _new_stream(url, start_offset=0, **self._kwargs))
        except MixerError:
            return  # open() raises it again, at this shard's turn
        stream.begin()
        self._begun[url] = stream

    def close(self) -> None:
        begun, self._begun = self._begun, {}
        for stream in begun.values():
            stream.close()

    def __repr__(self) -> str:
        return f"<ReadAhead {len(self._begun)} begun: {[redact(u) for u in self._begun]}>"


def stream_size(handle: Any) -> int | None:
    """The size in tar bytes of an open shard stream, when it tells (None for compressed shards)."""
    if handle is None:
        return None
    size = getattr(handle, "size", None)
    if size is not None:
        return int(size)
    try:
        return os.fstat(handle.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return None
