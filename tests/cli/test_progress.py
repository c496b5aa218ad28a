"""The CLI's progress bar and its log lines under Ctrl-C (mixer.cli.progress). A real SIGINT is raised
at every function call and return of one log line and one bar update in turn (a profile hook: Python
runs a signal's handler at such points), and each time the interrupt must come out of the block, with
nothing printed about it and the bar's lock free. The log line goes to a logger of its own that does not
propagate: the sweep would otherwise interrupt pytest's own handlers too, whose locks nothing guards."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import pytest

from mixer.cli.progress import Progress

log = logging.getLogger("mixer.test_progress")
log.propagate = False


def _write(bar):
    log.warning("a log line above the bar")
    bar.update(1)
    bar.set_postfix_str("1 tok/s", refresh=False)
    bar.refresh()  # update() redraws only once mininterval has passed


def _free(lock) -> bool:
    """Whether another thread can take ``lock`` (within 2 s)."""
    took: list[bool] = []

    def take():
        if lock.acquire(timeout=2):
            lock.release()
            took.append(True)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(10)
    return took == [True]


def _run(at: int | None) -> tuple[int, bool, bool]:
    """Enter a Progress, then run ``_write`` with SIGINT raised at its ``at``-th profile event (None:
    never). Returns (events seen, whether KeyboardInterrupt came out, whether the locks were free after).
    Events seen stops at ``at``: fewer means this run had fewer events (a redraw skipped) and no SIGINT."""
    seen = 0

    def profile(frame, event, arg):
        nonlocal seen
        seen += 1
        if seen == at:
            sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)  # its handler runs here, as at any call or return

    progress = Progress(3, loggers=[log])
    interrupted = False
    locks = []
    try:
        with progress as bar:
            locks = [bar.get_lock(), *(h.lock for h in log.handlers)]  # the bar's, the log handler's
            sys.setprofile(profile)
            try:
                _write(bar)
            finally:
                sys.setprofile(None)
    except KeyboardInterrupt:
        interrupted = True
    free = len(locks) == 2 and all(_free(lock) for lock in locks)
    assert progress.ctrl_c == (seen == at)
    return seen, interrupted, free


def test_a_ctrl_c_at_any_point_of_a_log_line_or_bar_update_ends_the_block_and_prints_nothing(capsys):
    previous = signal.getsignal(signal.SIGINT)
    handlers, log.handlers = log.handlers, []  # pytest's own (it adds them here too) out of the sweep
    try:
        _sweep(capsys)
    finally:
        log.handlers = handlers
    assert signal.getsignal(signal.SIGINT) is previous  # restored

    # pytest's handlers were never interrupted, and logging's module lock was left free: another thread
    # can still log through them and make a logger
    def log_and_make():
        logging.getLogger("mixer.test_progress.after").warning("after the sweep")

    other = threading.Thread(target=log_and_make, daemon=True)
    other.start()
    other.join(10)
    assert not other.is_alive()


def _sweep(capsys):
    events, interrupted, free = _run(None)
    assert not interrupted and free and events > 50
    capsys.readouterr()
    lost, fired = [], 0
    for at in range(1, events + 1):
        seen, interrupted, free = _run(at)
        err = capsys.readouterr().err
        if seen < at:
            continue
        fired += 1
        if not interrupted or not free or "Traceback" in err or "Logging error" in err or "KeyboardInterrupt" in err:
            lost.append((at, interrupted, free, err[-2000:]))
        # the lock left free: the next block writes and ends normally
        _, again, free = _run(None)
        assert not again and free, at
        capsys.readouterr()
    assert fired > 0.9 * events
    assert not lost, f"{len(lost)} of {fired} points lost the Ctrl-C, left a lock taken or printed; first: {lost[0]}"
    assert log.handlers == []  # our handler gone with each block


def test_the_log_handler_shares_the_bar_lock_and_replaces_the_console_handler(capsys):
    import sys

    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("custom %(message)s"))
    other = logging.NullHandler()
    handlers, log.handlers = log.handlers, [console, other]
    try:
        progress = Progress(1, loggers=[log])
        with progress:
            ours = [h for h in log.handlers if h not in (console, other)]
            assert other in log.handlers and console not in log.handlers and len(ours) == 1
            assert ours[0].lock is progress.bar_class.get_lock()
            log.warning("hello")
        assert log.handlers == [console, other]
    finally:
        log.handlers = handlers
    assert "custom hello" in capsys.readouterr().err


def test_the_bar_lock_is_private_and_a_release_without_acquire_changes_nothing():
    from tqdm import tqdm

    progress = Progress(1, loggers=[])
    lock = progress.bar_class.get_lock()
    assert tqdm.get_lock() is not lock
    lock.release()  # tqdm's finally after an interrupt that came before its acquire
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)  # re-entrant
    lock.release()
    lock.release()
    taker = threading.Thread(target=lambda: results.append(lock.acquire(blocking=False)))
    results: list[bool] = []
    taker.start()
    taker.join(5)
    assert results == [True]  # released fully: another thread takes it


@pytest.mark.parametrize("held", [False, True])
def test_a_ctrl_c_while_the_lock_is_held_waits_for_its_release(held):
    progress = Progress(1, loggers=[])
    with pytest.raises(KeyboardInterrupt):
        with progress:
            lock = progress.bar_class.get_lock()
            if held:
                lock.acquire()
                signal.raise_signal(signal.SIGINT)
                assert progress.ctrl_c  # noted, not raised: still here
                lock.release()  # raised now
                pytest.fail("the deferred Ctrl-C was not raised at the release")
            else:
                signal.raise_signal(signal.SIGINT)
                pytest.fail("a Ctrl-C with the lock free was not raised at once")


class _CtrlCUnderTheLogLock:
    """Stands where `mixer run --plot` keeps its History (``update`` per batch): at the 3rd batch it
    takes the lock of the log handler that `_stream` put on the root logger, presses Ctrl-C (a real
    SIGINT) while holding it, and lets go."""

    def __init__(self) -> None:
        self.batches = 0
        self.held_through = False  # the Ctrl-C did not raise while the lock was held
        self.after_release = False  # reached only if the release did not raise it

    def update(self, batch) -> None:
        from mixer.cli.progress import _BarLogHandler

        self.batches += 1
        if self.batches == 3:
            ours = [h for h in logging.getLogger().handlers if isinstance(h, _BarLogHandler)]
            assert len(ours) == 1, logging.getLogger().handlers
            ours[0].lock.acquire()
            signal.raise_signal(signal.SIGINT)
            self.held_through = True
            ours[0].lock.release()
            self.after_release = True


def test_the_cli_stream_defers_a_ctrl_c_pressed_under_its_log_lock_and_ends_as_interrupted(three_sources):
    import mixer
    from mixer.cli import commands

    mix = mixer.Mixture(
        [mixer.Source(name, three_sources[name][0]) for name in ("web", "code", "books")],
        batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
        stop="never",
    )
    previous = signal.getsignal(signal.SIGINT)
    probe = _CtrlCUnderTheLogLock()
    stats, interrupted = commands._stream(mixer.make_loader(mix), steps=1000, every=1, history=probe)
    assert interrupted and probe.held_through and not probe.after_release
    assert stats["batches"] == 3 and probe.batches == 3
    assert signal.getsignal(signal.SIGINT) is previous
    assert not any(type(h).__name__ == "_BarLogHandler" for h in logging.getLogger().handlers)
