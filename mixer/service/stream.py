"""The trainer's side of a service: its readers' groups in the loader's round robin, with flow
control, recovery from a dead reader and a bound on every wait.

**Flow control.** Each reader has at most ``calls_in_flight`` calls outstanding; a call asks for a
group of batches (1, 2, 4, ... up to the loader's limit, so the first batch is not held back), and a
new call goes out when a group comes in. So a reader is at most ``calls_in_flight x limit`` batches
ahead of its trainer (backpressure: a reader that is not asked makes nothing), and the trainer waits
only when the group whose turn it is has not arrived. Groups are taken in the order the loader hands
their batches out (:func:`mixer.runtime.transport.ungrouped`, slot ``p`` of the round robin being
reader ``(p + turn) % n``, :attr:`mixer.state.checkpoint.Resume.turn`), as DataLoader takes its
workers' items, so the adaptive lag counts the same batches ahead as with DataLoader workers and
``prefetch_factor = calls_in_flight`` (:func:`mixer.runtime.feedback.min_lag`). With
``calls_in_flight=0`` (a service of ``readers_per_trainer=0``) a reader is asked only when its
trainer needs the next batch, like ``make_loader(num_workers=0)`` reads in the main process.

**Recovery.** For each reader the trainer keeps the state as of the last batch it *received*
(a :class:`~mixer.state.checkpoint.ReaderLog` fed from every batch that arrives, before the loader's
own log of what it handed out): what the trainer has acknowledged. When the reader's actor dies (a
killed process, a lost node; Ray restarts it, or the service makes a new one) or comes back without
its reader, the calls in flight are dropped and the reader starts again from that state, under a
new token (:mod:`mixer.service.reader_actor`): it re-runs the batches since its last snapshot
in-process and continues with the first batch the trainer has not received, so the stream goes on
exactly, no sample twice and none lost. A reader that fails :data:`MAX_RESTARTS` times in a row
without delivering a batch raises :class:`~mixer.MixerError`.

**Bounds.** Every wait (a reader's start, a group) is bounded by ``timeout`` seconds from when it
became the one waited for; past it the trainer raises :class:`~mixer.MixerError` naming the reader
and the service, never waits for a cluster that is gone.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mixer.batching.batch import Batch
from mixer.errors import MixerError
from mixer.runtime.feedback import SharesTable
from mixer.service.groups import unpack
from mixer.service.reader_actor import SharesInit
from mixer.state.checkpoint import ReaderLog, Resume

if TYPE_CHECKING:
    from mixer.service.service import MixerService

log = logging.getLogger(__name__)

#: Restarts of one reader in a row, without a batch delivered in between, before the trainer gives up.
MAX_RESTARTS = 3


@dataclass
class _Link:
    """One reader of this trainer, as this pass sees it."""

    index: int
    slot: int
    handle: Any
    received: ReaderLog
    pristine: bool  # nothing received and no saved state: start from the stream's beginning
    calls: collections.deque[tuple[Any, float]] = field(default_factory=collections.deque)  # (call, when sent)
    starting: Any = None  # the start call, checked before the first group after it
    since: float = 0.0  # when the reader's previous call ended (or it was started)
    size: int = 1
    sent: int = 0  # adaptive updates this reader's table holds
    token: str = ""
    failures: int = 0


class RemoteStream:
    """One pass of one trainer over its readers (see the module docstring). :meth:`groups` yields
    ``(slot, batches, last)`` as :func:`mixer.runtime.transport.ungrouped` takes them."""

    def __init__(
        self,
        service: MixerService,
        rank: int,
        *,
        resume: Resume | None,
        table: SharesTable | None,
        limit: int,
        calls_in_flight: int,
        timeout: float,
        pin: bool,
    ) -> None:
        from mixer.service.connection import ray_module

        self.ray = ray_module()
        self.service = service
        self.rank = rank
        self.readers = max(service.readers_per_trainer, 1)
        self.table = table
        self.limit = limit
        self.calls_in_flight = calls_in_flight
        self.timeout = timeout
        self.pin = pin
        self.restarts = 0
        self.calls = 0
        self.wait_s = 0.0
        turn = resume.turn if resume is not None else 0
        handles = service.handles(rank)
        self.links = []
        for j in range(self.readers):
            received = ReaderLog.from_state(resume.readers[j]) if resume is not None else ReaderLog()
            self.links.append(
                _Link(
                    index=j,
                    slot=(j - turn) % self.readers,
                    handle=handles[j],
                    received=received,
                    pristine=resume is None,
                )
            )
        self.links.sort(key=lambda link: link.slot)

    def _where(self, link: _Link) -> str:
        return f"reader {link.index} of trainer {self.rank} of service {self.service.name!r}"

    def groups(self) -> Iterator[tuple[int, list[Batch], bool]]:
        for link in self.links:
            self._start(link)
        live = list(self.links)
        while live:
            for link in list(live):
                batches, last, error = self._next(link)
                yield link.slot, batches, last
                if error is not None:
                    raise error
                if last:
                    live.remove(link)

    def close(self) -> None:
        """The pass ended (or was left): readers close what they hold; calls in flight are dropped."""
        for link in self.links:
            link.calls.clear()
            try:
                link.handle.release.remote(link.token)
            except Exception as exc:  # a reader gone with the cluster has nothing to close
                log.debug("%s: release not sent: %s", self._where(link), exc)

    # ---- one reader ----------------------------------------------------------------------------

    def _shares(self) -> SharesInit | None:
        t = self.table
        return None if t is None else (t.n, t.update_every, t.lag, t.capacity, *t.rows_since(0))

    def _start(self, link: _Link) -> None:
        link.calls.clear()
        link.token = uuid.uuid4().hex
        state = None if link.pristine else link.received.state_dict()
        world = (self.rank, self.service.world_size, link.index, self.readers)
        link.sent = 0 if self.table is None else self.table.published
        link.starting = link.handle.start.remote(link.token, world, state, self._shares())
        link.size = 1
        link.since = time.monotonic()
        for _ in range(self.calls_in_flight):
            self._call(link)

    def _call(self, link: _Link) -> None:
        shares = None
        if self.table is not None and self.table.published > link.sent:
            shares = self.table.rows_since(link.sent)
            link.sent = self.table.published
        link.calls.append((link.handle.take.remote(link.token, link.size, shares), time.monotonic()))
        link.size = min(2 * link.size, self.limit)
        self.calls += 1

    def _get(self, link: _Link, ref: Any, sent: float = 0.0) -> Any:
        """The result of a call of ``link``'s reader: it runs once the reader's previous call has
        ended and once it was sent, and may take ``timeout`` seconds from the later of the two."""
        left = max(link.since, sent) + self.timeout - time.monotonic()
        start = time.perf_counter()
        try:
            return self.ray.get(ref, timeout=max(left, 1e-3))
        except self.ray.exceptions.GetTimeoutError:
            raise MixerError(
                f"{self._where(link)} did not answer within {self.timeout:g} s (timeout): its actor cannot be "
                "placed or reached (its node or the Ray cluster is gone, or it has no resources left)"
            ) from None
        finally:
            self.wait_s += time.perf_counter() - start

    def _next(self, link: _Link) -> tuple[list[Batch], bool, BaseException | None]:
        ray = self.ray
        while True:
            try:
                if link.starting is not None:
                    self._get(link, link.starting)
                    link.starting, link.since = None, time.monotonic()
                if not link.calls:
                    self._call(link)
                got = self._get(link, *link.calls[0])
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                self._restart(link, f"{type(exc).__name__}: {exc}", dead=isinstance(exc, ray.exceptions.ActorDiedError))
                continue
            link.calls.popleft()
            link.since = time.monotonic()
            if isinstance(got, str):  # STALE: the actor was restarted and lost its reader
                self._restart(link, "its actor came back without its reader", dead=False)
                continue
            data, entries, last, error, where = got
            batches = unpack(data, entries, pin=self.pin)
            for b in batches:
                link.received = link.received.after(b.meta)
            if batches:
                link.pristine = False
                link.failures = 0
            if last or error is not None:
                link.calls.clear()
            elif self.calls_in_flight:
                self._call(link)
            if error is not None and where:
                note = getattr(error, "add_note", None)
                if callable(note):
                    note(f"raised in {self._where(link)}:\n{where}")
            return batches, last, error

    def _restart(self, link: _Link, why: str, *, dead: bool) -> None:
        link.failures += 1
        if link.failures > MAX_RESTARTS:
            raise MixerError(
                f"{self._where(link)} failed {link.failures} times in a row without delivering a batch (last: {why})"
            )
        self.restarts += 1
        log.warning(
            "%s failed (%s); starting it again from the state of the last batch received (%d batch(es) after its "
            "snapshot)",
            self._where(link),
            why,
            link.received.replay,
        )
        link.calls.clear()
        link.since = time.monotonic()
        if not dead:
            dead = not self._await_restart(link)
        if dead:  # Ray will not restart it: the service makes a new actor under the same name
            link.handle = self.service.revive(self.rank, link.index, timeout=self.timeout)
        self._start(link)

    def _await_restart(self, link: _Link) -> bool:
        """Wait (within the timeout) until Ray has the reader's actor back; False if it is dead for good.
        While Ray restarts an actor, a call fails at once (``ActorUnavailableError``): asking again
        until one answers keeps those refusals from counting as failures of the reader."""
        ray, pause = self.ray, 0.05
        while True:
            try:
                self._get(link, link.handle.describe.remote())
                return True
            except ray.exceptions.ActorDiedError:
                return False
            except ray.exceptions.ActorUnavailableError:
                time.sleep(pause)
                pause = min(2 * pause, 0.5)
