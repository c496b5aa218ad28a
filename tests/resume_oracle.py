"""The one resume oracle every stateful part is tested with.

Run the uninterrupted stream once as the reference; then for each cut point, run a fresh object to
the cut, save its state, push the state through JSON (it must be plain data), scramble the global
RNGs (a resumed run must not depend on them), load the state into another fresh object, and check
that what follows equals the reference from the cut on, item for item.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch


def take(it: Iterable[Any], n: int) -> list[Any]:
    """The first ``n`` items, without fetching an item more (a loader counts what it hands out)."""
    out: list[Any] = []
    if n <= 0:
        return out
    for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


def assert_resumes_exactly(
    make: Callable[[], Any],
    *,
    cuts: Sequence[int],
    window: int,
    save: Callable[[Any], dict[str, Any]] = lambda obj: obj.state_dict(),
    load: Callable[[Any, dict[str, Any]], None] = lambda obj, state: obj.load_state_dict(state),
    view: Callable[[Any], Any] = lambda item: item,
    reference: list[Any] | None = None,
) -> list[Any]:
    """Returns the reference (viewed items), so a caller can reuse it."""
    if reference is None:
        reference = [view(x) for x in take(make(), max(cuts) + window)]
    for k, cut in enumerate(cuts):
        obj = make()
        it = iter(obj)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(save(obj)))
        del it
        random.seed(1000 + k)
        np.random.seed(1000 + k)
        torch.manual_seed(1000 + k)
        resumed = make()
        load(resumed, state)
        got = [view(x) for x in take(resumed, len(reference) - cut if cut + window > len(reference) else window)]
        expected = reference[cut : cut + len(got)]
        assert len(got) == min(window, len(reference) - cut), f"cut {cut}: stream ended early"
        for i, (a, b) in enumerate(zip(expected, got)):
            assert _equal(a, b), f"resumed at batch {cut}: item {i} differs"
    return reference


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def batch_view(batch: Any) -> tuple[Any, ...]:
    """What must be identical: keys, sources and every tensor."""
    return (tuple(batch.keys), batch.source.clone(), batch.lengths.clone(), batch.tokens.clone(), batch.meta.step)
