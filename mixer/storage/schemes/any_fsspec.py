"""Every other protocol of an installed fsspec backend (``gs://`` with gcsfs, ``memory://``, ...):
the fallback for a ``scheme://`` that no other backend names. Listed and read through the generic
fsspec backend (ranged ``cat_file`` calls that resume after a fault); its errors are classified by
the general rules. Protocols that wrap another filesystem are refused.
"""

from __future__ import annotations

import importlib.util

from mixer.errors import ConfigError
from mixer.storage.backend import FsspecBackend
from mixer.storage.urls import redact

__all__ = ["BACKEND", "AnyFsspec"]

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


class AnyFsspec(FsspecBackend):
    fallback = True

    def check(self, url: str, scheme: str | None, *, allow_pipe: bool) -> None:
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


BACKEND = AnyFsspec()
