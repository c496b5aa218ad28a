"""Shard URLs: their schemes, validation at the door (`check_url`), and redaction for messages (`redact`).

A shard URL is a local path, a ``file://`` URL, ``s3://``, ``http(s)://``, another protocol of an
installed fsspec backend, or (only when code allows it) webdataset's ``pipe:cmd``.
"""

from __future__ import annotations

import importlib.util
import os
import re

from mixer.errors import ConfigError

__all__ = ["EXTRAS", "check_url", "is_local", "local_path", "redact", "require_backend", "scheme_of"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*::")
_ANY_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "http": ("aiohttp", "http"), "https": ("aiohttp", "http")}
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


def scheme_of(url: str) -> str | None:
    """The lower-cased scheme; ``"pipe"`` for webdataset's ``pipe:cmd``; None for a local path."""
    if url.startswith("pipe:"):
        return "pipe"
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else None


def is_local(scheme: str | None) -> bool:
    return scheme is None or scheme == "file"


def local_path(url: str) -> str:
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
    scheme = scheme_of(url)
    if scheme == "pipe":
        if not allow_pipe:
            raise ConfigError(
                f"{redact(url)}: 'pipe:' URLs run a shell command, so they are refused unless the code that "
                "builds the source passes allow_pipe=True (a config file alone cannot enable them)"
            )
        return url
    if is_local(scheme):
        if scheme == "file" and not local_path(url):
            raise ConfigError(f"{url!r}: a file:// URL needs a path")
        return url
    assert scheme is not None
    rest = url[len(scheme) + 3 :]
    if scheme in EXTRAS:
        require_backend(scheme)
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


def require_backend(scheme: str) -> None:
    module, extra = EXTRAS[scheme]
    missing = [m for m in ("fsspec", module) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"{scheme}:// shards need {' and '.join(missing)}, which is not installed: pip install 'wds-mixer[{extra}]'"
        )
