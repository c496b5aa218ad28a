"""The progress bar of ``mixer run`` and ``mixer demo``, its log lines, and Ctrl-C while they write.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is running when Ctrl-C
arrives. Inside tqdm's write lock that loses it: tqdm takes the lock inside a ``try`` whose
``finally`` lets it go, so an interrupt that lands before the lock is taken makes that ``finally``
release a lock it does not hold. The ``RuntimeError`` that follows replaces the interrupt, the log
handler swallows it ("--- Logging error ---" and a traceback on stderr), and the stream goes on as if
Ctrl-C had never been pressed: for ever, with ``stop="never"``. The ``logging`` handler's own lock has
the same window (taken before its ``try``): a Ctrl-C there leaves it taken, and the next thread that
logs waits for ever. So the bar and its log handler share one lock, and while the main thread holds it
Ctrl-C is only noted, and raised as the lock is let go (:class:`_DeferringLock`); a release without
the acquire is a no-op.

A ``KeyboardInterrupt`` that lands inside a finalizer is swallowed by Python ("Exception ignored in
..."); :mod:`mixer.runtime.interrupts` raises it at the next batch. Once Ctrl-C was pressed here, such
a report is not printed, and the DataLoader's error about workers the same Ctrl-C stopped is read as
the interrupt (``Progress.ctrl_c``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

__all__ = ["Progress"]


class _DeferringLock:
    """The bar's write lock (given to tqdm with ``set_lock``): a re-entrant lock during whose holding,
    by the main thread, :class:`Progress` notes Ctrl-C instead of raising it; the outermost release
    raises it. The hold count is per thread, so a release by a thread that holds nothing (tqdm's
    ``finally`` after an interrupt that came before its acquire) changes nothing."""

    def __init__(self, progress: Progress) -> None:
        self._lock = threading.RLock()
        self._held = threading.local()
        self._progress = progress

    def held_here(self) -> int:
        return getattr(self._held, "depth", 0)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        depth = self.held_here()
        self._held.depth = depth + 1  # from here on, a Ctrl-C waits for the release
        if self._lock.acquire(blocking, timeout):
            return True
        self._let_go(depth)  # not taken (tqdm's non-blocking refresh)
        return False

    def release(self) -> None:
        depth = self.held_here()
        if depth == 0:
            return
        self._lock.release()
        self._let_go(depth - 1)

    def _let_go(self, depth: int) -> None:
        self._held.depth = depth
        if depth == 0 and threading.current_thread() is threading.main_thread():
            self._progress.raise_deferred()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _at_fork_reinit(self) -> None:
        # logging calls this on its handlers' locks in a forked child (a DataLoader worker), where
        # only the forking thread lives on: the lock is free there and nothing is held.
        self._lock = threading.RLock()
        self._held = threading.local()


class _BarLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A console handler's records written above the bar (``tqdm.write``), under the bar's lock,
    which is this handler's lock too (see the module's text)."""

    def __init__(self, bar_class: type[tqdm], lock: _DeferringLock, stream: Any) -> None:
        super().__init__(stream)
        self.bar_class = bar_class
        self.lock = lock  # type: ignore[assignment]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar_class.write(self.format(record), file=self.stream)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


class Progress:
    """``with Progress(total) as bar:`` a tqdm bar on stderr, the console handlers of ``loggers`` (the
    root logger's by default) replaced by one that writes above it, and Ctrl-C made safe for both (see
    the module's text). On the main thread only: the SIGINT handler and ``sys.unraisablehook`` are
    this object's while it is entered, and restored after. ``KeyboardInterrupt`` still ends the
    ``with`` block as usual; ``ctrl_c`` says whether Ctrl-C was pressed since it was entered."""

    def __init__(self, total: int, *, loggers: Sequence[logging.Logger] | None = None) -> None:
        self.total = total
        self.loggers = [logging.getLogger()] if loggers is None else list(loggers)
        self.ctrl_c = False  # pressed since __enter__
        self._pending = False
        self._lock = _DeferringLock(self)
        # A class of its own, so that the lock and the monitor setting stay off every other tqdm bar.
        self.bar_class: type[tqdm] = type("MixerBar", (tqdm,), {"monitor_interval": 0})  # no monitor thread
        self.bar_class.set_lock(self._lock)
        self._exit = contextlib.ExitStack()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.ctrl_c = True
        if self._lock.held_here():
            self._pending = True
            return
        signal.default_int_handler(signum, frame)

    def raise_deferred(self) -> None:
        """Raise the Ctrl-C noted while the main thread held the bar's lock, if one was."""
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers are the main thread's
        previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        self._exit.callback(signal.signal, signal.SIGINT, previous_handler)
        previous_hook = sys.unraisablehook

        def unraisable(info: Any) -> None:
            if not (self.ctrl_c and isinstance(info.exc_value, KeyboardInterrupt)):
                previous_hook(info)

        sys.unraisablehook = unraisable
        self._exit.callback(setattr, sys, "unraisablehook", previous_hook)

    def _redirect_logging(self) -> None:
        for logger in self.loggers:
            terminal = (sys.stdout, sys.stderr)
            console = [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and h.stream in terminal]
            ours = _BarLogHandler(self.bar_class, self._lock, console[0].stream if console else sys.stderr)
            if console:
                ours.setFormatter(console[0].formatter)
            self._exit.callback(setattr, logger, "handlers", logger.handlers)
            logger.handlers = [h for h in logger.handlers if h not in console] + [ours]

    def __enter__(self) -> tqdm:
        try:
            self._install()
            self._redirect_logging()
            bar = self.bar_class(total=self.total, unit="batch", dynamic_ncols=True, file=sys.stderr)
        except BaseException:
            self._exit.close()
            raise
        # Closed first on the way out: the handler is still this object's while the bar writes its end.
        self._exit.push(lambda *exc: bar.close())
        return bar

    def __exit__(self, *exc: object) -> None:
        self._exit.close()
