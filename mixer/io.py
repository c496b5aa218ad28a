"""Opening any shard URL as a byte stream: local paths, ``file://``, ``s3://``, ``http(s)://`` and other
installed fsspec protocols; listing and expanding shard patterns; redacting URLs for messages.

Local files use plain ``open``. Remote shards are read through fsspec (s3fs for s3, aiohttp through
fsspec's HTTP filesystem for http(s)), but not through fsspec's file objects: those retry nothing and
misreport faults (fsspec's HTTP ``open()`` / ``info()`` turn a 503 or a refused connection into
``FileNotFoundError``; s3fs hides up to ~12 s of retries of a refused connection behind one call). Instead a
`RemoteStream` issues its own GETs from a byte position, through the session of the fsspec filesystem
(so credentials, endpoints and ``storage_options`` work as in fsspec), looks at the real status, and on a
transient fault re-opens at the first byte it has not handed out yet.

fsspec, s3fs and aiohttp are optional (the ``s3`` / ``http`` extras) and imported only when needed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import difflib
import errno
import functools
import glob as globmod
import importlib.util
import io
import itertools
import logging
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar, cast

from braceexpand import braceexpand

from . import logsafe
from .codecs import SHARD_SUFFIXES, DecompressingStream, codec_of, is_shard_name
from .errors import ConfigError, MixerError, ShardError

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 1 << 20
"""Bytes asked of the network per read call; also the read-ahead an open HTTP stream buffers."""

MAX_BACKOFF = 30.0
MAX_RETRY_AFTER = 60.0

_T = TypeVar("_T")

# --------------------------------------------------------------------------------------------- URLs

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*::")
_ANY_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")
_EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "http": ("aiohttp", "http"), "https": ("aiohttp", "http")}
# fsspec protocols that wrap another filesystem (or cache to local disk): not shard URLs on their own.
_WRAPPERS = {
    "blockcache",
    "filecache",
    "simplecache",
    "cached",
    "dir",
    "reference",
    "generic",
    "async_wrapper",
    "asyncwrapper",
}


def _scheme(url: str) -> str | None:
    """The lower-cased scheme; ``"pipe"`` for webdataset's ``pipe:cmd``; None for a local path."""
    if url.startswith("pipe:"):
        return "pipe"
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else None


def _is_local(scheme: str | None) -> bool:
    return scheme is None or scheme == "file"


def _local_path(url: str) -> str:
    return url[len("file://") :] if url[:7].lower() == "file://" else url


def redact(url: str) -> str:
    """``url`` (or any text holding URLs, such as a ``pipe:`` command) safe for logs and errors: every
    ``scheme://`` URL in it loses its credentials (``user:pass@``), query string (presigned signatures,
    tokens) and fragment. Local paths come back unchanged."""
    return _ANY_URL.sub(lambda m: _redact_one(m.group(0)), os.fspath(url))


def _redact_one(url: str) -> str:
    scheme, _, rest = url.partition("://")
    # The authority ends at the first "/"; its last "@" ends the credentials. Credentials go first, so
    # a "?" or "#" inside an (unencoded) password cannot hide them; then the query and fragment go.
    authority, slash, path = rest.partition("/")
    rest = authority.rsplit("@", 1)[-1] + slash + path
    cut = re.search(r"[?#]", rest)
    return f"{scheme}://{rest[: cut.start()] if cut else rest}"


def check_url(url: str, *, allow_pipe: bool = False) -> str:
    """Validate one shard URL or pattern at the door; returns it unchanged.

    Accepted: local paths, ``file://``, ``s3://``, ``http(s)://`` and any other protocol fsspec knows and
    has its backend installed for (``gs://`` with gcsfs, ...). ``pipe:`` (webdataset's shell command) is
    refused unless ``allow_pipe=True``, which only code can pass. A missing backend names the extra to
    install.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"a shard URL must be a non-empty string (got {url!r})")
    if _CHAINED.match(url):
        raise ConfigError(
            f"{redact(url)}: chained fsspec URLs ('a::b') are not supported; pass the options of the inner "
            "filesystem as the source's storage_options"
        )
    scheme = _scheme(url)
    if scheme == "pipe":
        if not allow_pipe:
            raise ConfigError(
                f"{redact(url)}: 'pipe:' URLs run a shell command, so they are refused unless the code that "
                "builds the source passes allow_pipe=True (a config file alone cannot enable them)"
            )
        return url
    if _is_local(scheme):
        if scheme == "file" and not _local_path(url):
            raise ConfigError(f"{url!r}: a file:// URL needs a path")
        return url
    assert scheme is not None
    rest = url[len(scheme) + 3 :]
    if scheme in _EXTRAS:
        _require_backend(scheme)
        if not rest or rest.startswith("/") or rest.split("/", 1)[0].rsplit("@", 1)[-1] == "":
            what = "a bucket" if scheme.startswith("s3") else "a host"
            raise ConfigError(f"{redact(url)}: a {scheme}:// URL needs {what}")
        return url
    if scheme in _WRAPPERS:
        raise ConfigError(
            f"{redact(url)}: the fsspec protocol {scheme!r} wraps another filesystem and is not supported"
        )
    if importlib.util.find_spec("fsspec") is None:
        raise ConfigError(f"{redact(url)}: unsupported URL scheme {scheme!r} (fsspec is not installed)")
    import fsspec

    if scheme not in fsspec.available_protocols():
        raise ConfigError(
            f"{redact(url)}: unsupported URL scheme {scheme!r}; use a local path, file://, s3://, http(s):// "
            "or a protocol of an installed fsspec backend"
        )
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(f"{redact(url)}: the fsspec backend for {scheme!r} is not installed: {exc}") from None
    return url


def _require_backend(scheme: str) -> None:
    module, extra = _EXTRAS[scheme]
    missing = [m for m in ("fsspec", module) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"{scheme}:// shards need {' and '.join(missing)}, which is not installed: pip install 'wds-mixer[{extra}]'"
        )


# -------------------------------------------------------------------------------------- filesystems

_fs_lock = threading.Lock()
_fs_cache: dict[tuple[int, str, str], Any] = {}


def _filesystem(scheme: str, storage_options: dict[str, Any] | None, timeout: float) -> Any:
    """A private (not fsspec-instance-cached) filesystem per (process, protocol, options, timeout).

    For s3 the botocore timeouts default to ``timeout`` and botocore's own retries are switched off
    (unless the options say otherwise): this module retries, resumes and counts itself. The first
    call in a process makes the DEBUG logs of the libraries underneath safe (`mixer.logsafe`).
    """
    logsafe.install()
    if scheme in _EXTRAS:
        _require_backend(scheme)
    import fsspec
    from fsspec.utils import tokenize

    opts = dict(storage_options or {})
    if scheme in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"total_max_attempts": 1})
        opts["config_kwargs"] = config
    key = (os.getpid(), scheme, tokenize(opts))
    with _fs_lock:
        fs = _fs_cache.get(key)
        if fs is None:
            if any(k[0] != key[0] for k in _fs_cache):  # forked: the parent's sessions are not ours
                _fs_cache.clear()
            try:
                fs = fsspec.filesystem(scheme, skip_instance_cache=True, **opts)
            except ImportError as exc:
                raise ConfigError(f"{scheme}:// needs a backend that is not installed: {exc}") from None
            except TypeError as exc:
                raise ConfigError(f"{scheme}://: invalid storage_options: {exc}") from None
            _fs_cache[key] = fs
    return fs


def _close_filesystems() -> None:
    """Close the sessions this module opened (tests use it to leave no connection behind)."""
    with _fs_lock:
        cached = list(_fs_cache.values())
        _fs_cache.clear()
    for fs in cached:
        loop = getattr(fs, "loop", None)
        try:
            if getattr(fs, "_s3creator", None) is not None:
                type(fs).close_session(loop, fs._s3creator)
            elif getattr(fs, "_session", None) is not None:
                type(fs).close_session(loop, fs._session)
        except Exception:  # best effort: a session already gone is fine
            log.debug("closing a filesystem session failed", exc_info=True)


# ------------------------------------------------------------------------------------------ faults


class _Fault(Exception):
    """A fault this module diagnosed itself (an HTTP status, a short body)."""

    def __init__(self, reason: str, *, transient: bool, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transient = transient
        self.retry_after = retry_after


class _EndOfShard(Exception):
    """Opening at this position found nothing left to read (the position is the shard's size)."""


class _RedactedCause(Exception):
    """Stands in for a library exception whose text held a URL with credentials or a query string."""


_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.ENETRESET,
    errno.EAGAIN,
}
_S3_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchVersion"}
_S3_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidToken",
    "ExpiredToken",
    "403",
}
_S3_TRANSIENT = {
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


def _http_status(status: int, retry_after: float | None = None) -> _Fault:
    if status in (408, 425, 429) or status >= 500:
        return _Fault(f"HTTP {status}", transient=True, retry_after=retry_after)
    if status in (404, 410):
        return _Fault(f"not found (HTTP {status})", transient=False)
    if status in (401, 403):
        return _Fault(f"access denied (HTTP {status})", transient=False)
    if status == 412:
        return _Fault("the shard changed while it was being read (HTTP 412: ETag no longer matches)", transient=False)
    return _Fault(f"HTTP {status}", transient=False)


def _describe(exc: BaseException) -> str:
    text = redact(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Bugs, not I/O faults: they propagate unchanged instead of becoming a (skippable) ShardError.
_PROGRAMMING_ERRORS = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    LookupError,
    NotImplementedError,
    ImportError,
)


def _classify(exc: BaseException) -> _Fault | None:
    """Transient (retry) or permanent (raise a ShardError now), with a redacted reason; None for a bug."""
    if isinstance(exc, _Fault):
        return exc
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return _http_status(exc.status)
        if isinstance(exc, aiohttp.ServerTimeoutError):  # a stalled connection: say so, as for other timeouts
            return _Fault(f"timed out ({_describe(exc)})", transient=True)
        if isinstance(exc, (aiohttp.ClientSSLError, aiohttp.InvalidURL)):
            return _Fault(_describe(exc), transient=False)
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return _Fault(_describe(exc), transient=True)
    botoexc = sys.modules.get("botocore.exceptions")
    if botoexc is not None:
        if isinstance(exc, botoexc.ClientError):
            error = exc.response.get("Error", {}) or {}
            code = str(error.get("Code", ""))
            status = int((exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", 0) or 0)
            reason = f"{code or 'error'} (HTTP {status or '?'})"
            if code in _S3_NOT_FOUND or status == 404:
                return _Fault(f"not found: {reason}", transient=False)
            if code in _S3_DENIED or status == 403:
                return _Fault(f"access denied: {reason}", transient=False)
            if code == "PreconditionFailed" or status == 412:
                return _Fault(f"the shard changed while it was being read: {reason}", transient=False)
            if code in _S3_TRANSIENT or status in (408, 429) or status >= 500:
                return _Fault(reason, transient=True)
            return _Fault(reason, transient=False)
        if isinstance(exc, (botoexc.NoCredentialsError, botoexc.PartialCredentialsError)):
            return _Fault(
                f"{_describe(exc)} (set AWS_ACCESS_KEY_ID / AWS_PROFILE, or key/secret in storage_options; "
                "anon=True for public buckets)",
                transient=False,
            )
        if isinstance(exc, botoexc.SSLError):
            return _Fault(_describe(exc), transient=False)
        if isinstance(
            exc,
            (
                botoexc.HTTPClientError,
                botoexc.IncompleteReadError,
                botoexc.ResponseStreamingError,
                botoexc.ConnectionError,
            ),
        ):
            return _Fault(_describe(exc), transient=True)
    if isinstance(exc, FileNotFoundError):
        return _Fault("not found", transient=False)
    if isinstance(exc, PermissionError):
        return _Fault("access denied", transient=False)
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return _Fault(_describe(exc), transient=False)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return _Fault(f"timed out ({_describe(exc)})", transient=True)
    if isinstance(exc, ConnectionError):
        return _Fault(_describe(exc), transient=True)
    if isinstance(exc, OSError):
        return _Fault(_describe(exc), transient=exc.errno is None or exc.errno in _TRANSIENT_ERRNOS)
    if isinstance(exc, _PROGRAMMING_ERRORS):
        return None
    return _Fault(_describe(exc), transient=False)  # e.g. another fsspec backend's own error type


def _safe_cause(exc: BaseException) -> BaseException:
    """``exc`` itself, unless its text (or that of its chain) shows a URL with secrets: then a stand-in."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        text = str(node)
        if redact(text) != text:
            return _RedactedCause(f"{type(exc).__module__}.{type(exc).__qualname__}: {redact(str(exc))}")
        node = node.__cause__ or node.__context__
    return exc


class _Backoff:
    """Exponential backoff with jitter, on a private generator (never the global RNG)."""

    def __init__(self, base: float) -> None:
        self.base = base
        self.rng = random.Random()

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        d = min(self.base * 2.0 ** (attempt - 1), MAX_BACKOFF) * (0.5 + 0.5 * self.rng.random())
        if retry_after is not None:
            d = max(d, min(retry_after, MAX_RETRY_AFTER))
        return d


def _retrying(call: Callable[[], _T], what: str, *, retries: int, backoff: float) -> _T:
    """Run ``call`` (a metadata operation: list, glob) with the same retry policy as the streams."""
    waits = _Backoff(backoff)
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:  # classified: bugs propagate
            fault = _classify(exc)
            if fault is None:
                raise
            if not fault.transient:
                raise ShardError(f"{what}: {fault.reason}") from _safe_cause(exc)
            attempt += 1
            if attempt > retries:
                raise ShardError(f"{what}: {fault.reason}; gave up after {retries} retries") from _safe_cause(exc)
            delay = waits.delay(attempt, fault.retry_after)
            log.warning("%s: %s; retry %d/%d in %.2fs", what, fault.reason, attempt, retries, delay)
            time.sleep(delay)


# -------------------------------------------------------------------------------------- expansion


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def expand_urls(
    patterns: str | Sequence[str], *, storage_options: dict[str, Any] | None = None
) -> list[tuple[str, int | None]]:
    """The shard list of one source: ``[(url, size in bytes or None)]``, sorted by URL, without duplicates.

    Per pattern: brace patterns (``shard-{000..099}.tar``) expand without listing anything (local ones are
    ``stat``-ed, so a missing local shard fails here; remote sizes stay None); a local folder gives its
    shards (``*.tar``, ``*.tar.gz``, ``*.tgz``, ``*.tar.xz``: see `mixer.codecs`); a local glob (``*``,
    ``?``, ``[``) is globbed; a remote prefix ending in ``/`` (``s3://bucket/dir/``) is listed once,
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


def _expand_one(pattern: str, storage_options: dict[str, Any] | None) -> list[tuple[str, int | None]]:
    scheme = _scheme(pattern)
    if scheme == "pipe":
        return [(url, None) for url in braceexpand(pattern)]
    if _is_local(scheme):
        prefix = pattern[:7] if scheme == "file" else ""
        return [(prefix + path, size) for path, size in _expand_local(_local_path(pattern), pattern)]
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
        fs = fs or _filesystem(scheme, storage_options, 60.0)
        if listing:
            entries = _retrying(functools.partial(_ls, fs, url), f"listing {redact(url)}", retries=5, backoff=0.5)
            entries = [e for e in entries if e.get("type", "file") == "file" and is_shard_name(str(e["name"]))]
        else:
            hits = _retrying(
                functools.partial(fs.glob, url, detail=True), f"globbing {redact(url)}", retries=5, backoff=0.5
            )
            entries = [e for e in hits.values() if e.get("type", "file") == "file"]
        for e in entries:
            size = e.get("size")
            out.append((fs.unstrip_protocol(str(e["name"])), int(size) if size is not None else None))
    return out


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
                raise ShardError(f"folder {path!r} (from {original!r}) holds no shards ({', '.join('*' + x for x in SHARD_SUFFIXES)})")
            out.extend((p, os.stat(p).st_size) for p in tars if os.path.isfile(p))
        elif _has_magic(path):
            out.extend((p, os.stat(p).st_size) for p in sorted(globmod.glob(path)) if os.path.isfile(p))
        else:
            try:
                out.append((path, os.stat(path).st_size))
            except OSError as exc:
                raise ShardError(f"shard {path!r} (from {original!r}): {exc.strerror or exc}") from exc
    return out


# ------------------------------------------------------------------------------------------ opening


@dataclass(frozen=True, kw_only=True)
class IOOptions:
    """How a source reads its remote shards (local files ignore these options).

    ``timeout`` (default 60): seconds a request may wait for an answer, and a response for its next
    byte, before the attempt counts as a (transient) failure. ``retries`` (default 5): transient
    faults in a row, without a byte of progress in between, before the shard fails. ``backoff``
    (default 0.5): the first retry waits about this many seconds, doubling each time (with jitter,
    at most 30 s). ``block_size`` (default 1 MiB): bytes asked of the network per read; each open
    stream buffers up to about 3 x ``block_size``. ``read_ahead`` (default 2): how many of the
    reader's next shards start downloading while it reads the current one (see `ReadAhead`); 0
    turns read-ahead off.
    """

    timeout: float = 60.0
    retries: int = 5
    backoff: float = 0.5
    block_size: int = DEFAULT_BLOCK_SIZE
    read_ahead: int = 2

    def __post_init__(self) -> None:
        for name, lo, strict, integer in (
            ("timeout", 0.0, True, False),
            ("retries", 0, False, True),
            ("backoff", 0.0, False, False),
            ("block_size", 1, False, True),
            ("read_ahead", 0, False, True),
        ):
            value = getattr(self, name)
            kind = int if integer else (int, float)
            ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < lo or (strict and value == lo):
                what = "an integer" if integer else "a number"
                raise ConfigError(f"io_options: {name} must be {what} {'>' if strict else '>='} {lo:g} (got {value!r})")

    @classmethod
    def of(cls, value: IOOptions | Mapping[str, Any] | None) -> IOOptions:
        """``value`` itself, the options a mapping names (unknown keys are a `ConfigError` with a
        hint), or the defaults for None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"io_options: must be a mapping of {', '.join(IO_OPTIONS)} (got {value!r})")
        for key in value:
            if key not in IO_OPTIONS:
                close = difflib.get_close_matches(str(key), IO_OPTIONS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(IO_OPTIONS)}"
                raise ConfigError(f"io_options: unknown key {key!r}{hint}")
        return cls(**value)

    def open_kwargs(self) -> dict[str, Any]:
        """The keywords of `open_shard` these options set."""
        return {"timeout": self.timeout, "retries": self.retries, "backoff": self.backoff, "block_size": self.block_size}


IO_OPTIONS = ("timeout", "retries", "backoff", "block_size", "read_ahead")


def open_shard(
    url: str,
    *,
    start_offset: int = 0,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 60.0,
    retries: int = 5,
    backoff: float = 0.5,
    block_size: int = DEFAULT_BLOCK_SIZE,
    allow_pipe: bool = False,
) -> BinaryIO:
    """A readable binary stream of the shard at ``url``, positioned at ``start_offset``.

    Local paths and ``file://`` give a plain buffered file (with ``retries = 0``). Remote URLs give a
    `RemoteStream`: resumable, with a timeout on every open and read, and retries of transient faults
    from the exact byte where the stream broke (see there). The stream is opened eagerly, so a missing
    or forbidden shard raises `ShardError` here. ``pipe:`` commands need ``allow_pipe=True``.

    A compressed shard (``.tar.gz``, ``.tgz``, ``.tar.xz``) gives a `mixer.codecs.DecompressingStream`:
    ``start_offset`` is then an offset into the uncompressed tar, reached by reading the shard from its
    start and dropping what comes before (see `mixer.codecs` for what that costs).
    """
    codec = codec_of(url)
    stream = _new_stream(
        url,
        start_offset=0 if codec else start_offset,
        storage_options=storage_options,
        timeout=timeout,
        retries=retries,
        backoff=backoff,
        block_size=block_size,
        allow_pipe=allow_pipe,
    )
    if isinstance(stream, RemoteStream):
        _open_remote(stream)
    return _decoded(stream, url, codec, start_offset)


def _decoded(stream: BinaryIO, url: str, codec: str | None, start_offset: int) -> BinaryIO:
    """``stream`` itself, or for a compressed shard its uncompressed bytes from ``start_offset``."""
    if codec is None:
        return stream
    if start_offset < 0:
        stream.close()
        raise ConfigError(f"{redact(url)}: start_offset must be >= 0 (got {start_offset})")
    return cast(BinaryIO, DecompressingStream(stream, url=redact(url), codec=codec, start_offset=start_offset))


def _open_remote(stream: RemoteStream) -> None:
    try:
        stream._open_body()
    except BaseException:
        stream.close()
        raise


def _new_stream(
    url: str,
    *,
    start_offset: int,
    storage_options: dict[str, Any] | None,
    timeout: float,
    retries: int,
    backoff: float,
    block_size: int,
    allow_pipe: bool,
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
    scheme = _scheme(url)
    if scheme == "pipe":
        if start_offset:
            raise ConfigError(f"{redact(url)}: a pipe: stream cannot start at an offset")
        return cast(BinaryIO, _PipeStream(url))
    if _is_local(scheme):
        return _open_local(_local_path(url), start_offset)
    assert scheme is not None
    fs = _filesystem(scheme, storage_options, timeout)
    remote: _Remote
    if scheme in ("http", "https"):
        remote = _HTTPRemote(fs, url, timeout, block_size)
    elif scheme in ("s3", "s3a"):
        remote = _S3Remote(fs, url, timeout, block_size)
    else:
        remote = _FsspecRemote(fs, url, timeout)
    stream = RemoteStream(
        url, remote, start_offset=start_offset, retries=retries, backoff=backoff, block_size=block_size
    )
    return cast(BinaryIO, stream)


class ReadAhead:
    """Opens one reader's shards one after another, with the next ``options.read_ahead`` remote
    shards already downloading while the current one is read: several shards of one reader are
    open at once, so the latency of each request and the first ``block_size`` bytes of each body
    overlap with the decoding of the shard before.

    ``open(url, start_offset, upcoming)`` returns the shard's stream exactly as `open_shard` would
    (raising what it would: a shard begun ahead that turned out missing is a `ShardError` here, at
    its turn, under its retry policy and the caller's error policy), using the download begun ahead
    when it starts at that offset; then it begins the first ``read_ahead`` of ``upcoming`` (the URLs
    that follow, consumed lazily) and drops begun downloads no longer among them. Memory stays
    bounded: a shard begun ahead holds at most about 3 x ``block_size`` bytes until it is opened
    (its response then waits, flow-controlled). Local files and pipes are opened on demand. A
    `ShardError` from a remote open carries ``retries``, the retries made before it gave up.
    Not thread-safe; ``close()`` drops every download begun ahead (the streams handed out are the
    caller's to close).
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

    def open(self, url: str, start_offset: int = 0, upcoming: Iterable[str] = ()) -> BinaryIO:
        codec = codec_of(url)  # a compressed shard is always read from its first byte
        stream = self._begun.pop(url, None)
        if stream is not None and start_offset != 0 and codec is None:
            stream.close()
            stream = None
        if stream is None:
            stream = cast(RemoteStream, _new_stream(url, start_offset=0 if codec else start_offset, **self._kwargs))
        nxt = [u for u in itertools.islice(upcoming, self.options.read_ahead) if u != url]
        for u in [u for u in self._begun if u not in nxt]:
            self._begun.pop(u).close()
        try:
            if isinstance(stream, RemoteStream):
                _open_remote(stream)
        except ShardError as exc:
            exc.retries = stream.retries  # type: ignore[attr-defined]
            raise
        finally:
            # Only now: the shard needed first gets its answer before the ones after it compete.
            for u in nxt:
                if u not in self._begun and _scheme(u) in _PUMPED:
                    self._begin(u)
        return _decoded(cast(BinaryIO, stream), url, codec, start_offset)

    def _begin(self, url: str) -> None:
        try:
            stream = cast(RemoteStream, _new_stream(url, start_offset=0, **self._kwargs))
        except MixerError:
            return  # open() raises it again, at this shard's turn
        cast(_PumpRemote, stream._remote).begin(0)
        self._begun[url] = stream

    def close(self) -> None:
        begun, self._begun = self._begun, {}
        for stream in begun.values():
            stream.close()

    def __repr__(self) -> str:
        return f"<ReadAhead {len(self._begun)} begun: {[redact(u) for u in self._begun]}>"


_PUMPED = {"http", "https", "s3", "s3a"}


def _open_local(path: str, start_offset: int) -> BinaryIO:
    try:
        f = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    except OSError as exc:
        raise ShardError(f"cannot open shard {path!r}: {exc.strerror or exc}") from exc
    try:
        if start_offset:
            size = os.fstat(f.fileno()).st_size
            if start_offset > size:
                raise ShardError(f"shard {path!r}: start_offset {start_offset} is past its end ({size} bytes)")
            f.seek(start_offset)
        f.retries = 0  # type: ignore[attr-defined]  # the same counter a remote stream has
    except BaseException:
        f.close()
        raise
    return f


class RemoteStream(io.BufferedIOBase):
    """A forward-only binary stream of a remote shard that survives network faults without losing or
    repeating a byte.

    ``read(n)`` returns exactly ``n`` bytes unless the shard ends first. Every network open and read has
    a timeout (no byte for ``timeout`` seconds counts as a stalled stream). On a transient fault
    (refused / reset / aborted connection, HTTP 5xx / 408 / 429, S3 throttling, a timeout or stall, a
    body shorter than announced) the stream re-opens at the first byte it has not yet received, with a
    ranged GET (``If-Match`` on the ETag, so a shard replaced meanwhile fails instead of being spliced),
    after exponential backoff with jitter (honouring ``Retry-After``), at most ``retries`` times in a row
    without progress. Permanent faults (404, 403, a bad request, a start offset past the end) raise
    `ShardError` at once, naming the redacted URL and byte offset; so do exhausted retries, with the
    last cause chained. ``retries`` counts every retry made (for the caller's stats); ``size`` is the
    shard's size once a response has told it; ``tell()`` is the offset of the next byte ``read`` returns.
    Not thread-safe. Nothing is written to disk; read-ahead is bounded (about 3 x ``block_size``).
    """

    def __init__(
        self, url: str, remote: _Remote, *, start_offset: int, retries: int, backoff: float, block_size: int
    ) -> None:
        super().__init__()
        self.url = url
        self.retries = 0
        self._remote = remote
        self._max_retries = retries
        self._backoff = _Backoff(backoff)
        self._block = block_size
        self._pos = start_offset  # next byte read() hands out
        self._fetched = start_offset  # next byte to ask the network for (= _pos + unread buffer)
        self._buf = b""
        self._off = 0
        self._body_open = False
        self._eof = False

    @property
    def size(self) -> int | None:
        return self._remote.size

    # --------------------------------------------------------------------------------- io API
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        self._check_not_closed()
        if size == 0:
            return b""
        want = None if size is None or size < 0 else size
        buf, off = self._buf, self._off
        if want is not None and len(buf) - off >= want:
            self._off = off + want
            self._pos += want
            return buf[off : off + want]
        parts = [buf[off:]] if off < len(buf) else []
        got = len(buf) - off
        self._buf, self._off = b"", 0
        try:
            while want is None or got < want:
                chunk = self._next_chunk()
                if not chunk:
                    break
                if want is not None and len(chunk) > want - got:
                    parts.append(chunk[: want - got])
                    self._buf, self._off = chunk, want - got
                    got = want
                else:
                    parts.append(chunk)
                    got += len(chunk)
        except BaseException:
            # Keep what arrived before the error: a caller that goes on reading must not skip it.
            self._buf, self._off = b"".join(parts) + self._buf[self._off :], 0
            raise
        self._pos += got
        return b"".join(parts)

    def read1(self, size: int = -1) -> bytes:
        self._check_not_closed()
        if self._off >= len(self._buf):
            self._buf, self._off = self._next_chunk(), 0
        end = len(self._buf) if size is None or size < 0 else self._off + size
        data = self._buf[self._off : end]
        self._off += len(data)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def readinto1(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data = self.read1(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._remote.close()
            self._buf = b""
        super().close()

    def __repr__(self) -> str:
        return f"<RemoteStream {redact(self.url)} at byte {self._pos}, {self.retries} retries>"

    # ------------------------------------------------------------------------------ internals
    def _check_not_closed(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed stream")

    def _open_body(self) -> None:
        self._with_retries(self._try_open)

    def _try_open(self) -> bytes:
        try:
            self._remote.open(self._fetched)
        except _EndOfShard:
            self._eof = True
        self._body_open = True
        return b""

    def _next_chunk(self) -> bytes:
        """The next bytes from the network (b"" only at the true end of the shard)."""
        if self._eof:
            return b""
        chunk = self._with_retries(self._try_read)
        if not chunk:
            self._eof = True
            self._remote.close(finished=True)
        return chunk

    def _try_read(self) -> bytes:
        if not self._body_open:
            self._try_open()
            if self._eof:
                return b""
        chunk = self._remote.read(self._block)
        if chunk:
            self._fetched += len(chunk)
            return chunk
        size = self._remote.size
        if size is not None and self._fetched < size:
            raise _Fault(f"the body ended at byte {self._fetched} of {size}", transient=True)
        return b""

    def _with_retries(self, attempt_fn: Callable[[], bytes]) -> bytes:
        streak = 0
        while True:
            try:
                return attempt_fn()
            except Exception as exc:  # classified: bugs propagate
                self._remote.close()
                self._body_open = False
                fault = _classify(exc)
                if fault is None:
                    raise
                where = f"shard {redact(self.url)} at byte {self._fetched}"
                if not fault.transient:
                    raise ShardError(f"{where}: {fault.reason}") from _safe_cause(exc)
                streak += 1
                if streak > self._max_retries:
                    raise ShardError(
                        f"{where}: {fault.reason}; gave up after {self._max_retries} retries in a row"
                    ) from _safe_cause(exc)
                self.retries += 1
                delay = self._backoff.delay(streak, fault.retry_after)
                log.warning("%s: %s; retry %d/%d in %.2fs", where, fault.reason, streak, self._max_retries, delay)
                time.sleep(delay)


# ------------------------------------------------------------------------------------ the backends


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


def _call_soon(loop: Any, fn: Callable[[], Any]) -> None:
    """Run a cleanup on the loop thread without waiting (closing must never block)."""
    try:
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass


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


class _Remote:
    """One way of GETting a shard from a byte position: ``open(pos)`` starts a response (raises
    `_EndOfShard` when ``pos`` is the end), ``read(n)`` returns up to ``n`` bytes of it (b"" at its end),
    ``close()`` drops it. ``size`` is learnt from responses; the ETag pins the version across re-opens."""

    size: int | None = None

    def __init__(self, fs: Any, url: str, timeout: float) -> None:
        self.fs = fs
        self.url = url
        self.timeout = timeout
        self.etag: str | None = None

    def open(self, pos: int) -> None:
        raise NotImplementedError

    def read(self, n: int) -> bytes:
        raise NotImplementedError

    def close(self, finished: bool = False) -> None:
        pass

    def _learn(self, size: int | None, etag: str | None) -> None:
        if size is not None:
            if self.size is not None and size != self.size:
                raise _Fault(f"the shard changed size while being read ({self.size} -> {size} bytes)", transient=False)
            self.size = size
        if etag and not etag.startswith("W/") and self.etag is None:
            self.etag = etag

    def _past_end(self, pos: int, total: int | None) -> None:
        """Handle a 416 / InvalidRange: the end (EOF) or a start offset past the end (permanent)."""
        total = total if total is not None else self.size
        if total is not None and pos == total:
            self.size = total
            raise _EndOfShard
        raise _Fault(
            f"byte {pos} is past the end of the shard ({total if total is not None else '?'} bytes)", transient=False
        )


_Reader = Callable[[int], Coroutine[Any, Any, bytes]]


class _Pump:
    """One response, opened and read ahead by a task on the event loop.

    The task sends the request (``opener``: returns the body's ``read(n)`` coroutine function and a
    cleanup), reports the outcome to `wait_open`, then reads the body as bytes arrive into a queue of at
    most ``block_size`` bytes that `take` empties from the consumer thread (read-ahead bounded by that
    plus aiohttp's own buffer of at most 2 x ``block_size``). Why a task, and one that opens and reads
    without yielding in between: aiohttp discards the bytes it has buffered as soon as a connection
    error is set on the body, so a reader that is not already waiting for bytes when they arrive loses
    them, and the resume must fetch them again. Reading on the loop as bytes arrive means the resume
    starts at the byte where the connection broke (unless the queue was full, the consumer lagging:
    then the bytes in aiohttp's buffer, at most 2 x ``block_size``, are fetched again; never a byte
    twice to the consumer). Stalls are caught by the HTTP client's per-read timeout (aiohttp
    ``sock_read``, botocore ``read_timeout``), which does not run while the queue is full; the
    consumer's waits are bounded too.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        opener: Callable[[], Coroutine[Any, Any, tuple[_Reader, Callable[[bool], None]]]],
        *,
        timeout: float,
        block_size: int,
    ) -> None:
        self._loop = loop
        self._timeout = timeout
        self._block = block_size
        self._cond = threading.Condition()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiting_for_space = False
        self._space: asyncio.Event | None = None
        self._opened: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._future = asyncio.run_coroutine_threadsafe(self._main(opener), loop)

    def wait_open(self) -> None:
        """Return once the response is open and checked; raise what opening it raised."""
        try:
            self._opened.result(self._timeout + 5.0)  # the client's own timeouts fire first
        except concurrent.futures.TimeoutError:
            if self._opened.done():
                raise
            self.close()
            raise TimeoutError(f"no response within {self._timeout + 5.0:.0f}s") from None

    async def _main(self, opener: Callable[[], Coroutine[Any, Any, tuple[_Reader, Callable[[bool], None]]]]) -> None:
        self._space = asyncio.Event()
        try:
            read, cleanup = await opener()
        except asyncio.CancelledError:
            self._opened.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer thread by wait_open)
            self._opened.set_exception(exc)
            return
        self._opened.set_result(None)
        finished = False
        try:
            while True:
                with self._cond:
                    self._waiting_for_space = self._queued >= self._block
                    if self._waiting_for_space:
                        self._space.clear()
                if self._waiting_for_space:
                    await self._space.wait()
                    continue
                chunk = await read(self._block)
                with self._cond:
                    if chunk:
                        self._chunks.append(chunk)
                        self._queued += len(chunk)
                    else:
                        self._done = finished = True
                    self._cond.notify()
                if not chunk:
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer after the bytes before it)
            with self._cond:
                self._error, self._done = exc, True
                self._cond.notify()
        finally:
            cleanup(finished)

    def take(self) -> bytes:
        """The next bytes of the body; b"" at its end; the pump's error once the bytes before it are taken."""
        with self._cond:
            while not self._chunks and not self._done:
                if not self._cond.wait(self._timeout + 5.0):  # the client's own timeouts fire first
                    raise TimeoutError(f"no bytes within {self._timeout + 5.0:.0f}s")
            if self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._waiting_for_space and self._queued < self._block:
                    self._waiting_for_space = False
                    space = self._space
                    assert space is not None
                    _call_soon(self._loop, space.set)
                return chunk
            if self._error is not None:
                raise self._error
            return b""

    def close(self) -> None:
        if not self._loop.is_closed():  # (at interpreter exit the loop may be gone: nothing to close)
            self._future.cancel()  # thread-safe; the task's finally closes the response on the loop


def _start(pump: _Pump) -> _Pump:
    try:
        pump.wait_open()
    except BaseException:
        pump.close()
        raise
    return pump


class _PumpRemote(_Remote):
    """A remote whose responses are opened and read ahead by a `_Pump` on fsspec's event loop.

    ``begin(pos)`` sends the request without waiting for it (read-ahead of a shard not yet needed:
    see `open_ahead`); a later ``open(pos)`` at the same position then only waits for what is already
    under way, and anything that went wrong meanwhile surfaces there, in the consumer's thread, under
    the stream's retry policy."""

    def __init__(self, fs: Any, url: str, timeout: float, block_size: int) -> None:
        super().__init__(fs, url, timeout)
        self.block_size = block_size
        self._pump: _Pump | None = None
        self._begun: int | None = None  # position of a pump started by begin() and not yet waited for

    async def _aopen(self, pos: int) -> tuple[_Reader, Callable[[bool], None]]:
        raise NotImplementedError

    def _new_pump(self, pos: int) -> _Pump:
        return _Pump(self.fs.loop, lambda: self._aopen(pos), timeout=self.timeout, block_size=self.block_size)

    def begin(self, pos: int) -> None:
        if self._pump is None and (self.size is None or pos < self.size):
            self._pump, self._begun = self._new_pump(pos), pos

    def open(self, pos: int) -> None:
        pump, begun = self._pump, self._begun
        self._pump = self._begun = None
        if pump is not None and begun != pos:
            pump.close()
            pump = None
        if self.size is not None and pos >= self.size:
            if pump is not None:
                pump.close()
            self._past_end(pos, self.size)
        self._pump = _start(pump if pump is not None else self._new_pump(pos))

    def read(self, n: int) -> bytes:
        assert self._pump is not None
        return self._pump.take()

    def close(self, finished: bool = False) -> None:
        pump, self._pump, self._begun = self._pump, None, None
        if pump is not None:
            pump.close()


class _HTTPRemote(_PumpRemote):
    """GET with ``Range: bytes=pos-`` through the aiohttp session of fsspec's HTTP filesystem (so its
    ``storage_options``, e.g. ``headers`` or ``client_kwargs``, apply), with the status checked here."""

    def __init__(self, fs: Any, url: str, timeout: float, block_size: int) -> None:
        super().__init__(fs, url, timeout, block_size)
        self._warned_no_range = False

    async def _aopen(self, pos: int) -> tuple[_Reader, Callable[[bool], None]]:
        import aiohttp

        session = await self.fs.set_session()
        kw = dict(self.fs.kwargs)
        kw.pop("timeout", None)
        headers = dict(kw.pop("headers", None) or {})
        headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file itself
        headers["Connection"] = "close"  # one connection per response: see cleanup() below
        if pos:
            headers["Range"] = f"bytes={pos}-"
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
                raise _http_status(status, float(retry_after) if retry_after.isdigit() else None)
            encoded = resp.headers.get("Content-Encoding", "identity") not in ("identity", "")
            if status == 206:
                if first != pos:
                    raise _Fault(f"asked for bytes from {pos}, the server sent them from {first}", transient=False)
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
                            raise _Fault(f"the body ended at byte {pos - left}", transient=True)
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


class _S3Remote(_PumpRemote):
    """GetObject with ``Range=bytes=pos-`` on s3fs's aiobotocore client (credentials, endpoint, region,
    requester-pays as s3fs resolves them: env vars, profiles, ``AWS_ENDPOINT_URL``, storage_options)."""

    def __init__(self, fs: Any, url: str, timeout: float, block_size: int) -> None:
        super().__init__(fs, url, timeout, block_size)
        self.bucket, self.key, self.version = fs.split_path(url)
        if not self.key:
            raise ConfigError(f"{redact(url)}: an s3:// shard URL needs a key after the bucket")

    async def _aopen(self, pos: int) -> tuple[_Reader, Callable[[bool], None]]:
        from botocore.exceptions import ClientError

        await self.fs.set_session()
        s3 = await self.fs.get_s3(self.bucket)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, **self.fs.req_kw}
        if self.version:
            kw["VersionId"] = self.version
        if pos:
            kw["Range"] = f"bytes={pos}-"
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
                raise _Fault(f"asked for bytes from {pos}, S3 sent them from {first}", transient=False)
            self._learn(total if pos else resp.get("ContentLength"), resp.get("ETag"))
        except BaseException:
            body.close()
            raise
        return body.read, lambda finished: body.close()


class _FsspecRemote(_Remote):
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
        if end <= self._pos:
            return b""
        data = bytes(self._call("cat_file", self.url, start=self._pos, end=end))
        self._pos += len(data)
        return data

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.fs, "async_impl", False) and getattr(self.fs, "loop", None) is not None:
            return _run(self.fs.loop, getattr(self.fs, "_" + method)(*args, **kwargs), self.timeout)
        return getattr(self.fs, method)(*args, **kwargs)


class _PipeStream(io.BufferedIOBase):
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
