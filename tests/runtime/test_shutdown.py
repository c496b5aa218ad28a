"""Leaving a loader with workers in every way a training job does: nothing is left behind.

Each scenario runs in a process of its own (tests/support/shutdown_script.py), so that what it leaves is
seen: live child processes, entries in /dev/shm, or a hang (the subprocess timeout).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hangs import communicate_or_explain
from shardutil import write_token_shards

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
SCRIPT = os.path.join(SUPPORT, "shutdown_script.py")


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shutdown")
    return write_token_shards(folder, "s", [[8 + (i * 7) % 40 for i in range(200)] for _ in range(4)])


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_inodes() -> set[int]:
    """Inodes of /dev/shm files that a live process has mapped (of every process the test can read).
    By inode, not name: glibc's ``sem_open`` maps a temporary file, then links it under the
    semaphore's name and removes the temporary one, so the map shows another (deleted) name."""
    out = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process has ended, or is not ours to read
            continue
        out.update(int(inode) for inode in re.findall(r"^\S+ \S+ \S+ \S+ (\d+)\s+/dev/shm/", text, re.M))
    return out


def _inode(name: str) -> int | None:
    try:
        return os.stat(os.path.join("/dev/shm", name)).st_ino
    except OSError:
        return None


def left_in_shm(before: set[str]) -> set[str]:
    """Entries of /dev/shm that appeared since ``before``, are still there after a second, and no
    live process maps: what the test's processes (all ended by now) leaked. multiprocessing's named
    semaphores (``sem.mp-*``) exist for an instant before they are unlinked, but in a spawn context
    they live as long as their lock: another test's spawned workers, running beside this one on
    another pytest-xdist worker, have theirs mapped (seen with four pytest processes)."""
    deadline = time.monotonic() + 1.0
    new = shm_entries() - before
    while new and time.monotonic() < deadline:
        time.sleep(0.05)
        new &= shm_entries()
    if not new:
        return new
    mapped = mapped_inodes()
    return {name for name in new if _inode(name) not in mapped}


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has exited and only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start(scenario: str, pattern: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, SCRIPT, scenario, pattern],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")])),
        },
    )


def worker_pids(proc: subprocess.Popen[str]) -> list[int]:
    line = proc.stdout.readline()
    assert line.startswith("workers "), line + proc.stderr.read()
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2, line
    return pids


def gone_by(pids: list[int], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_the_leak_check_counts_what_nobody_maps_and_not_another_process_s_live_semaphore():
    before = shm_entries()
    code = (
        "import multiprocessing as mp, sys; lock = mp.get_context('spawn').Lock(); print(flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    leaked = f"mixer-leak-check-{os.getpid()}"
    try:
        holder.stdout.readline()
        Path("/dev/shm", leaked).touch()
        live = {name for name in shm_entries() - before if name.startswith("sem.mp-")}
        assert live, "a spawn context's lock should be a named semaphore in /dev/shm while it lives"
        left = left_in_shm(before)
        assert leaked in left and not live & left, (left, live)
    finally:
        holder.communicate("")
        Path("/dev/shm", leaked).unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["break", "del", "worker-error"])
def test_leaving_a_pass_leaves_no_worker_and_no_shared_memory(pattern, scenario):
    before = shm_entries()
    proc = start(scenario, pattern)
    pids = worker_pids(proc)
    out, err = communicate_or_explain(proc, 120, dump=signal.SIGUSR1)
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == "clean", out + err
    if scenario == "worker-error":
        assert "decode bug on purpose" in out
    assert not any(alive(p) for p in pids)
    assert left_in_shm(before) == set()


@pytest.mark.slow
def test_ctrl_c_stops_workers_and_main_cleanly(pattern):
    before = shm_entries()
    proc = start("sigint", pattern)
    pids = worker_pids(proc)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = communicate_or_explain(proc, 60, dump=signal.SIGUSR1)
    assert "interrupted" in out and out.splitlines()[-1] == "clean", out + err
    assert not any(alive(p) for p in pids)
    assert left_in_shm(before) == set()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_exit_promptly_when_the_main_process_dies(pattern, sig):
    """DataLoader's own check runs every 5 s and only while a worker waits for a request; a worker
    blocked on a full result pipe never ran it. Ours ends a worker within ~0.2 s."""
    before = shm_entries()
    proc = start("sigterm", pattern)
    pids = worker_pids(proc)
    time.sleep(0.5)
    signalled = time.monotonic()
    proc.send_signal(sig)  # the main process only: its workers are orphaned
    proc.wait(timeout=60)  # not communicate(): the orphans hold its pipes open while they live
    assert gone_by(pids, signalled + 2.0), [p for p in pids if alive(p)]
    proc.communicate(timeout=60)
    assert left_in_shm(before) == set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_ctrl_c_that_a_finalizer_swallowed_ends_the_pass_at_the_next_batch(pattern, workers):
    """A KeyboardInterrupt raised inside a finalizer (where a Ctrl-C lands when it arrives while a batch's
    slot is being released) is only printed by Python; the loader raises it at the next batch, or an
    endless pass would go on after Ctrl-C."""
    import weakref

    import mixer

    mix = mixer.Mixture(
        [mixer.Source("s", pattern)], batching=mixer.TokenBudget(max_tokens=64, max_length=64), stop="never"
    )
    it = iter(mixer.make_loader(mix, num_workers=workers))
    next(it)

    class Freed:
        pass

    def interrupted() -> None:
        raise KeyboardInterrupt  # what the signal handler raises inside the finalizer

    freed = Freed()
    weakref.finalize(freed, interrupted)
    del freed  # Python reports the interrupt as unraisable and carries on
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert next(it, None) is None  # the pass ended there, as a Ctrl-C between batches ends it


def _sigint_blocked(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(blocked & (1 << (signal.SIGINT - 1)))


def test_workers_never_take_ctrl_c_and_one_pressed_during_the_fork_reaches_the_main_process(pattern):
    """A terminal's Ctrl-C reaches the whole process group. In a worker, a KeyboardInterrupt that lands
    just after it took the lock of DataLoader's shared done_event leaves that lock taken, and the worker
    and the main process then wait for it for ever (seen here: `mixer run` hung after Ctrl-C). The
    workers are forked with SIGINT blocked; the main process ends them."""
    import multiprocessing

    import mixer
    from mixer.runtime import interrupts

    mix = mixer.Mixture(
        [mixer.Source("s", pattern)], batching=mixer.TokenBudget(max_tokens=64, max_length=64), stop="never"
    )
    before = {p.pid for p in multiprocessing.active_children()}
    it = iter(mixer.make_loader(mix, num_workers=2))
    next(it)
    workers = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2
    assert all(_sigint_blocked(pid) for pid in workers)
    assert not _sigint_blocked(os.getpid())  # the main process takes it as before
    it.close()

    # Python's own handler for the check (an earlier test in this process may have set another one)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.unheard_by_children():
                signal.raise_signal(signal.SIGINT)  # pending while blocked ...
                reached = False
            reached = True  # ... and raised as the block ends, not lost
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not reached
    assert not _sigint_blocked(os.getpid())
