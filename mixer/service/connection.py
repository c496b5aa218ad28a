"""Ray, imported when a service is used, and the checks made before anything is sent to a cluster.

Ray is an optional dependency (the ``ray`` extra): importing :mod:`mixer.service` does not import
it, and the first use raises a :class:`~mixer.ConfigError` naming the extra when it is missing. A
service never starts Ray by itself: ``ray.init()`` without an address starts a local cluster whose
processes listen on every interface of the machine, which is the caller's decision to make (see the
"Mixing as a service" guide for a private network).
"""

from __future__ import annotations

from typing import Any

from mixer.errors import ConfigError

#: The Ray namespace the readers' names live in unless told otherwise, so that every process of a job
#: (the one that made the service, each trainer) finds them: a driver's default namespace is its own.
NAMESPACE = "mixer"


def ray_module() -> Any:
    """The ``ray`` module, or a clear error saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"mixer.service needs Ray ({exc}); install it with pip install 'wds-mixer[ray]'") from exc
    return ray


def connected() -> Any:
    """The ``ray`` module of a process connected to a cluster (``ray.init(...)`` was called)."""
    ray = ray_module()
    if not ray.is_initialized():
        raise ConfigError(
            "mixer.service: this process is not connected to a Ray cluster; call ray.init(address=...) first "
            "(mixer never starts Ray itself: a local ray.init() listens on every interface of the machine)"
        )
    return ray


def reader_name(service: str, rank: int, index: int) -> str:
    """The Ray name of reader ``index`` of trainer ``rank`` of a service."""
    return f"{service}/{rank}/{index}"


def positive_seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{what} must be a number of seconds > 0 and finite (got {value!r})")
    return float(value)


def count(value: Any, what: str, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{what} must be an int >= {least} (got {value!r})")
    return int(value)
