"""Secrets out of the DEBUG logs of the libraries that mixer's I/O layer drives.

fsspec logs every URL it requests at DEBUG (``user:password@`` and presigned query strings
included); botocore logs request signatures, canonical requests (with ``x-amz-security-token``) and
request headers (``Authorization``); urllib3 logs request lines with their query strings. mixer's own
messages are redacted where they are made; these are not ours to change, so their *records* are
rewritten as they are created.

Why a LogRecord factory and not a `logging.Filter`: a filter on a logger does not see the records of
its child loggers (``fsspec.http``, ``botocore.auth``), and a filter on handlers would have to be on
every handler the application ever adds. The factory sees every record when it is made, and only
records of the loggers named in `LIBRARIES` (and their children) are touched: their message is
formatted once, scrubbed, and stored already formatted (``args`` emptied) if anything was removed;
an exception's traceback text likewise. Records are only made for enabled levels, so nothing costs
anything unless DEBUG logging of those libraries is on.

`install` is called when the I/O layer first builds a remote filesystem (in each process: DataLoader
workers included); it wraps whatever factory is in place, once. An application that later replaces
the factory without chaining to the previous one removes the protection.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from mixer.storage.urls import redact

__all__ = ["LIBRARIES", "install", "scrub"]

#: Top-level logger names whose records are scrubbed (the libraries mixer's I/O layer drives, and
#: the fsspec backends users commonly add).
LIBRARIES = frozenset(
    {"fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "urllib3", "aiohttp", "gcsfs", "adlfs", "requests"}
)

_MASK = "***"
# An Authorization header's whole value (scheme and credentials, e.g. "Basic dXNl...").
_AUTHORIZATION = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*(?:b?['\"])?)[^'\"\r\n]+")
# Fields that carry a credential: query parameters (X-Amz-Signature=, sig=), header lines
# (x-amz-security-token:), "Signature:\n<hex>" (botocore.auth), dict items ('password': '...').
_FIELD = re.compile(
    r"(?i)\b([\w.-]*(?:signature|credential|security[-_]token|session[-_]token|secret[\w-]*|password|passwd|sig|"
    r"access[-_]?key(?:[-_]?id)?|api[-_]?key|token))"
    # (a bytes literal's b only before its quote: a bare value may begin with b, e.g. a hex signature)
    r"(['\"]?[ \t]*(?:=|:)[ \t]*\r?\n?[ \t]*(?:b?['\"])?)"
    r"([^\s'\",&;}<>]+)"
)

_lock = threading.Lock()
_installed = False


def scrub(text: str) -> str:
    """`text` without URL credentials, query strings and fragments (`mixer.storage.redact`), and with the
    values of credential-like fields (signatures, tokens, secrets, passwords, Authorization) masked."""
    text = redact(text)
    text = _AUTHORIZATION.sub(lambda m: m.group(1) + _MASK, text)
    return _FIELD.sub(lambda m: m.group(1) + m.group(2) + _MASK, text)


def install() -> None:
    """Scrub the records of `LIBRARIES` from now on, in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            if record.name.partition(".")[0] in LIBRARIES:
                _scrub_record(record)
            return record

        logging.setLogRecordFactory(factory)
        _installed = True


def _scrub_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 (a malformed record: logging reports it when it is emitted)
        return
    clean = scrub(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        clean = scrub(text)
        if clean != text:
            record.exc_text = clean
