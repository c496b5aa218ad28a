"""`ForwardStream`: the file-object part that the storage layer's byte streams share."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

__all__ = ["ForwardStream"]


class ForwardStream(io.BufferedIOBase):
    """A readable, forward-only binary stream. A subclass gives ``read`` and ``read1``, keeps the
    offset of the next byte ``read`` returns in ``_pos`` (``tell()``), and drops what it holds in
    ``_release`` (called once, by the first ``close()``)."""

    _pos = 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        return _copy_into(b, self.read)

    def readinto1(self, b: Any) -> int:
        return _copy_into(b, self.read1)

    def close(self) -> None:
        if not self.closed:
            self._release()
        super().close()

    def _release(self) -> None:
        raise NotImplementedError


def _copy_into(b: Any, read: Callable[[int], bytes]) -> int:
    view = memoryview(b).cast("B")
    data = read(len(view))
    view[: len(data)] = data
    return len(data)
