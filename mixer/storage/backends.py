"""The backends: how a shard is fetched from each kind of URL. HTTP(S) and S3 send ranged GETs on the
session of the fsspec filesystem, check the real status and read through the async pump; any other
fsspec protocol is read with ranged ``cat_file`` calls; ``pipe:cmd`` is a shell command's stdout.

fsspec, s3fs and aiohttp are optional (the ``s3`` / ``http`` extras) and imported only when needed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import re
import subprocess
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from mixer.errors import ConfigError, ShardError
from mixer.storage.faults import Fault, http_status
from mixer.storage.pump import AsyncRead, PumpRemote
from mixer.storage.remote import Remote
from mixer.storage.urls import redact

__all__ = ["PUMPED", "PipeStream", "remote_for"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

PUMPED = {"http", "https", "s3", "s3a"}
"""The schemes whose responses are read ahead by the pump (`PumpRemote`), so can be begun early."""


def remote_for(scheme: str, fs: Any, url: str, timeout: float, block_size: int, max_connections: int) -> Remote:
    """The `Remote` that fetches ``url`` (of ``scheme``) through the filesystem ``fs``; HTTP and S3 hold
    at most ``max_connections`` responses open per process (`mixer.storage.pool`)."""
    if scheme in ("http", "https"):
        return _HTTPRemote(fs, url, timeout, block_size, max_connections)
    if scheme in ("s3", "s3a"):
        return _S3Remote(fs, url, timeout, block_size, max_connections)
    return _FsspecRemote(fs, url, timeout)


def _run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
    """Run ``coro`` on fsspec's I/O loop from this (non-loop) thread, cancelled after ``timeout`` s."""
    future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop)
    try:
        return future.result(timeout + 5.0)  # the loop-side wait_for fires first; this guards a wedged loop
    except concurrent.futures.TimeoutError:
        if future.done():
            raise
        future.cancel()
        raise TimeoutError(f"no answer within {timeout + 5.0:.0f}s") from None


def _parse_content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of ``bytes first-last/total`` or ``bytes */total``; None where unknown."""
    if not value:
        return None, None
    m = re.match(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*$", value)
    if not m:
        return None, None
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return first, total


class _HTTPRemote(PumpRemote):
    """GET with ``Range: bytes=pos-`` (``pos-end`` with an end byte) through the aiohttp session of fsspec's HTTP filesystem (so its
    ``storage_options``, e.g. ``headers`` or ``client_kwargs``, apply), with the status checked here."""

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
            first, total = _parse_content_range(resp.headers.get("Content-Range"))
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


class _S3Remote(PumpRemote):
    """GetObject with ``Range=bytes=pos-`` on s3fs's aiobotocore client (credentials, endpoint, region,
    requester-pays as s3fs resolves them: env vars, profiles, ``AWS_ENDPOINT_URL``, storage_options)."""

    def __init__(self, fs: Any, url: str, timeout: float, block_size: int, max_connections: int) -> None:
        super().__init__(fs, url, timeout, block_size, max_connections)
        self.bucket, self.key, self.version = fs.split_path(url)
        if not self.key:
            raise ConfigError(f"{redact(url)}: an s3:// shard URL needs a key after the bucket")

    async def _aopen(self, pos: int) -> tuple[AsyncRead, Callable[[bool], None]]:
        from botocore.exceptions import ClientError

        await self.fs.set_session()
        s3 = await self.fs.get_s3(self.bucket)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, **self.fs.req_kw}
        if self.version:
            kw["VersionId"] = self.version
        if pos or self.end is not None:
            kw["Range"] = f"bytes={pos}-{'' if self.end is None else self.end - 1}"
            if self.etag:
                kw["IfMatch"] = self.etag
        try:
            resp = await s3.get_object(**kw)
        except ClientError as exc:
            error = exc.response.get("Error", {}) or {}
            if error.get("Code") == "InvalidRange":
                total = error.get("ActualObjectSize")
                self._past_end(pos, int(total) if total is not None else None)
            raise
        body = resp["Body"]
        try:
            first, total = _parse_content_range(resp.get("ContentRange"))
            if pos and first != pos:
                raise Fault(f"asked for bytes from {pos}, S3 sent them from {first}", transient=False)
            self._learn(total if "Range" in kw else resp.get("ContentLength"), resp.get("ETag"))
        except BaseException:
            body.close()
            raise
        return body.read, lambda finished: body.close()


class _FsspecRemote(Remote):
    """Any other fsspec protocol: ranged ``cat_file`` calls of at most ``n`` bytes (the backend's own
    timeouts apply; async backends also get ours)."""

    def __init__(self, fs: Any, url: str, timeout: float) -> None:
        super().__init__(fs, url, timeout)
        self._pos = 0

    def open(self, pos: int) -> None:
        if self.size is None:
            info = self._call("info", self.url)
            size = info.get("size")
            self._learn(int(size) if size is not None else None, None)
        if self.size is not None and pos >= self.size:
            self._past_end(pos, self.size)
        self._pos = pos

    def read(self, n: int) -> bytes:
        end = self._pos + n if self.size is None else min(self._pos + n, self.size)
        if self.end is not None:
            end = min(end, self.end)
        if end <= self._pos:
            return b""
        data = bytes(self._call("cat_file", self.url, start=self._pos, end=end))
        self._pos += len(data)
        return data

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.fs, "async_impl", False) and getattr(self.fs, "loop", None) is not None:
            return _run(self.fs.loop, getattr(self.fs, "_" + method)(*args, **kwargs), self.timeout)
        return getattr(self.fs, method)(*args, **kwargs)


class PipeStream(io.BufferedIOBase):
    """webdataset-style ``pipe:cmd``: the command's stdout. A non-zero exit is a `ShardError` at the end."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.retries = 0
        self._proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE)
        self._out = cast(io.BufferedReader, self._proc.stdout)

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        data = self._out.read(-1 if size is None else size)
        if size != 0 and not data:
            self._check_exit()
        return data

    def read1(self, size: int = -1) -> bytes:
        data = self._out.read1(size)
        if not data and size != 0:
            self._check_exit()
        return data

    def _check_exit(self) -> None:
        code = self._proc.wait()
        if code != 0:
            raise ShardError(f"{redact(self.url)}: the command exited with status {code}")

    def close(self) -> None:
        if not self.closed:
            self._out.close()
            if self._proc.poll() is None:
                self._proc.terminate()
            self._proc.wait()
        super().close()
