"""Waiting on what a test waits for (a file another process writes), with a bound, instead of a fixed
sleep: the wait ends as soon as the thing is there, and a loaded machine only makes it longer."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path


def wait_for_files(paths: Sequence[Path], seconds: float, *, poll: float = 0.2) -> bool:
    """Whether every one of ``paths`` exists within ``seconds`` (checked every ``poll`` seconds)."""
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True
