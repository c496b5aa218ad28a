"""`Backend`: what a storage scheme declares, once, in its own module of :mod:`mixer.storage.schemes`
(the table of them is `mixer.storage.registry.SCHEMES`); `FsspecBackend`, the shared part of the
schemes read through an fsspec filesystem (listing a prefix or a glob, ranged reads that resume
after a fault, the private filesystem instances).

fsspec and the libraries of a scheme's extra are imported only when a URL of that scheme is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, BinaryIO, NamedTuple, TypeVar, cast

from braceexpand import braceexpand

from mixer.errors import ConfigError
from mixer.storage import logsafe
from mixer.storage.compressed import is_shard_name
from mixer.storage.faults import Backoff, Fault, retrying
from mixer.storage.filesystems import cached_filesystem
from mixer.storage.options import DEFAULT_MAX_CONNECTIONS
from mixer.storage.remote import Remote, RemoteStream
from mixer.storage.urls import check_url, redact

__all__ = ["Backend", "FsspecBackend", "Listed", "Request", "has_magic"]

_T = TypeVar("_T")

Listed = list[tuple[str, int | None]]
"""``[(url, size in bytes or None)]``: what listing a pattern gives."""


class Request(NamedTuple):
    """One shard to open (`Backend.open`): its URL and scheme, the bytes wanted (``start_offset``,
    checked >= 0, up to ``end_offset``), and how a remote one is read (`mixer.storage.open_shard`'s
    keywords)."""

    url: str
    scheme: str | None
    start_offset: int
    end_offset: int | None
    storage_options: dict[str, Any] | None
    timeout: float
    retries: int
    backoff: float
    block_size: int
    max_connections: int


def has_magic(s: str) -> bool:
    """Whether ``s`` is a glob (``*``, ``?``, ``[``)."""
    return any(c in s for c in "*?[")


class Backend:
    """The storage backend of one kind of URL: a subclass in its own module of
    :mod:`mixer.storage.schemes`, whose ``BACKEND`` is its instance, says everything the storage
    layer needs to know about its schemes. The class attributes:

    ``schemes``: the URL schemes it serves (lower case, ``("http", "https")``). ``paths``: plain paths
    (no scheme) are its URLs too (local files). ``opaque``: its URLs read ``<scheme>:<rest>``, no
    ``//`` (webdataset's ``pipe:cmd``). ``fallback``: it serves every ``scheme://`` no backend names.
    ``extra``, ``needs``: the modules it needs, and the extra of ``wds-mixer`` that installs them (a
    missing one is a `ConfigError` naming the extra). ``remote``: its bytes come from a server (the
    up-front look reads bounded windows of them). ``ranged``: a shard can be read from one byte up
    to another (``start_offset``, ``end_offset``). ``pumped``: responses are read ahead by the async
    pump (`mixer.storage.pump`), so the next shards can be begun early and read in windows.
    ``read_only``: why files (index files) cannot be written there; None: they can.

    The methods: `check` (the URL rule), `name` (the part of a URL that names the file),
    `local_path`, `expand` (listing), `open`, `classify` (which errors of its libraries are transient,
    missing or denied).
    """

    schemes: tuple[str, ...] = ()
    paths = False
    opaque = False
    fallback = False
    extra: str | None = None
    needs: tuple[str, ...] = ()
    remote = True
    ranged = True
    pumped = False
    read_only: str | None = None

    def require(self, scheme: str) -> None:
        """Raise a `ConfigError` naming the extra when a module of ``needs`` is not installed."""
        missing = [m for m in self.needs if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"{scheme}:// shards need {' and '.join(missing)}, which is not installed: "
                f"pip install 'wds-mixer[{self.extra}]'"
            )

    def check(self, url: str, scheme: str | None, *, allow_pipe: bool) -> None:
        """Refuse ``url`` (a `ConfigError` naming it, redacted) unless it is one of this backend's;
        the general rules (a non-empty string, not chained) are checked already. ``allow_pipe``:
        the source's own, for a backend that runs commands."""
        if scheme is not None:
            self.require(scheme)

    def name(self, url: str) -> str:
        """The part of ``url`` that names the file (its codec follows from the ending; a prefix ends in
        ``/``): the whole URL, unless the scheme has query strings."""
        return url

    def local_path(self, url: str) -> str | None:
        """The path on this machine's file system that ``url`` names; None: not a local file."""
        return None

    def expand(self, pattern: str, scheme: str | None, storage_options: dict[str, Any] | None) -> Listed:
        """The shards of one pattern (see `mixer.storage.expand_urls`); [] when it matches none."""
        raise NotImplementedError

    def lists(self, pattern: str, scheme: str | None) -> bool:
        """Whether expanding ``pattern`` sends a listing request to a server (a remote prefix or glob)."""
        return False

    def open(self, request: Request) -> BinaryIO:
        """The shard's stream from ``request.start_offset``, ending before ``request.end_offset``; a
        `RemoteStream` is returned before its first request (`mixer.storage.open_shard` sends it)."""
        raise NotImplementedError

    def classify(self, exc: BaseException) -> Fault | None:
        """``exc`` as a fault, when it is an error of this backend's libraries; None: not one of
        theirs (the general rules of `mixer.storage.faults.classify` then decide)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend: {', '.join(self.schemes) or 'no scheme of its own'}>"


class FsspecBackend(Backend):
    """A backend read through an fsspec filesystem: a pattern ending in ``/`` lists the prefix, a glob
    is globbed (where the scheme has globs), anything else is one shard; a shard is read with ranged
    requests that resume at the byte after a fault (`RemoteStream`). ``authority``: what a URL must
    name after ``scheme://`` (``"a host"``, ``"a bucket"``), or None. A subclass gives its own
    `remote_for` (how a response is fetched), `filesystem_options` and `close_session`, or
    `new_filesystem` to make the filesystem itself."""

    authority: str | None = None
    globs = True

    def check(self, url: str, scheme: str | None, *, allow_pipe: bool) -> None:
        assert scheme is not None
        self.require(scheme)
        rest = url[len(scheme) + 3 :]
        if self.authority is not None and (
            not rest or rest.startswith("/") or rest.split("/", 1)[0].rsplit("@", 1)[-1] == ""
        ):
            raise ConfigError(f"{redact(url)}: a {scheme}:// URL needs {self.authority}")

    # ---------------------------------------------------------------------------- filesystem
    def filesystem(
        self, scheme: str, storage_options: dict[str, Any] | None, timeout: float, max_connections: int
    ) -> Any:
        """A private (not fsspec-instance-cached) filesystem per (process, protocol, options), with
        this backend's `filesystem_options` added. The first call in a process makes the DEBUG logs
        of the libraries underneath safe (`mixer.storage.logsafe`)."""
        logsafe.install()
        self.require(scheme)
        import fsspec  # noqa: F401 (a missing fsspec fails here, before the options are tokenized)

        opts = self.filesystem_options(dict(storage_options or {}), timeout=timeout, max_connections=max_connections)
        return cached_filesystem(scheme, opts, functools.partial(self._made, scheme, opts), self.close_session)

    def filesystem_options(self, options: dict[str, Any], *, timeout: float, max_connections: int) -> dict[str, Any]:
        """The ``storage_options`` the filesystem is made with (the source's, plus the backend's
        defaults: timeouts, connection pool sizes)."""
        return options

    def new_filesystem(self, scheme: str, options: dict[str, Any]) -> Any:
        import fsspec

        return fsspec.filesystem(scheme, skip_instance_cache=True, **options)

    def close_session(self, fs: Any) -> None:
        """Close the session of a filesystem made here (`mixer.storage.filesystems.close_filesystems`)."""
        if getattr(fs, "_session", None) is not None:
            type(fs).close_session(getattr(fs, "loop", None), fs._session)

    def _made(self, scheme: str, options: dict[str, Any]) -> Any:
        try:
            return self.new_filesystem(scheme, options)
        except ImportError as exc:
            raise ConfigError(f"{scheme}:// needs a backend that is not installed: {exc}") from None
        except TypeError as exc:
            raise ConfigError(f"{scheme}://: invalid storage_options: {exc}") from None

    # ------------------------------------------------------------------------------- listing
    def lists(self, pattern: str, scheme: str | None) -> bool:
        return scheme is not None and any(
            self.name(url).endswith("/") or (self.globs and has_magic(url[len(scheme) + 3 :]))
            for url in braceexpand(pattern)
        )

    def expand(self, pattern: str, scheme: str | None, storage_options: dict[str, Any] | None) -> Listed:
        assert scheme is not None
        check_url(pattern)
        out: Listed = []
        fs = None
        for url in braceexpand(pattern):
            listing = self.name(url).endswith("/")
            globbing = self.globs and has_magic(url[len(scheme) + 3 :])
            if not (listing or globbing):
                out.append((url, None))
                continue
            fs = fs or self.filesystem(scheme, storage_options, 60.0, DEFAULT_MAX_CONNECTIONS)
            if listing:
                entries = _retried(functools.partial(_ls, fs, url), f"listing {redact(url)}")
                entries = [e for e in entries if e.get("type", "file") == "file" and is_shard_name(str(e["name"]))]
            else:
                hits = _retried(functools.partial(fs.glob, url, detail=True), f"globbing {redact(url)}")
                entries = [e for e in hits.values() if e.get("type", "file") == "file"]
            for e in entries:
                size = e.get("size")
                out.append((fs.unstrip_protocol(str(e["name"])), int(size) if size is not None else None))
        return out

    # ------------------------------------------------------------------------------- reading
    def open(self, request: Request) -> BinaryIO:
        r = request
        assert r.scheme is not None
        fs = self.filesystem(r.scheme, r.storage_options, r.timeout, r.max_connections)
        stream = RemoteStream(
            r.url,
            self.remote_for(fs, r),
            start_offset=r.start_offset,
            retries=r.retries,
            backoff=r.backoff,
            block_size=r.block_size,
            end_offset=r.end_offset,
        )
        return cast(BinaryIO, stream)

    def remote_for(self, fs: Any, request: Request) -> Remote:
        """The `Remote` that fetches the requested shard through ``fs``."""
        return _FsspecRemote(fs, request.url, request.timeout)


def _retried(call: Callable[[], _T], what: str) -> _T:
    """A listing call under the streams' retry policy (with the default retries and backoff)."""
    return retrying(call, lambda: what, retries=5, backoff=Backoff(0.5))


def _ls(fs: Any, url: str) -> list[dict[str, Any]]:
    try:
        return list(fs.ls(url, detail=True))
    except FileNotFoundError:  # an empty or missing prefix: "no shards match" names the pattern
        return []


def _run_on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
    """Run ``coro`` on fsspec's I/O loop from this (non-loop) thread, cancelled after ``timeout`` s."""
    future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop)
    try:
        return future.result(timeout + 5.0)  # the loop-side wait_for fires first; this guards a wedged loop
    except concurrent.futures.TimeoutError:
        if future.done():
            raise
        future.cancel()
        raise TimeoutError(f"no answer within {timeout + 5.0:.0f}s") from None


class _FsspecRemote(Remote):
    """Any fsspec protocol: ranged ``cat_file`` calls of at most ``n`` bytes (the backend's own
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
            return _run_on_loop(self.fs.loop, getattr(self.fs, "_" + method)(*args, **kwargs), self.timeout)
        return getattr(self.fs, method)(*args, **kwargs)
