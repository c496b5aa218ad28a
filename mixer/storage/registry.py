"""The table of storage schemes: scheme name → the `mixer.storage.backend.Backend` that serves it.

Every module of the storage layer (and the layers above) asks this table what a URL's scheme
means (how it is checked, listed, opened and classified, whether it may be written to) instead of
testing scheme names itself: a scheme's knowledge lives in its own module of
:mod:`mixer.storage.schemes`, and nowhere else.

The table is filled on first use, from every module of :mod:`mixer.storage.schemes` (sorted by
name), each of which defines ``BACKEND``: so a first-class scheme (``gs://``, ``hf://``) is one new
file there. Code outside the library adds a backend with ``SCHEMES.register(backend)`` (before the
mixture is built; DataLoader workers forked after it inherit it). Filling it late lets the modules
underneath the backends (faults, compressed names) consult it too: this module imports nothing of
the storage layer when it is imported.

Three kinds of URL have no ``scheme://`` to look up: a local path belongs to the backend that
declares ``paths`` (local files); ``<scheme>:<rest>`` to the one that declares ``opaque``
(webdataset's ``pipe:cmd``); any other ``scheme://`` that no backend names to the ``fallback``
(every other installed fsspec protocol).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from mixer.errors import ConfigError

if TYPE_CHECKING:
    from mixer.storage.backend import Backend

__all__ = ["SCHEMES", "Schemes", "backend_for", "local_path", "scheme_of"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class Schemes(Mapping[str, "Backend"]):
    """The table: a read-only mapping of scheme names to backends, plus `register` and the three
    lookups that every other module uses (`scheme_of`, `for_url`, `for_scheme`)."""

    def __init__(self) -> None:
        self._table: dict[str, Backend] = {}
        self._order: list[Backend] = []  # each backend once, in the order it was added
        self._paths: Backend | None = None
        self._fallback: Backend | None = None
        self._opaque: tuple[str, ...] = ()
        self._loaded = False
        self._loading = False
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------ the table
    def register(self, backend: Backend) -> None:
        """Add ``backend`` under each name of its ``schemes``; a name already taken is a `ConfigError`."""
        with self._lock:
            self._fill()
            self._add(backend)

    def unregister(self, backend: Backend) -> None:
        """Take a backend added by `register` out of the table again (tests, plugins that unload)."""
        with self._lock:
            self._fill()
            if backend not in self._order:
                raise ConfigError(f"storage backend {type(backend).__qualname__} is not registered")
            kept = [b for b in self._order if b is not backend]
            self._table, self._order, self._paths, self._fallback, self._opaque = {}, [], None, None, ()
            for b in kept:
                self._add(b)

    def backends(self) -> list[Backend]:
        """Every backend once, in the order they were added (the order their ``classify`` is asked in)."""
        self._fill()
        return self._order

    def __getitem__(self, scheme: str) -> Backend:
        self._fill()
        return self._table[scheme]

    def __iter__(self) -> Iterator[str]:
        self._fill()
        return iter(self._table)

    def __len__(self) -> int:
        self._fill()
        return len(self._table)

    # ------------------------------------------------------------------------------ lookups
    def scheme_of(self, url: str) -> str | None:
        """The lower-cased scheme of ``url`` (``"pipe"`` for webdataset's ``pipe:cmd``), None for a local path."""
        self._fill()
        for name in self._opaque:
            if url.startswith(name + ":"):
                return name
        m = _SCHEME.match(url)
        return m.group(1).lower() if m else None

    def for_scheme(self, scheme: str | None) -> Backend:
        """The backend of ``scheme`` (None: a local path); the fallback for a scheme no backend names."""
        self._fill()
        backend = self._paths if scheme is None else self._table.get(scheme, self._fallback)
        assert backend is not None, "mixer.storage.schemes has no backend for paths, or no fallback"
        return backend

    def for_url(self, url: str) -> Backend:
        return self.for_scheme(self.scheme_of(url))

    # ------------------------------------------------------------------------------ filling
    def _fill(self) -> None:
        if self._loaded:
            return
        with self._lock:  # another thread waits here until the table is full
            if self._loaded or self._loading:  # loading: a backend module consults the table as it loads
                return
            self._loading = True
            try:
                from mixer.storage import schemes

                for info in sorted(pkgutil.iter_modules(schemes.__path__), key=lambda m: m.name):
                    self._add(importlib.import_module(f"{schemes.__name__}.{info.name}").BACKEND)
            finally:
                self._loading = False
            self._loaded = True

    def _add(self, backend: Backend) -> None:
        where = type(backend).__qualname__
        for name in backend.schemes:
            if name != name.lower() or not _SCHEME.match(name + "://"):
                raise ConfigError(f"storage backend {where}: {name!r} is not a lower-case URL scheme")
            if name in self._table:
                raise ConfigError(
                    f"storage backend {where}: the scheme {name!r} is served already "
                    f"(by {type(self._table[name]).__qualname__})"
                )
        for role in ("paths", "fallback"):
            taken = getattr(self, f"_{role}")
            if getattr(backend, role) and taken is not None:
                raise ConfigError(
                    f"storage backend {where}: only one backend serves the {role} ({type(taken).__qualname__} does)"
                )
        self._table.update(dict.fromkeys(backend.schemes, backend))
        self._order.append(backend)
        self._paths = backend if backend.paths else self._paths
        self._fallback = backend if backend.fallback else self._fallback
        if backend.opaque:
            self._opaque += backend.schemes


SCHEMES = Schemes()
"""The one table of storage schemes."""


def scheme_of(url: str) -> str | None:
    """``SCHEMES.scheme_of(url)``."""
    return SCHEMES.scheme_of(url)


def backend_for(url: str) -> Backend:
    """The backend that serves ``url`` (``SCHEMES.for_url(url)``)."""
    return SCHEMES.for_url(url)


def local_path(url: str) -> str | None:
    """The path on this machine's file system that ``url`` names, or None when it is not a local file."""
    return SCHEMES.for_url(url).local_path(url)
