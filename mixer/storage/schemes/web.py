"""``http://`` and ``https://``: fsspec's HTTP filesystem (the ``http`` extra: aiohttp). A shard is
fetched with ranged GETs on the filesystem's aiohttp session, whose real status is checked here, and
read ahead by the async pump; a prefix ending in ``/`` is listed from the server's index page; no
globs (``?`` starts a query string). Index files cannot be written there.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

from mixer.storage.backend import FsspecBackend, Request
from mixer.storage.faults import Fault, describe
from mixer.storage.pump import AsyncRead, PumpRemote
from mixer.storage.remote import Remote, parse_content_range
from mixer.storage.urls import redact

__all__ = ["BACKEND", "Http", "http_status"]

log = logging.getLogger(__name__)

AIOHTTP_LIMIT = 100  # aiohttp's default connection pool


class Http(FsspecBackend):
    schemes = ("http", "https")
    extra = "http"
    needs = ("fsspec", "aiohttp")
    authority = "a host"
    pumped = True
    globs = False
    read_only = "HTTP locations are read-only"

    def name(self, url: str) -> str:
        return re.split(r"[?#]", url, maxsplit=1)[0]

    def filesystem_options(self, options: dict[str, Any], *, timeout: float, max_connections: int) -> dict[str, Any]:
        """aiohttp's connection pool made at least ``max_connections`` large (its default is 100), so
        that the streams' pool (`mixer.storage.pool`), not the client's, bounds and queues connections."""
        if max_connections > AIOHTTP_LIMIT and "get_client" not in options:
            options["get_client"] = functools.partial(_http_client, max_connections)
        return options

    def remote_for(self, fs: Any, request: Request) -> Remote:
        return _HTTPRemote(fs, request.url, request.timeout, request.block_size, request.max_connections)

    def classify(self, exc: BaseException) -> Fault | None:
        aiohttp = sys.modules.get("aiohttp")  # never imported here: an aiohttp error means it is loaded
        if aiohttp is None:
            return None
        if isinstance(exc, aiohttp.ClientResponseError):
            return http_status(exc.status)
        if isinstance(exc, aiohttp.ServerTimeoutError):  # a stalled connection: say so, as for other timeouts
            return Fault(f"timed out ({describe(exc)})", transient=True)
        if isinstance(exc, (aiohttp.ClientSSLError, aiohttp.InvalidURL)):
            return Fault(describe(exc), transient=False)
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return Fault(describe(exc), transient=True)
        return None


def http_status(status: int, retry_after: float | None = None) -> Fault:
    """The fault an HTTP status means."""
    if status in (408, 425, 429) or status >= 500:
        return Fault(f"HTTP {status}", transient=True, retry_after=retry_after)
    if status in (404, 410):
        return Fault(f"not found (HTTP {status})", transient=False)
    if status in (401, 403):
        return Fault(f"access denied (HTTP {status})", transient=False)
    if status == 412:
        return Fault("the shard changed while it was being read (HTTP 412: ETag no longer matches)", transient=False)
    return Fault(f"HTTP {status}", transient=False)


async def _http_client(limit: int, **kwargs: Any) -> Any:
    """fsspec's HTTP session, with a connection pool of ``limit`` (unless the options give a connector)."""
    import aiohttp

    if "connector" not in kwargs:
        kwargs["connector"] = aiohttp.TCPConnector(limit=limit)
    return aiohttp.ClientSession(**kwargs)


class _HTTPRemote(PumpRemote):
    """GET with ``Range: bytes=pos-`` (``pos-end`` with an end byte) through the aiohttp session of
    fsspec's HTTP filesystem (so its ``storage_options``, e.g. ``headers`` or ``client_kwargs``, apply),
    with the status checked here."""

    def __init__(self, fs: Any, url: str, timeout: float, block_size: int, max_connections: int) -> None:
        super().__init__(fs, url, timeout, block_size, max_connections)
        self._warned_no_range = False

    async def _aopen(self, pos: int) -> tuple[AsyncRead, Callable[[bool], None]]:
        import aiohttp

        session = await self.fs.set_session()
        kw = dict(self.fs.kwargs)
        kw.pop("timeout", None)
        headers = dict(kw.pop("headers", None) or {})
        headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file itself
        headers["Connection"] = "close"  # one connection per response: see cleanup() below
        if pos or self.end is not None:
            headers["Range"] = f"bytes={pos}-{'' if self.end is None else self.end - 1}"
            if self.etag:
                headers["If-Match"] = self.etag
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
        encode = getattr(self.fs, "encode_url", None)  # fsspec >= 2023.10
        resp = await session.get(
            encode(self.url) if encode else self.url,
            headers=headers,
            timeout=timeout,
            read_bufsize=self.block_size,
            **kw,
        )
        try:
            status = resp.status
            first, total = parse_content_range(resp.headers.get("Content-Range"))
            if status == 416:
                self._past_end(pos, total)
            if status not in (200, 206):
                retry_after = resp.headers.get("Retry-After", "").strip()
                raise http_status(status, float(retry_after) if retry_after.isdigit() else None)
            encoded = resp.headers.get("Content-Encoding", "identity") not in ("identity", "")
            if status == 206:
                if first != pos:
                    raise Fault(f"asked for bytes from {pos}, the server sent them from {first}", transient=False)
                self._learn(total, resp.headers.get("ETag"))
            else:
                self._learn(None if encoded else resp.content_length, resp.headers.get("ETag"))
                if pos:  # the server ignored Range: skip what we already have
                    if not self._warned_no_range:
                        self._warned_no_range = True
                        log.warning(
                            "%s: the server ignores Range; re-reading %d bytes to resume", redact(self.url), pos
                        )
                    left = pos
                    while left:
                        skipped = await resp.content.read(min(left, self.block_size))
                        if not skipped:
                            raise Fault(f"the body ended at byte {pos - left}", transient=True)
                        left -= len(skipped)
        except BaseException:
            resp.close()
            raise

        def cleanup(finished: bool) -> None:
            # Never back to the keep-alive pool (the request asked the server to close, too): aiohttp
            # 3.14.0-3.14.5 re-arms sock_read on a connection released while its body is drained
            # (aio-libs/aiohttp#12953), so the next request on it fails at once with a false timeout;
            # and servers close idle pooled connections. Either would show as a spurious retry. A
            # new connection per response costs one TCP (TLS) handshake per shard.
            resp.close()

        return resp.content.read, cleanup


BACKEND = Http()
