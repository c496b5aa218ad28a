"""``MixerService``: the reader actors of a mixture on a Ray cluster, for a world of trainers.

A service of ``world_size`` trainers with ``readers_per_trainer`` readers each runs one Ray actor
(:class:`mixer.service.reader_actor.ReaderActor`) per reader: reader ``j`` of trainer ``r`` is the
reader that DataLoader worker ``j`` of rank ``r`` would run (``readers_per_trainer=0``: one reader
per trainer, the reader of ``make_loader(num_workers=0)``), named ``<name>/<r>/<j>`` in the Ray
namespace ``namespace``, placed by Ray wherever ``reader_options`` (Ray's actor options:
``num_cpus``, ``resources``, ``scheduling_strategy``, ...) allow, e.g. on CPU-only nodes. Ray
restarts a reader whose process or node died (``max_restarts=-1`` unless ``reader_options`` say
otherwise), and its trainer starts it again from the state it acknowledged
(:mod:`mixer.service.stream`).

The service holds no state to checkpoint: every position lives in the trainers' loader states
(:func:`mixer.service.make_remote_loader`), in the format of an in-process loader's. The actors
belong to the process that made the service (Ray ends them with it); trainers in other processes
find them by name with :meth:`MixerService.connect`.
"""

from __future__ import annotations

import copy
import pickle
import time
import uuid
from typing import Any

from mixer.errors import ConfigError, MixerError
from mixer.mixing.mixture import Mixture
from mixer.service.connection import NAMESPACE, connected, count, positive_seconds, reader_name
from mixer.service.reader_actor import ReaderActor

#: Seconds a service waits for its readers to start (placed, constructed) before it gives up.
DEFAULT_START_TIMEOUT = 300.0

_actor_class: Any = None


def _remote_class() -> Any:
    global _actor_class
    if _actor_class is None:
        _actor_class = connected().remote(ReaderActor)
    return _actor_class


class MixerService:
    """The reader actors of ``mixture`` for ``world_size`` trainers (default: the mixture's), each
    with ``readers_per_trainer`` readers (see the module docstring). Needs a process connected to a
    Ray cluster (``ray.init(address=...)``). ``name``: the service's name in Ray (default: a fresh
    one); ``namespace``: the Ray namespace of its actors' names (``"mixer"``); ``reader_options``:
    Ray actor options for every reader (default ``{"num_cpus": 1}``). Building it starts every
    reader and waits until each answers, at most ``start_timeout`` seconds, then raises
    :class:`~mixer.MixerError` naming those that did not. ``close()`` (or leaving a ``with`` block)
    ends the actors."""

    def __init__(
        self,
        mixture: Mixture,
        *,
        world_size: int | None = None,
        readers_per_trainer: int = 1,
        name: str | None = None,
        namespace: str = NAMESPACE,
        reader_options: dict[str, Any] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        ray = connected()
        if not isinstance(mixture, Mixture):
            raise ConfigError(f"MixerService: expected a mixer.Mixture (got {type(mixture).__name__})")
        world = mixture.world_size if world_size is None else count(world_size, "MixerService.world_size", least=1)
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ConfigError(f"MixerService.name must be a non-empty string without '/' (got {name!r})")
        self.name = name or f"mixer-{uuid.uuid4().hex[:12]}"
        self.namespace = namespace
        self.world_size = world
        self.readers_per_trainer = count(readers_per_trainer, "MixerService.readers_per_trainer", least=0)
        self.reader_options = {"num_cpus": 1, **(reader_options or {})}
        self._blob = ray.cloudpickle.dumps(mixture)
        self._mixture: Mixture | None = mixture
        self._handles: dict[tuple[int, int], Any] = {}
        timeout = positive_seconds(start_timeout, "MixerService.start_timeout")
        places = [(r, j) for r in range(world) for j in range(max(self.readers_per_trainer, 1))]
        try:
            for r, j in places:
                self._handles[r, j] = self._create(r, j)
            self._wait_started(places, timeout)
        except BaseException:
            for handle in self._handles.values():  # only what this call made: never another service's
                ray.kill(handle, no_restart=True)
            self._handles.clear()
            raise

    # ---- finding a service ------------------------------------------------------------------

    @classmethod
    def connect(cls, name: str, *, namespace: str = NAMESPACE, timeout: float = 60.0) -> MixerService:
        """The service called ``name``, made by another process of this Ray cluster (a trainer
        started apart from it, or restarted). Raises :class:`~mixer.MixerError` when there is no
        such service or its first reader does not answer within ``timeout`` seconds."""
        ray = connected()
        timeout = positive_seconds(timeout, "MixerService.connect timeout")
        try:
            first = ray.get_actor(reader_name(name, 0, 0), namespace=namespace)
        except ValueError:
            raise MixerError(f"no mixer service {name!r} in Ray namespace {namespace!r} of this cluster") from None
        try:
            blob, shape = ray.get(first.service.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise MixerError(f"mixer service {name!r}: its reader 0 did not answer within {timeout:g} s") from None
        self = cls.__new__(cls)
        self.name, self.namespace = name, namespace
        self.world_size, self.readers_per_trainer = int(shape["world_size"]), int(shape["readers_per_trainer"])
        self.reader_options = dict(shape["reader_options"])
        self._blob, self._mixture, self._handles = blob, None, {(0, 0): first}
        return self

    @property
    def mixture(self) -> Mixture:
        """The service's mixture (as the process that made the service built it)."""
        if self._mixture is None:
            self._mixture = pickle.loads(self._blob)
        return self._mixture

    def mixture_for(self, rank: int) -> Mixture:
        """The mixture as trainer ``rank`` of this service sees it (its rank and the service's world)."""
        mixture = copy.copy(self.mixture)
        mixture.rank, mixture.world_size = rank, self.world_size
        return mixture

    def handles(self, rank: int) -> list[Any]:
        """The Ray actor handles of trainer ``rank``'s readers, in reader order."""
        ray = connected()
        out = []
        for j in range(max(self.readers_per_trainer, 1)):
            if (rank, j) not in self._handles:
                try:
                    self._handles[rank, j] = ray.get_actor(reader_name(self.name, rank, j), namespace=self.namespace)
                except ValueError:
                    raise MixerError(
                        f"mixer service {self.name!r} has no reader {j} of trainer {rank} (closed, or resized by "
                        "another process?)"
                    ) from None
            out.append(self._handles[rank, j])
        return out

    def revive(self, rank: int, index: int, *, timeout: float) -> Any:
        """A live actor for reader ``index`` of trainer ``rank`` after Ray reported it dead for good:
        the one another process made under its name meanwhile, else a new one made here (once Ray
        has released the dead one's name), within ``timeout`` seconds."""
        ray = connected()
        self._handles.pop((rank, index), None)
        name = reader_name(self.name, rank, index)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
                ray.get(handle.describe.remote(), timeout=max(left, 1e-3))
                break
            except ValueError:  # no actor of that name: make one
                try:
                    handle = self._create(rank, index)
                    break
                except MixerError:  # the dead one still holds the name
                    pass
            except ray.exceptions.ActorDiedError:
                pass
            except ray.exceptions.GetTimeoutError:
                left = 0
            if left <= 0:
                raise MixerError(
                    f"mixer service {self.name!r}: no live reader {index} of trainer {rank} within {timeout:g} s"
                )
            time.sleep(0.1)
        self._handles[rank, index] = handle
        self._wait_started([(rank, index)], max(deadline - time.monotonic(), 1e-3))
        return handle

    # ---- the actors -------------------------------------------------------------------------

    def _shape(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "world_size": self.world_size,
            "readers_per_trainer": self.readers_per_trainer,
            "reader_options": self.reader_options,
        }

    def _create(self, rank: int, index: int) -> Any:
        options = {"max_restarts": -1, **self.reader_options}
        name = reader_name(self.name, rank, index)
        options.update(name=name, namespace=self.namespace)
        try:
            return _remote_class().options(**options).remote(self._blob, self._shape())
        except ValueError as exc:
            if "already" not in str(exc):
                raise
            raise MixerError(
                f"mixer service {self.name!r}: an actor named {name!r} already lives in Ray namespace "
                f"{self.namespace!r} (a service of that name runs: connect to it with MixerService.connect, or choose "
                "another name)"
            ) from exc

    def _wait_started(self, places: list[tuple[int, int]], timeout: float) -> None:
        ray = connected()
        pending = {self._handles[p].describe.remote(): p for p in places}
        ready, missing = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        for ref in ready:
            ray.get(ref)  # a reader whose construction failed raises its error here
        if missing:
            names = ", ".join(f"reader {j} of trainer {r}" for r, j in sorted(pending[m] for m in missing))
            raise MixerError(
                f"mixer service {self.name!r}: {names} did not start within {timeout:g} s: Ray could not place them "
                f"(reader_options {self.reader_options}: are there nodes with those resources?) or they cannot be "
                "reached"
            )

    def resize(self, readers_per_trainer: int, *, start_timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Change the number of readers per trainer (between passes, while no trainer iterates): new
        readers start, surplus ones end. The trainers' next loaders continue from their states
        through elastic resume (pass the list of the saved states, see :mod:`mixer.mixing.elastic`)."""
        ray = connected()
        new = count(readers_per_trainer, "MixerService.resize readers_per_trainer", least=0)
        old_n, new_n = max(self.readers_per_trainer, 1), max(new, 1)
        for r in range(self.world_size):
            for j in range(new_n, old_n):
                ray.kill(self.handles(r)[j], no_restart=True)
                self._handles.pop((r, j), None)
        self.readers_per_trainer = new
        added = [(r, j) for r in range(self.world_size) for j in range(old_n, new_n)]
        for r, j in added:
            self._handles[r, j] = self._create(r, j)
        self._wait_started(added, positive_seconds(start_timeout, "MixerService.resize start_timeout"))
        shape = self._shape()
        ray.get(
            [self.handles(r)[j].set_shape.remote(shape) for r in range(self.world_size) for j in range(new_n)],
            timeout=DEFAULT_START_TIMEOUT,
        )

    def close(self) -> None:
        """End every reader actor of the service (all trainers' readers)."""
        ray = connected()
        for r in range(self.world_size):
            for j in range(max(self.readers_per_trainer, 1)):
                handle = self._handles.pop((r, j), None)
                if handle is None:
                    try:
                        handle = ray.get_actor(reader_name(self.name, r, j), namespace=self.namespace)
                    except ValueError:
                        continue
                ray.kill(handle, no_restart=True)

    def __enter__(self) -> MixerService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"MixerService({self.name!r}, world_size={self.world_size}, readers_per_trainer={self.readers_per_trainer})"
        )
