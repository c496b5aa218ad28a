"""``s3://`` (and ``s3a://``): s3fs (the ``s3`` extra). A shard is fetched with ranged GetObject
calls on s3fs's aiobotocore client, read ahead by the async pump; a prefix ending in ``/`` is listed,
a glob globbed. Credentials, endpoint and region are resolved as s3fs resolves them (environment,
profiles, ``AWS_ENDPOINT_URL``, ``storage_options``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from mixer.errors import ConfigError
from mixer.storage.backend import FsspecBackend, Request
from mixer.storage.faults import Fault, describe
from mixer.storage.pump import AsyncRead, PumpRemote
from mixer.storage.remote import Remote, parse_content_range
from mixer.storage.urls import redact

__all__ = ["BACKEND", "S3"]

_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchVersion"}
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidToken",
    "ExpiredToken",
    "403",
}
_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}


class S3(FsspecBackend):
    schemes = ("s3", "s3a")
    extra = "s3"
    needs = ("fsspec", "s3fs")
    authority = "a bucket"
    pumped = True

    def filesystem_options(self, options: dict[str, Any], *, timeout: float, max_connections: int) -> dict[str, Any]:
        """botocore's timeouts default to ``timeout`` and its own retries are switched off (unless the
        options say otherwise): the storage layer retries, resumes and counts itself. Its connection
        pool is made at least ``max_connections`` large (botocore's default is 10), so that the
        streams' pool (`mixer.storage.pool`), not the client's, bounds and queues connections."""
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("max_pool_connections", max(max_connections, 10))
        options["config_kwargs"] = config
        return options

    def close_session(self, fs: Any) -> None:
        if getattr(fs, "_s3creator", None) is not None:
            type(fs).close_session(getattr(fs, "loop", None), fs._s3creator)
        else:
            super().close_session(fs)

    def remote_for(self, fs: Any, request: Request) -> Remote:
        return _S3Remote(fs, request.url, request.timeout, request.block_size, request.max_connections)

    def classify(self, exc: BaseException) -> Fault | None:
        botoexc = sys.modules.get("botocore.exceptions")  # never imported here: loaded if it raised
        if botoexc is None:
            return None
        if isinstance(exc, botoexc.ClientError):
            return _client_error(exc)
        if isinstance(exc, (botoexc.NoCredentialsError, botoexc.PartialCredentialsError)):
            return Fault(
                f"{describe(exc)} (set AWS_ACCESS_KEY_ID / AWS_PROFILE, or key/secret in storage_options; "
                "anon=True for public buckets)",
                transient=False,
            )
        if isinstance(exc, botoexc.SSLError):
            return Fault(describe(exc), transient=False)
        transient = (
            botoexc.HTTPClientError,
            botoexc.IncompleteReadError,
            botoexc.ResponseStreamingError,
            botoexc.ConnectionError,
        )
        return Fault(describe(exc), transient=True) if isinstance(exc, transient) else None


def _client_error(exc: Any) -> Fault:
    """What an S3 error response means, by its code, else its HTTP status."""
    error = exc.response.get("Error", {}) or {}
    code = str(error.get("Code", ""))
    status = int((exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", 0) or 0)
    reason = f"{code or 'error'} (HTTP {status or '?'})"
    if code in _NOT_FOUND or status == 404:
        return Fault(f"not found: {reason}", transient=False)
    if code in _DENIED or status == 403:
        return Fault(f"access denied: {reason}", transient=False)
    if code == "PreconditionFailed" or status == 412:
        return Fault(f"the shard changed while it was being read: {reason}", transient=False)
    if code in _TRANSIENT or status in (408, 429) or status >= 500:
        return Fault(reason, transient=True)
    return Fault(reason, transient=False)


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
            first, total = parse_content_range(resp.get("ContentRange"))
            if pos and first != pos:
                raise Fault(f"asked for bytes from {pos}, S3 sent them from {first}", transient=False)
            self._learn(total if "Range" in kw else resp.get("ContentLength"), resp.get("ETag"))
        except BaseException:
            body.close()
            raise
        return body.read, lambda finished: body.close()


BACKEND = S3()
