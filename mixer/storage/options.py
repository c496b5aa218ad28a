"""`IOOptions`: how a source reads its remote shards (timeouts, retries, backoff, block size, read-ahead,
connections)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixer import _check
from mixer.errors import ConfigError

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_OPEN_SHARDS", "IO_OPTIONS", "IOOptions"]

DEFAULT_BLOCK_SIZE = 1 << 20
"""Bytes asked of the network per read call; also the read-ahead an open HTTP stream buffers."""

DEFAULT_MAX_CONNECTIONS = 64
"""Remote responses one process (a DataLoader worker, or the main process) keeps open at once."""

DEFAULT_MAX_OPEN_SHARDS = 64
"""Shards one reader (a DataLoader worker, or the main process) keeps open at once, all sources together."""


@dataclass(frozen=True, kw_only=True)
class IOOptions:
    """How a source reads its shards (local files use only ``max_open_shards``).

    ``timeout`` (default 60): seconds a request may wait for an answer, and a response for its next
    byte, before the attempt counts as a (transient) failure. ``retries`` (default 5): transient
    faults in a row, without a byte of progress in between, before the shard fails. ``backoff``
    (default 0.5): the first retry waits about this many seconds, doubling each time (with jitter,
    at most 30 s). ``block_size`` (default 1 MiB): bytes asked of the network per read; each open
    stream buffers up to about 3 x ``block_size``. ``read_ahead`` (default 2): how many of the
    reader's next shards start downloading while it reads the current one (see `ReadAhead`); 0
    turns read-ahead off. ``max_connections`` (default 64): remote responses (HTTP or S3
    connections) open at once in one process, all sources together (sources that give the same
    value share one pool; see `mixer.storage.pool`). Beyond it streams queue for a connection (not
    a timeout: a read fails only when no connection of the pool made progress for ``timeout`` + 5
    seconds), read-ahead waits its turn, and a stream whose reader is busy with other sources gives
    its connection to one whose reader waits (and lets it go after ``timeout`` seconds unread),
    resuming later with a ranged GET at its next byte. ``max_open_shards`` (default 64): shards one
    reader keeps open at once, all its sources together (the smallest value its sources give):
    opening one more closes the least recently read one, which reopens later at the byte where it
    stopped (a local file seeks, a remote shard sends a ranged GET, a compressed shard is decompressed
    again from its start: see `mixer.storage.open_shards`), so open files do not grow with the
    number of sources.
    """

    timeout: float = 60.0
    retries: int = 5
    backoff: float = 0.5
    block_size: int = DEFAULT_BLOCK_SIZE
    read_ahead: int = 2
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS

    def __post_init__(self) -> None:
        # Messages read "io_options.<key>: <rule>, got <value>"; a Source puts its name in front.
        for name, lo, strict, integer, hi in (
            ("timeout", 0.0, True, False, None),
            ("retries", 0, False, True, None),
            ("backoff", 0.0, False, False, None),
            ("block_size", 1, False, True, None),
            ("read_ahead", 0, False, True, None),
            ("max_connections", 1, False, True, 4096),
            ("max_open_shards", 1, False, True, 65536),
        ):
            value = _check.number(
                getattr(self, name), f"io_options.{name}", minimum=lo, strict=strict, integer=integer, maximum=hi
            )
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, value: IOOptions | Mapping[str, Any] | None) -> IOOptions:
        """``value`` itself, the options a mapping names (unknown keys are a `ConfigError` with a
        hint), or the defaults for None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"io_options: must be a mapping of {', '.join(IO_OPTIONS)} (got {value!r})")
        for key in value:
            if key not in IO_OPTIONS:
                close = difflib.get_close_matches(str(key), IO_OPTIONS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(IO_OPTIONS)}"
                raise ConfigError(f"io_options: unknown key {key!r}{hint}")
        return cls(**value)

    def open_kwargs(self) -> dict[str, Any]:
        """The keywords of `open_shard` these options set."""
        return {
            "timeout": self.timeout,
            "retries": self.retries,
            "backoff": self.backoff,
            "block_size": self.block_size,
            "max_connections": self.max_connections,
        }


IO_OPTIONS = ("timeout", "retries", "backoff", "block_size", "read_ahead", "max_connections", "max_open_shards")
