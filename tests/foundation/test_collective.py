"""`mixer.collective.Bounded`'s wait for a started collective, against a work handle that does what
gloo's does when an operation completes just as a timed wait gives up."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from mixer import collective
from mixer.collective import Bounded, _Collective
from mixer.errors import MixerError


class CompletesAsTheWaitGivesUp:
    """A work handle whose first timed wait raises "Operation timed out!" (as gloo's ``Work.wait``
    does when the timeout passes first) while the operation completes, successfully, right after."""

    def __init__(self) -> None:
        self.completed = False
        self.waits: list[timedelta] = []

    def wait(self, timeout: timedelta) -> bool:
        self.waits.append(timeout)
        if not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.completed


def test_an_operation_that_completes_as_the_timed_wait_gives_up_is_a_success(monkeypatch):
    # Before the fix the rank raised "rank sync ... failed" here, for an all_reduce that succeeded: found
    # by a stress run whose collectives all waited past ARRIVED_AFTER_S (every one of 7 runs failed).
    monkeypatch.setattr(collective, "ARRIVED_AFTER_S", 0.0)
    work = CompletesAsTheWaitGivesUp()
    bounded = Bounded(group=None, timeout=30.0, label="rank sync")
    bounded._wait(_Collective(work, "the test's all_reduce", 1, started=time.monotonic()))
    assert len(work.waits) == 2  # the timed wait, then the one that gave the operation's own outcome


class FailsOnceCompleted(CompletesAsTheWaitGivesUp):
    """The same, but the operation failed: every wait once it has completed raises its own error."""

    def wait(self, timeout: timedelta) -> bool:
        self.waits.append(timeout)
        self.completed = True
        raise RuntimeError("Connection closed by peer" if len(self.waits) > 1 else "Operation timed out!")


def test_an_operation_that_completed_with_an_error_raises_that_error_at_once(monkeypatch):
    monkeypatch.setattr(collective, "ARRIVED_AFTER_S", 0.0)
    work = FailsOnceCompleted()
    bounded = Bounded(group=None, timeout=30.0, label="rank sync")
    # (the error's wording asks the process group who arrived: its own tests run under torchrun)
    monkeypatch.setattr(bounded, "_error", lambda c, exc: MixerError(f"{c.what}: {exc}"))
    with pytest.raises(MixerError, match="the test's all_reduce: Connection closed by peer"):
        bounded._wait(_Collective(work, "the test's all_reduce", 1, started=time.monotonic()))
    assert len(work.waits) == 2  # not waited on until the deadline (30 s)
