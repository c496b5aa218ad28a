"""Run by test_shutdown.py in a process of its own: a loader with workers, left in one way.

    python shutdown_script.py SCENARIO PATTERN

Prints ``workers <pid> ...`` once the workers stream, then ``clean`` if, after the scenario, this
process has no live child process left (checked here, where the children are still ours).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import time

import torch.utils.data

import mixer
from mixer.read.decode import default_tokens


def live_children(pid: int) -> list[int]:
    """Child processes of ``pid`` that are not zombies (a zombie has exited; its parent reaps it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry))
    return found


def wait_no_children(deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not live_children(os.getpid()):
            return True
        time.sleep(0.05)
    return False


class FailingDecode:
    """Decodes normally, except that a worker raises on its 450th sample (in its second source-epoch,
    after it has delivered batches) (a bug in user code)."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, sample):
        if torch.utils.data.get_worker_info() is not None:
            self.seen += 1
            if self.seen == 450:
                raise RuntimeError("decode bug on purpose")
        return default_tokens(sample)


def main() -> None:
    scenario, pattern = sys.argv[1], sys.argv[2]
    # This stands in for a training job in a terminal's foreground, whose SIGINT Python turns into
    # KeyboardInterrupt. A test run started as a background job of a non-interactive shell (`make test &`,
    # as CI scripts do) has SIGINT ignored, which children inherit and Python then leaves alone: the
    # Ctrl-C scenario would wait forever for an interrupt that never comes.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump of a hung scenario
    decode = FailingDecode() if scenario == "worker-error" else None
    mix = mixer.Mixture(
        [mixer.Source("s", pattern, decode=decode)],
        batching=mixer.TokenBudget(max_tokens=64, max_length=64),
        stop="never",
    )
    loader = mixer.make_loader(mix, num_workers=2, prefetch_factor=2)
    if scenario == "break":
        for step, _ in enumerate(loader):
            if step == 0:
                print("workers", *live_children(os.getpid()), flush=True)
            if step == 5:
                break
    elif scenario == "del":
        it = iter(loader)
        next(it)
        print("workers", *live_children(os.getpid()), flush=True)
        next(it)
        del loader, it
        gc.collect()
    elif scenario in ("sigint", "sigterm"):
        try:
            for step, _ in enumerate(loader):
                if step == 0:
                    print("workers", *live_children(os.getpid()), flush=True)
                time.sleep(0.01)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    elif scenario == "worker-error":
        try:
            for step, _ in enumerate(loader):
                if step == 0:
                    print("workers", *live_children(os.getpid()), flush=True)
        except RuntimeError as exc:
            print("raised:", exc, flush=True)
    print("clean" if wait_no_children(5.0) else f"left {live_children(os.getpid())}", flush=True)


if __name__ == "__main__":
    main()
