"""Shard URLs: validation at the door (`check_url`) and redaction for messages (`redact`).

What a scheme accepts is its backend's rule (`mixer.storage.registry`); the rules every URL
follows are here.
"""

from __future__ import annotations

import os
import re

from mixer.errors import ConfigError
from mixer.storage.registry import SCHEMES

__all__ = ["check_url", "redact"]

_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*::")
_ANY_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")


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

    Accepted: local paths and the URLs of every scheme in `mixer.storage.registry.SCHEMES` (``file://``,
    ``s3://``, ``http(s)://``) or of any other protocol fsspec knows and has its backend installed for
    (``gs://`` with gcsfs, ...), each as its backend's `~mixer.storage.backend.Backend.check` rules.
    ``pipe:`` (webdataset's shell command) is refused unless ``allow_pipe=True``, which only code can
    pass. A missing backend names the extra to install.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"a shard URL must be a non-empty string (got {url!r})")
    if _CHAINED.match(url):
        raise ConfigError(
            f"{redact(url)}: chained fsspec URLs ('a::b') are not supported; pass the options of the inner "
            "filesystem as the source's storage_options"
        )
    scheme = SCHEMES.scheme_of(url)
    SCHEMES.for_scheme(scheme).check(url, scheme, allow_pipe=allow_pipe)
    return url
