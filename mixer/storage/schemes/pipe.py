"""webdataset's ``pipe:cmd``: a shell command's stdout as the shard. Refused unless the code that
builds the source passes ``allow_pipe=True`` (a config file alone cannot enable it); brace patterns
expand, nothing is listed; a stream starts at its first byte.
"""

from __future__ import annotations

import io
import subprocess
from typing import Any, BinaryIO, cast

from braceexpand import braceexpand

from mixer.errors import ConfigError, ShardError
from mixer.storage.backend import Backend, Listed, Request
from mixer.storage.urls import redact

__all__ = ["BACKEND", "Pipe", "PipeStream"]


class Pipe(Backend):
    schemes = ("pipe",)
    opaque = True
    remote = False
    ranged = False

    def check(self, url: str, scheme: str | None, *, allow_pipe: bool) -> None:
        if not allow_pipe:
            raise ConfigError(
                f"{redact(url)}: 'pipe:' URLs run a shell command, so they are refused unless the code that "
                "builds the source passes allow_pipe=True (a config file alone cannot enable them)"
            )

    def expand(self, pattern: str, scheme: str | None, storage_options: dict[str, Any] | None) -> Listed:
        return [(url, None) for url in braceexpand(pattern)]

    def open(self, request: Request) -> BinaryIO:
        if request.start_offset:
            raise ConfigError(f"{redact(request.url)}: a pipe: stream cannot start at an offset")
        return cast(BinaryIO, PipeStream(request.url))


class PipeStream(io.BufferedIOBase):
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


BACKEND = Pipe()
