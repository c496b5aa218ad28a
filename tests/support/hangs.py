"""Tests that run a process tree (a scenario script, torchrun and its ranks, DataLoader workers) and
wait for it: one that hangs fails with what explains the hang instead of a bare timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid``, children before their own children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop(0))
        todo += children.get(found[-1], [])
    return found


def _describe(pid: int) -> str:
    """A process's command, state, what it waits in (wchan) and its signal masks (an ignored or
    blocked SIGINT never interrupts it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = " ".join(x for x in f.read().splitlines() if x.startswith(("State", "SigBlk", "SigIgn")))
    except OSError as exc:
        return f"{pid}: {exc}"
    threads = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int) if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f, open(f"/proc/{pid}/task/{tid}/wchan") as g:
                threads.append(f"{tid}:{f.read().strip()}@{g.read()}")
        except OSError:
            continue
    return f"{pid}: {command}\n    {status} wchan={wchan}\n    threads: {' '.join(threads)}"


NATIVE_STACKS_S = 90.0  # gdb's time for a whole tree: the report must come before the test's own timeout


def _native_stacks(pid: int, deadline: float) -> str:
    """Every thread's C stack (gdb, where installed): a hang inside a C call (a lock taken in
    ``fork``, a collective) shows only its Python caller in the Python stacks. Nothing once
    ``deadline`` (monotonic) has passed."""
    gdb = shutil.which("gdb")
    left = deadline - time.monotonic()
    if gdb is None or left < 1.0:
        return ""
    command = [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off", "-ex", "thread apply all bt 30"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=left)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"gdb {pid}: {exc}\n"
    lines = [x for x in done.stdout.splitlines() if x.startswith(("Thread", "#"))]
    return f"--- C stacks of {pid}\n" + "\n".join(lines) + "\n"


def communicate_or_explain(
    proc: subprocess.Popen, timeout: float, *, dump: signal.Signals = signal.SIGABRT
) -> tuple[str, str]:
    """``proc.communicate(timeout=...)``. On a timeout: describe ``proc`` and every process below it,
    send each ``dump`` (SIGABRT prints a Python process's stacks under ``PYTHONFAULTHANDLER=1``; a
    script that registered ``faulthandler`` for SIGUSR1 prints them and goes on), kill the process
    group (``proc`` must run in a session of its own) and fail with all of it and the output."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc.pid, *descendants(proc.pid)]
        described = [_describe(pid) for pid in tree]
        until = time.monotonic() + NATIVE_STACKS_S
        native = "".join(_native_stacks(pid, until) for pid in tree)
        for pid in reversed(tree):  # the leaves first: a parent that dies first may take them along
            try:
                os.kill(pid, dump)
            except OSError:
                pass
            time.sleep(0.3)
        time.sleep(1.0)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate(timeout=30)
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (out, err))
        raise AssertionError(
            f"hung for {timeout:.0f}s; the processes:\n" + "\n".join(described) + f"\nstdout:\n{out[-4000:]}"
            f"\nstderr (with their stacks):\n{err[-30000:]}\nC stacks:\n{native[-30000:]}"
        ) from None
