"""Local files: plain paths and ``file://`` URLs, opened with ``open()``; a folder gives its shards,
a glob is globbed, a brace pattern is ``stat``-ed shard by shard (so a missing local shard fails
when the source is listed). Index files are written next to the shards where the folder is writable.
"""

from __future__ import annotations

import glob as globmod
import os
from typing import Any, BinaryIO, cast

from braceexpand import braceexpand

from mixer.errors import ConfigError, ShardError
from mixer.storage.backend import Backend, Listed, Request, has_magic
from mixer.storage.compressed import SHARD_SUFFIXES, is_shard_name
from mixer.storage.streams import ForwardStream

__all__ = ["BACKEND", "LocalFiles"]

_PREFIX = "file://"


class LocalFiles(Backend):
    schemes = ("file",)
    paths = True
    remote = False

    def local_path(self, url: str) -> str:
        return url[len(_PREFIX) :] if url[: len(_PREFIX)].lower() == _PREFIX else url

    def check(self, url: str, scheme: str | None, *, allow_pipe: bool) -> None:
        if scheme is not None and not self.local_path(url):
            raise ConfigError(f"{url!r}: a {_PREFIX} URL needs a path")

    def expand(self, pattern: str, scheme: str | None, storage_options: dict[str, Any] | None) -> Listed:
        path = self.local_path(pattern)
        prefix = pattern[: len(pattern) - len(path)]  # a file:// pattern lists file:// URLs
        return [(prefix + p, size) for p, size in _expand_local(path, pattern)]

    def open(self, request: Request) -> BinaryIO:
        local = _open_local(self.local_path(request.url), request.start_offset)
        end = request.end_offset
        return local if end is None else cast(BinaryIO, _LocalRange(local, end))


def _expand_local(pattern: str, original: str) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for path in braceexpand(pattern):
        if os.path.isdir(path):
            tars = sorted(p for p in globmod.glob(os.path.join(globmod.escape(path), "*")) if is_shard_name(p))
            if not tars:
                raise ShardError(
                    f"folder {path!r} (from {original!r}) holds no shards "
                    f"({', '.join('*' + x for x in SHARD_SUFFIXES)})"
                )
            out.extend((p, os.stat(p).st_size) for p in tars if os.path.isfile(p))
        elif has_magic(path):
            out.extend((p, os.stat(p).st_size) for p in sorted(globmod.glob(path)) if os.path.isfile(p))
        else:
            try:
                out.append((path, os.stat(path).st_size))
            except OSError as exc:
                raise ShardError(f"shard {path!r} (from {original!r}): {exc.strerror or exc}") from exc
    return out


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


class _LocalRange(ForwardStream):
    """A local file's bytes up to ``end`` (`mixer.storage.open_shard`'s ``end_offset``)."""

    def __init__(self, f: BinaryIO, end: int) -> None:
        super().__init__()
        self._f = f
        self._end = end
        self._pos = f.tell()
        self.retries = 0

    def read(self, size: int | None = -1) -> bytes:
        left = max(self._end - self._pos, 0)
        data = self._f.read(left if size is None or size < 0 else min(size, left))
        self._pos += len(data)
        return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def _release(self) -> None:
        self._f.close()


BACKEND = LocalFiles()
