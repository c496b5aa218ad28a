"""Versioned, JSON-able loader state, and the mixture fingerprint it is checked against.

The state never holds configuration: the configuration appears only as a fingerprint, and loading a
state into a loader whose mixture (sources, shards, weights, seed, batching, schedule...) or
topology differs is refused with a clear error, never silently wrong.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .errors import StateError

if TYPE_CHECKING:
    from .mixture import Mixture

STATE_VERSION = 2  # 2: shuffle buffers draw from PCG64 (mixer.world.Draws), not random.Random
KIND = "mixer.Loader"


def fingerprint(mixture: Mixture) -> str:
    """A digest of everything that decides the stream's content and order."""
    described = {
        "sources": [
            {
                "name": s.name,
                "shards": list(listed.shards),
                "weight": s.weight,
                "on_error": s.on_error,
                "decode": _qualname(s.decode),
                "length": _qualname(s.length),
                "group": s.group,
            }
            for s, listed in zip(mixture.sources, mixture.listed)
        ],
        "sizes": [round(float(x), 6) for x in mixture.info.sizes],
        "edges": mixture.edges,
        "batching": repr(mixture.batching),
        "schedule": repr(mixture.schedule),
        "selector": mixture.selector,
        "unit": mixture.unit,
        "mix": mixture.mix,
        "stop": mixture.stop,
        "seed": mixture.seed,
        "shuffle_buffer": mixture.shuffle_buffer,
        "pad_id": mixture.pad_id,
        "dtype": mixture.dtype,
        "state_every": mixture.state_every,
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _qualname(fn: Any) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check(state: Any, mixture: Mixture, *, num_workers: int) -> dict[str, Any]:
    """Validate a loader state against this mixture and topology; returns it."""
    if not isinstance(state, dict) or state.get("kind") != KIND:
        raise StateError(f"not a mixer loader state (expected a dict with kind={KIND!r})")
    version = state.get("version")
    if version != STATE_VERSION:
        raise StateError(f"loader state version {version!r} is not supported by this mixer (state version {STATE_VERSION})")
    if state["fingerprint"] != fingerprint(mixture):
        raise StateError(
            "loader state was saved from a different mixture (sources, shards, weights, seed, batching, schedule or "
            "other options differ); resume with the same configuration"
        )
    readers = max(num_workers, 1)
    saved = (state["rank"], state["world_size"], state["num_workers"])
    if saved != (mixture.rank, mixture.world_size, readers):
        raise StateError(
            f"loader state was saved with rank {saved[0]} of {saved[1]} and {saved[2]} reader(s) per rank; this loader "
            f"is rank {mixture.rank} of {mixture.world_size} with {readers}: resuming with a different num_workers or "
            "world_size is not supported (it would repeat or lose samples of the current source-epochs)"
        )
    return state


def size_bytes(state: dict[str, Any]) -> int:
    """The state's size as compact JSON."""
    return len(json.dumps(state, separators=(",", ":")))
