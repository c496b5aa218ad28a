"""Faults: whether an exception of the storage stack is transient (retry it) or permanent (a
`ShardError` now), with a reason safe to show; and the one retry loop (exponential backoff with
jitter) that listings and remote streams share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from mixer.errors import ShardError
from mixer.storage.registry import SCHEMES
from mixer.storage.urls import redact

__all__ = ["Backoff", "EndOfShard", "Fault", "classify", "describe", "retrying", "safe_cause"]

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0
MAX_RETRY_AFTER = 60.0

_T = TypeVar("_T")


class Fault(Exception):
    """A fault the storage layer diagnosed itself (an HTTP status, a short body)."""

    def __init__(self, reason: str, *, transient: bool, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transient = transient
        self.retry_after = retry_after


class EndOfShard(Exception):
    """Opening at this position found nothing left to read (the position is the shard's size)."""


class _RedactedCause(Exception):
    """Stands in for a library exception whose text held a URL with credentials or a query string."""


_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.ENETRESET,
    errno.EAGAIN,
}


def describe(exc: BaseException) -> str:
    text = redact(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Bugs, not I/O faults: they propagate unchanged instead of becoming a (skippable) ShardError.
_PROGRAMMING_ERRORS = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    LookupError,
    NotImplementedError,
    ImportError,
)


def classify(exc: BaseException) -> Fault | None:
    """Transient (retry) or permanent (raise a ShardError now), with a redacted reason; None for a bug.
    Each storage backend classifies the errors of its own libraries (aiohttp's, botocore's: see
    `mixer.storage.backend.Backend.classify`); what none of them claims follows the rules here."""
    if isinstance(exc, Fault):
        return exc
    for backend in SCHEMES.backends():  # the errors of each scheme's own libraries first
        fault = backend.classify(exc)
        if fault is not None:
            return fault
    if isinstance(exc, FileNotFoundError):
        return Fault("not found", transient=False)
    if isinstance(exc, PermissionError):
        return Fault("access denied", transient=False)
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return Fault(describe(exc), transient=False)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return Fault(f"timed out ({describe(exc)})", transient=True)
    if isinstance(exc, ConnectionError):
        return Fault(describe(exc), transient=True)
    if isinstance(exc, OSError):
        return Fault(describe(exc), transient=exc.errno is None or exc.errno in _TRANSIENT_ERRNOS)
    if isinstance(exc, _PROGRAMMING_ERRORS):
        return None
    return Fault(describe(exc), transient=False)  # e.g. another fsspec backend's own error type


def safe_cause(exc: BaseException) -> BaseException:
    """``exc`` itself, unless its text (or that of its chain) shows a URL with secrets: then a stand-in."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        text = str(node)
        if redact(text) != text:
            return _RedactedCause(f"{type(exc).__module__}.{type(exc).__qualname__}: {redact(str(exc))}")
        node = node.__cause__ or node.__context__
    return exc


class Backoff:
    """Exponential backoff with jitter, on a private generator (never the global RNG)."""

    def __init__(self, base: float) -> None:
        self.base = base
        self.rng = random.Random()

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        d = min(self.base * 2.0 ** (attempt - 1), MAX_BACKOFF) * (0.5 + 0.5 * self.rng.random())
        if retry_after is not None:
            d = max(d, min(retry_after, MAX_RETRY_AFTER))
        return d


def retrying(
    attempt: Callable[[], _T],
    where: Callable[[], str],
    *,
    retries: int,
    backoff: Backoff,
    in_a_row: bool = False,
    after_fault: Callable[[], None] | None = None,
    before_retry: Callable[[], None] | None = None,
) -> _T:
    """``attempt()``, again after a backoff on each transient fault, at most ``retries`` times in this
    call; a permanent fault, or one transient fault too many, is a `ShardError` that starts with
    ``where()`` (the text is only made for a fault) and chains the cause, redacted. Bugs propagate.

    ``after_fault`` runs after any exception of ``attempt`` (a bug's too), before it is classified;
    ``before_retry`` before each wait. A metadata operation (list, glob) and a remote stream's open
    and reads go through here alike, so they share one policy; the stream says ``in_a_row``: each
    call starts a new streak, and it calls again once a read made progress.
    """
    streak = 0
    while True:
        try:
            return attempt()
        except Exception as exc:  # classified: bugs propagate
            if after_fault is not None:
                after_fault()
            fault = classify(exc)
            if fault is None:
                raise
            what = where()
            if not fault.transient:
                raise ShardError(f"{what}: {fault.reason}") from safe_cause(exc)
            streak += 1
            if streak > retries:
                row = " in a row" if in_a_row else ""
                raise ShardError(f"{what}: {fault.reason}; gave up after {retries} retries{row}") from safe_cause(exc)
            if before_retry is not None:
                before_retry()
            delay = backoff.delay(streak, fault.retry_after)
            log.warning("%s: %s; retry %d/%d in %.2fs", what, fault.reason, streak, retries, delay)
            time.sleep(delay)
