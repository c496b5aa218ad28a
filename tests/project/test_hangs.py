"""The suite's hang report (tests/support/hangs.py): a process tree that hangs fails with each
process's state and the Python stacks of all of them, and nothing of it is left running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from hangs import communicate_or_explain, descendants

# A parent that starts a child and both sleep in a function named for the test to find.
CHILD = "import time\\ndef child_waits_here():\\n    time.sleep(60)\\nchild_waits_here()"
TREE = f"""
import subprocess, sys, time
def parent_waits_here():
    child = subprocess.Popen([sys.executable, "-c", "{CHILD}"])
    print("child", child.pid, flush=True)
    time.sleep(60)
parent_waits_here()
"""


@pytest.mark.parametrize("dump", [signal.SIGABRT, signal.SIGUSR1])
def test_a_hung_tree_fails_with_every_process_and_its_stacks_and_is_killed(dump):
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    script = (
        TREE
        if dump == signal.SIGABRT
        else "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1)\n" + TREE
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while len(descendants(proc.pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    child = descendants(proc.pid)[0]
    with pytest.raises(AssertionError) as failed:
        communicate_or_explain(proc, 1.0, dump=dump)
    report = str(failed.value)
    assert report.startswith("hung for 1s")
    assert f"{proc.pid}: " in report and f"{child}: " in report and "wchan=" in report
    assert "parent_waits_here" in report
    if shutil.which("gdb"):  # each thread's C stack: the sleep the parent waits in
        assert f"--- C stacks of {proc.pid}" in report and "sleep" in report.split("C stacks:", 1)[1]
    if dump == signal.SIGABRT:  # SIGUSR1 reaches the child, which registered nothing and dies of it
        assert "child_waits_here" in report
    assert proc.poll() is not None and descendants(proc.pid) == []
