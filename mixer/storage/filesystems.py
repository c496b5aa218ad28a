"""The fsspec filesystems remote shards are read through: one private instance per (process,
protocol, options), so credentials, endpoints and ``storage_options`` work as in fsspec. What
options a scheme adds, and how its filesystem is made and closed, its backend says
(`mixer.storage.backend.FsspecBackend`); this module keeps the instances."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["cached_filesystem", "close_filesystems"]

log = logging.getLogger(__name__)

_fs_lock = threading.Lock()
# (pid, protocol, options token) -> (filesystem, how to close its session)
_fs_cache: dict[tuple[int, str, str], tuple[Any, Callable[[Any], None]]] = {}


def cached_filesystem(
    scheme: str, options: dict[str, Any], make: Callable[[], Any], close: Callable[[Any], None]
) -> Any:
    """The filesystem of ``scheme`` with ``options`` made in this process (by ``make()`` the first
    time; ``close(fs)`` closes its session at `close_filesystems`). A forked process does not use
    its parent's: their sessions belong to the parent's event loop."""
    from fsspec.utils import tokenize

    key = (os.getpid(), scheme, tokenize(options))
    with _fs_lock:
        entry = _fs_cache.get(key)
        if entry is None:
            if any(k[0] != key[0] for k in _fs_cache):  # forked: the parent's sessions are not ours
                _fs_cache.clear()
            entry = _fs_cache[key] = (make(), close)
    return entry[0]


def close_filesystems() -> None:
    """Close the sessions this module opened (tests use it to leave no connection behind)."""
    with _fs_lock:
        cached = list(_fs_cache.values())
        _fs_cache.clear()
    for fs, close in cached:
        try:
            close(fs)
        except Exception:  # best effort: a session already gone is fine
            log.debug("closing a filesystem session failed", exc_info=True)
