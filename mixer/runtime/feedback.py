"""Feedback from the training loop to the readers: per-source loss in, adaptive shares out.

The main process owns a :class:`Feedback`: ``Loader.feedback(batch, loss)`` adds the per-sample loss
to per-source sums and counts on the loss's device (``index_add_``, no synchronisation per step).
Window ``j`` covers global steps ``j·U … (j+1)·U - 1`` (``U = update_every``); it closes when the
loader hands out step ``(j+1)·U``: the sums and counts (and the tokens handed out) are copied to the
host (one synchronisation per window), all-reduced over the data-parallel ranks (on the CPU, bounded
by the loader's ``sync_timeout``: a rank that stops handing out batches makes the others raise
:class:`~mixer.errors.MixerError` naming it; a rank that only stops *reporting* loss holds no one
up, its windows just count no samples), and the policy
(:mod:`mixer.mixing.adaptive`) turns them into new shares, a pure function of the reduced statistics, its
state and the prior's target, so every rank computes the same vector.

Update ``j`` takes effect from global step ``(j+1)·U + lag`` on every reader of every rank. The
shares reach the DataLoader workers through a :class:`SharesTable`, a small ring of rows in an
anonymous shared mapping made before the workers fork: no per-batch IPC. ``lag`` is at least what
the readers may have produced beyond the step being handed out (``prefetch_factor · num_workers``
requests in flight, the device feed's look-ahead, the rank sync's look-ahead), so no reader has made
a batch for step ``(j+1)·U + lag`` when the update is published. **Staleness**: the loss of the last
step of a window first affects the mix ``lag + 1`` steps later, that of its first step ``U + lag``
steps later. A reader that reaches a step whose update is not published yet (a stalled trainer)
waits, warning after :data:`WAIT_WARN_S` and failing after :data:`WAIT_LIMIT_S`.

The state (policy state, the updates so far, the open window's sums and counts) is part of the loader
state, so a resumed run publishes the same rows and continues with bit-identical batches.
"""

from __future__ import annotations

import math
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mixer._warn import warn
from mixer.collective import Bounded
from mixer.errors import ConfigError, MixerError, StateError
from mixer.mixing.adaptive import Adaptive, adapt, make_policy
from mixer.state.checkpoint import expect_keys

if TYPE_CHECKING:
    from mixer.batching.batch import Batch, BatchMeta
    from mixer.mixing.mixture import Mixture

WAIT_WARN_S = 10.0
WAIT_LIMIT_S = 600.0
FEEDBACK_KEYS = ("policy", "updates", "rows", "sums", "counts", "tokens", "loss")
_fence = threading.Lock()


class SharesTable:
    """The last ``capacity`` adaptive updates, shared with forked workers. The main process is the
    only writer: it writes row ``j % capacity`` and then raises ``published`` to ``j + 1`` (a lock
    release/acquire pair in between orders the stores on weakly ordered CPUs); a reader reads
    ``published`` first, then the row, then checks that the row was not overwritten meanwhile."""

    def __init__(self, n: int, *, update_every: int, lag: int, capacity: int) -> None:
        self.n, self.update_every, self.lag, self.capacity = n, update_every, lag, capacity
        self.region = mmap.mmap(-1, 8 * (1 + capacity * n), flags=mmap.MAP_SHARED)
        self._published = np.ndarray((1,), dtype=np.int64, buffer=self.region)
        self._rows = np.ndarray((capacity, n), dtype=np.float64, buffer=self.region, offset=8)

    @property
    def published(self) -> int:
        return int(self._published[0])

    def from_step(self, j: int) -> int:
        """The first global step update ``j`` applies to."""
        return (j + 1) * self.update_every + self.lag

    def in_effect(self, step: int) -> int:
        """How many updates apply at ``step`` (the last of them is the one in effect)."""
        return max(0, (step - self.lag) // self.update_every)

    def publish(self, j: int, shares: np.ndarray) -> None:
        assert j == self.published, (j, self.published)
        self._rows[j % self.capacity] = shares
        with _fence:
            pass
        self._published[0] = j + 1

    def extend(self, first: int, rows: Sequence[Sequence[float]]) -> None:
        """Publish the updates ``first, first + 1, ...`` in ``rows`` that this table lacks: a new
        table's updates so far, or what a table far from the loader's receives (:mod:`mixer.service`)."""
        if self.published < first:  # the earlier updates are no longer needed by any reader
            self._published[0] = first
        for j, row in enumerate(rows, start=first):
            if j >= self.published:
                self.publish(j, np.asarray(row, dtype=np.float64))

    def rows_since(self, j: int) -> tuple[int, list[list[float]]]:
        """The published updates from ``j`` on that the ring still holds: the first one's index and their rows."""
        first = max(j, self.published - self.capacity, 0)
        return first, [self._rows[k % self.capacity].tolist() for k in range(first, self.published)]

    def shares_at(self, step: int, *, wait: bool) -> np.ndarray | None:
        """The adaptive shares in effect at ``step``, or None before the first update applies."""
        need = self.in_effect(step)
        if need == 0:
            return None
        if self.published < need:
            self._wait(step, need, wait)
        with _fence:
            pass
        row = self._rows[(need - 1) % self.capacity].copy()
        if self.published - need >= self.capacity:
            raise MixerError(
                f"adaptive shares for step {step} were overwritten before a reader read them (update {need - 1}, "
                f"{self.published} published, ring of {self.capacity})"
            )
        return row

    def _wait(self, step: int, need: int, wait: bool) -> None:
        if not wait:
            raise MixerError(
                f"adaptive shares for step {step} (update {need - 1}) are not published yet: the loader "
                f"reads further ahead than lag={self.lag} allows"
            )
        start, warned, pause = time.monotonic(), False, 0.0005
        while self.published < need:
            waited = time.monotonic() - start
            if waited > WAIT_LIMIT_S:
                raise MixerError(
                    f"a reader waited {waited:.0f} s for the adaptive shares of step {step} (update {need - 1}); "
                    "is the training loop still running and handing out batches?"
                )
            if waited > WAIT_WARN_S and not warned:
                warn(
                    f"a reader has waited {waited:.0f} s for the adaptive shares of step {step} (update {need - 1}): "
                    "the training loop has not handed out the step that closes that window yet"
                )
                warned = True
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def min_lag(*, num_workers: int, prefetch_factor: int | None, device_prefetch: int, synced: bool) -> int:
    """The least lag at which no reader can have made a batch for the step an update starts at."""
    in_flight = (prefetch_factor if prefetch_factor is not None else 2) * num_workers if num_workers > 0 else 0
    return in_flight + device_prefetch + (1 if synced else 0) + 1


class Feedback:
    """The main process's side: accumulators, the policy, the updates so far. See the module docstring."""

    def __init__(
        self,
        mixture: Mixture,
        adaptive: Adaptive,
        *,
        lag: int,
        readers: int,
        reduce: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.mixture, self.adaptive, self.lag, self.reduce = mixture, adaptive, lag, reduce
        self.n = len(mixture.names)
        # Rows a resumed reader may still need: back to its snapshot (state_every batches per
        # reader) and ahead by the lag.
        span = lag + (mixture.state_every + 1) * readers
        self.capacity = math.ceil(span / adaptive.update_every) + 2
        self.reset()

    def reset(self) -> None:
        self.policy = make_policy(self.adaptive, self.mixture.names)
        self.updates = 0
        self.rows: list[list[float]] = []  # the last `capacity` updates' shares
        self.tokens = 0  # tokens handed out by this rank
        self.loss: list[float | None] = [None] * self.n  # the last closed window's mean loss per source
        self._sums: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._host = np.zeros((2, self.n))  # the open window's statistics restored from a state

    def table(self) -> SharesTable:
        """A fresh shared table holding the updates so far (make it before the workers fork)."""
        t = SharesTable(self.n, update_every=self.adaptive.update_every, lag=self.lag, capacity=self.capacity)
        t.extend(self.updates - len(self.rows), self.rows)
        self._table = t
        return t

    def observe(self, batch: Batch, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(f"feedback: loss must be a torch.Tensor of per-sample losses, got {type(loss).__name__}")
        source = batch.source
        if loss.shape != (len(source),):
            raise ConfigError(
                f"feedback: loss must have one value per sample of the batch, shape ({len(source)},), got "
                f"{tuple(loss.shape)}"
            )
        if self._sums is None:
            # Start from what a restored state brought (zeros otherwise), so that a resumed window
            # adds its losses onto the same running sums as the uninterrupted run: (s + a) + b, not
            # s + (a + b), which may differ in the last bit and so change the shares.
            self._sums = torch.tensor(self._host[0], dtype=torch.float64, device=loss.device)
            self._counts = torch.tensor(self._host[1], dtype=torch.float64, device=loss.device)
            self._host[:] = 0
        assert self._counts is not None
        device = self._sums.device
        index = source.to(device=device, dtype=torch.int64, non_blocking=True)
        self._sums.index_add_(0, index, loss.detach().to(device=device, dtype=torch.float64))
        self._counts.index_add_(0, index, torch.ones(len(source), dtype=torch.float64, device=device))

    def delivered(self, meta: BatchMeta) -> None:
        """Called for every batch handed out, before it is: closes the windows that ended before its step."""
        while (self.updates + 1) * self.adaptive.update_every <= meta.step:
            self._close()
        self.tokens += int(meta.tokens)

    def _window(self) -> np.ndarray:
        stats = self._host.copy()
        if self._sums is not None:
            assert self._counts is not None
            stats += np.stack([self._sums.cpu().numpy(), self._counts.cpu().numpy()])
            self._sums.zero_()
            self._counts.zero_()
        self._host[:] = 0
        return stats

    def _close(self) -> None:
        j = self.updates
        step = (j + 1) * self.adaptive.update_every
        window = self._window()
        reduced = np.concatenate([window.ravel(), [float(self.tokens)]])
        if self.reduce is not None:
            reduced = self.reduce(reduced)
        sums, counts, tokens = reduced[: self.n], reduced[self.n : 2 * self.n], float(reduced[-1])
        prior = self.mixture.target_at(step, tokens)
        m = max(0, (step - 1 - self.lag) // self.adaptive.update_every)  # the shares the window was sampled at
        current = np.asarray(self.rows[m - 1 - (j - len(self.rows))]) if m > 0 else prior
        eligible = np.asarray(self.mixture.info.sizes) > 0
        shares = adapt(self.policy, sums, counts, prior, current, eligible=eligible, min_prob=self.adaptive.min_prob)
        self.loss = [float(s / c) if c > 0 else None for s, c in zip(sums, counts)]
        self.rows = [*self.rows, shares.tolist()][-self.capacity :]
        self.updates = j + 1
        self._table.publish(j, shares)

    def as_dict(self) -> dict[str, Any]:
        names = self.mixture.names
        return {
            "updates": self.updates,
            "lag": self.lag,
            "loss": dict(zip(names, self.loss)),
            "target": dict(zip(names, self.rows[-1])) if self.rows else None,
            "from_step": self.updates * self.adaptive.update_every + self.lag if self.updates else None,
        }

    def state_dict(self) -> dict[str, Any]:
        window = self._host.copy()
        if self._sums is not None:
            assert self._counts is not None
            window += np.stack([self._sums.cpu().numpy(), self._counts.cpu().numpy()])
        return {
            "policy": self.policy.state_dict(),
            "updates": self.updates,
            "rows": [list(r) for r in self.rows],
            "sums": window[0].tolist(),
            "counts": window[1].tolist(),
            "tokens": self.tokens,
            "loss": list(self.loss),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = expect_keys("adaptive", state, FEEDBACK_KEYS)
        self.reset()
        self.policy.load_state_dict(state["policy"])
        rows = state["rows"]
        if (
            not isinstance(rows, list)
            or len(rows) > self.capacity
            or len(rows) > state["updates"]
            or any(not isinstance(r, list) or len(r) != self.n for r in rows)
        ):
            raise StateError(
                f"adaptive state: 'rows' must list at most {self.capacity} rows of {self.n} shares (got {rows!r})"
            )
        if not all(isinstance(state[k], list) and len(state[k]) == self.n for k in ("sums", "counts", "loss")):
            raise StateError(f"adaptive state: 'sums', 'counts' and 'loss' must list {self.n} values")
        self.updates = int(state["updates"])
        self.rows = [[float(x) for x in r] for r in rows]
        self._host = np.array([state["sums"], state["counts"]], dtype=np.float64)
        self.tokens = int(state["tokens"])
        self.loss = [None if x is None else float(x) for x in state["loss"]]


def _all_reduce(group: Any, timeout: float) -> Callable[[np.ndarray], np.ndarray]:
    """The window's statistics summed over ``group``'s ranks, on the CPU (a gloo group over the same
    ranks when ``group``'s backend has no CPU collectives: NCCL), bounded by ``timeout``: a rank
    that stopped handing out batches makes the others raise :class:`~mixer.errors.MixerError`
    naming it (see :mod:`mixer.collective`), not wait for the process group's timeout."""
    import torch.distributed as dist

    from mixer import collective

    if not collective.handles_cpu(group):
        group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
    bounded = Bounded(group, timeout=timeout, label="adaptive feedback")

    def reduce(values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.array(values, dtype=np.float64))
        bounded.all_reduce(t, dist.ReduceOp.SUM, "the all_reduce of the per-source losses that closes an update window")
        return t.numpy()

    return reduce


def make_feedback(
    mixture: Mixture,
    *,
    num_workers: int,
    prefetch_factor: int | None,
    device_prefetch: int,
    synced: bool,
    forked: bool,
    persistent: bool,
    group: Any,
    timeout: float,
) -> Feedback | None:
    """The loader's :class:`Feedback` when the mixture's schedule is :class:`~mixer.Adaptive`, else None.
    ``timeout``: the loader's ``sync_timeout``, bounding each window's all-reduce over the ranks."""
    adaptive = mixture.schedule
    if not isinstance(adaptive, Adaptive):
        return None
    if num_workers > 0 and not forked:
        raise ConfigError(
            "schedule Adaptive: needs DataLoader workers started by fork (the shares reach them through a mapping made "
            "before the fork); use multiprocessing_context='fork' (Linux) or num_workers=0"
        )
    if persistent:
        raise ConfigError(
            "schedule Adaptive: persistent_workers=True is not supported (each pass maps its shares table before its "
            "workers fork, and persistent workers would keep the first pass's); leave persistent_workers=False"
        )
    least = min_lag(
        num_workers=num_workers, prefetch_factor=prefetch_factor, device_prefetch=device_prefetch, synced=synced
    )
    if adaptive.lag is not None and adaptive.lag < least:
        raise ConfigError(
            f"Adaptive.lag: must be >= {least} with this loader (prefetch_factor x num_workers batches in flight, the "
            f"device feed's and the rank sync's look-ahead, plus one), got {adaptive.lag}"
        )
    reduce = None
    if mixture.world_size > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"schedule Adaptive: {mixture.world_size} ranks need torch.distributed initialized, so that every rank "
                "adapts to the same all-reduced losses"
            )
        reduce = _all_reduce(group if group is not None else dist.group.WORLD, float(timeout))
    lag = least if adaptive.lag is None else int(adaptive.lag)
    return Feedback(mixture, adaptive, lag=lag, readers=max(num_workers, 1), reduce=reduce)
