"""Ctrl-C that Python would swallow. A ``KeyboardInterrupt`` raised while a finalizer runs is
"unraisable": Python prints it and carries on. The main process runs such finalizers all the time (a
batch's shared-memory slot goes back to its worker, by a weakref callback, when the batch's tensors are
freed), so a Ctrl-C that lands in one, which a loaded machine makes likely enough, would be lost, and a
loop over an endless stream (``stop="never"``) would never end. While a loader iterates, such an
interrupt is noted and raised at the next batch. Python's own report of it is still printed, unless
the hook this one chains to hides it (the ``mixer`` command's does). Process-wide: a second loader
starting a pass forgets an interrupt noted for the first one and not yet raised.

The workers do not take Ctrl-C at all (:func:`unheard_by_children`): the main process ends them."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["raise_noted", "unheard_by_children", "watch"]

_noted = False
_previous: Any = None


def _hook(unraisable: Any) -> None:
    global _noted
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        _noted = True
    (_previous or sys.__unraisablehook__)(unraisable)


def watch() -> None:
    """From now on, note a swallowed ``KeyboardInterrupt`` (chained to the hook in place; once per
    process). One swallowed before this call belonged to something else and is forgotten."""
    global _noted, _previous
    _noted = False
    if sys.unraisablehook is not _hook:
        _previous, sys.unraisablehook = sys.unraisablehook, _hook


def raise_noted() -> None:
    """Raise the ``KeyboardInterrupt`` a finalizer swallowed since :func:`watch`, if one did."""
    global _noted
    if _noted:
        _noted = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def unheard_by_children() -> Iterator[None]:
    """Around the fork of DataLoader workers: SIGINT is blocked in this thread, so the children forked
    here start with it blocked and never see Ctrl-C; a Ctrl-C meanwhile reaches this process when the
    block ends. A terminal's Ctrl-C goes to the whole process group, and a ``KeyboardInterrupt`` in a
    worker that lands just after it took the lock of DataLoader's shared ``done_event`` (which it checks
    all the time) leaves that lock taken: the worker, then the main process shutting the workers down,
    wait for it for ever. The workers need no Ctrl-C: the main process ends them (and they exit when it
    dies). A blocked mask is inherited through exec too: a ``pipe:`` command run by a worker does not
    take Ctrl-C either, and ends when its reader does."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
