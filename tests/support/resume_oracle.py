"""The one resume oracle every stateful part is tested with.

Run the uninterrupted stream once as the reference; then for each cut point, run a fresh object to
the cut, save its state, push the state through JSON (it must be plain data), scramble the global
RNGs (a resumed run must not depend on them), load the state into another fresh object, and check
that what follows equals the reference from the cut on, item for item.

A finite stream is also cut at every one of its last ``tail`` items (:func:`tail_cuts`): there readers
have ended at different points, and the order in which the rest continue is where resume went wrong
once (cuts only mid-pass did not see it).
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


def tail_cuts(num_workers: int) -> int:
    """How many of a finite pass's last batches the oracle cuts at: a few rounds of every reader."""
    return 3 * max(num_workers, 1) + 6


def assert_resumes_exactly(
    make: Callable[[], Any],
    *,
    cuts: Sequence[int],
    window: int,
    tail: int = 0,
    save: Callable[[Any], dict[str, Any]] = lambda obj: obj.state_dict(),
    load: Callable[[Any, dict[str, Any]], None] = lambda obj, state: obj.load_state_dict(state),
    view: Callable[[Any], Any] = lambda item: item,
    reference: list[Any] | None = None,
) -> list[Any]:
    """Returns the reference (viewed items), so a caller can reuse it. ``tail > 0``: the stream must
    end; it is also cut at each of its last ``tail`` items and after its last one, and every resumed
    run is followed to the end."""
    if reference is None:
        reference = [view(x) for x in (make() if tail else take(make(), max(cuts) + window))]
    if tail:
        n = len(reference)
        cuts = sorted(set(cuts) | set(range(max(0, n - tail), n + 1)))
        window = max(window, tail + 1)
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
        to_end = cut + window > len(reference)
        # a finite stream's resumed run is followed to its end: an item too many fails it too
        got = [
            view(x) for x in (resumed if tail and to_end else take(resumed, len(reference) - cut if to_end else window))
        ]
        expected = reference[cut : cut + len(got)]
        assert len(got) == min(window, len(reference) - cut), (
            f"cut {cut}: stream ended after {len(got)} items, expected {min(window, len(reference) - cut)}"
        )
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
