"""The fsspec filesystems remote shards are read through: one private instance per (process,
protocol, options, timeout), so credentials, endpoints and ``storage_options`` work as in fsspec."""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

from mixer.errors import ConfigError
from mixer.storage import logsafe
from mixer.storage.options import DEFAULT_MAX_CONNECTIONS
from mixer.storage.urls import EXTRAS, require_backend

__all__ = ["close_filesystems", "filesystem"]

log = logging.getLogger(__name__)

AIOHTTP_LIMIT = 100  # aiohttp's default connection pool
_fs_lock = threading.Lock()
_fs_cache: dict[tuple[int, str, str], Any] = {}


def filesystem(
    scheme: str,
    storage_options: dict[str, Any] | None,
    timeout: float,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> Any:
    """A private (not fsspec-instance-cached) filesystem per (process, protocol, options, timeout).

    For s3 the botocore timeouts default to ``timeout`` and botocore's own retries are switched off
    (unless the options say otherwise): the storage layer retries, resumes and counts itself. The
    client's own connection pool is made at least ``max_connections`` large (botocore's default is 10,
    aiohttp's 100), so that the streams' pool (`mixer.storage.pool`), not the client's, is what
    bounds and queues connections. The first call in a process makes the DEBUG logs of the
    libraries underneath safe (`mixer.storage.logsafe`).
    """
    logsafe.install()
    if scheme in EXTRAS:
        require_backend(scheme)
    import fsspec
    from fsspec.utils import tokenize

    opts = dict(storage_options or {})
    if scheme in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("max_pool_connections", max(max_connections, 10))
        opts["config_kwargs"] = config
    elif scheme in ("http", "https") and max_connections > AIOHTTP_LIMIT and "get_client" not in opts:
        opts["get_client"] = functools.partial(_http_client, max_connections)
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


async def _http_client(limit: int, **kwargs: Any) -> Any:
    """fsspec's HTTP session, with a connection pool of ``limit`` (unless the options give a connector)."""
    import aiohttp

    if "connector" not in kwargs:
        kwargs["connector"] = aiohttp.TCPConnector(limit=limit)
    return aiohttp.ClientSession(**kwargs)


def close_filesystems() -> None:
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
