"""The mixture's fingerprint: a digest of everything that decides the stream, checked on every resume."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mixer.mixing.options import OPTIONS, STREAM_OPTIONS
from mixer.mixing.schedule import describe_schedule

if TYPE_CHECKING:
    from mixer.mixing.mixture import Mixture
    from mixer.spec.budget import Field


def fingerprint(mixture: Mixture, fields: Mapping[str, Field] | None) -> str:
    """A digest of everything that decides the stream's content and order, composed of each
    configuration's own ``describe()``. Computed once per mixture (``Mixture.fingerprint``)."""
    described = {
        "sources": [listed.describe() for listed in mixture.listed],
        "sizes": [round(float(x), 6) for x in mixture.info.sizes],
        "edges": mixture.edges,
        "batching": mixture.batching.describe(),
        "fields": None if fields is None else {name: f.describe() for name, f in fields.items()},
        "schedule": describe_schedule(mixture.schedule),
        **{
            name: OPTIONS[name].describe(getattr(mixture, name)) for name in STREAM_OPTIONS
        },  # the options that decide the stream
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
