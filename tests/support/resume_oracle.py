"""The one resume oracle every stateful part is tested with.

Run the uninterrupted stream once as the reference; then run it again, saving its state at every cut
point as a training loop does (that run must still hand out the reference's items); push each state
through JSON (it must be plain data), scramble the global RNGs (a resumed run must not depend on
them), load it into a fresh object, and check that what follows equals the reference from the cut
on, item for item. (Or, with ``saved="a run per cut"``, each state from its own run stopped at the
cut.)

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
    saved: str = "in one pass",
) -> list[Any]:
    """Returns the reference (viewed items), so a caller can reuse it. ``tail > 0``: the stream must
    end; it is also cut at each of its last ``tail`` items and after its last one, and every resumed
    run is followed to the end.

    ``saved``: where the states come from. ``"in one pass"`` (the default): all of them are taken
    during a single uninterrupted run, as a training loop checkpoints and goes on, and that run must
    hand out the same items as a pass where nothing is saved (``reference``, given or run here), so
    a save that disturbs the stream fails too. ``"a run per cut"``: each state from a fresh object
    run to its cut and stopped there, the way a job saves and exits (a run up to each cut: for the
    tail of a whole pass that is quadratic, so it is kept for the few tests that need it)."""
    if saved not in ("in one pass", "a run per cut"):
        raise ValueError(f"saved={saved!r}: 'in one pass' or 'a run per cut'")
    length = None if tail else max(cuts) + window
    if reference is None:
        reference = [view(x) for x in (make() if length is None else take(make(), length))]
    if tail:
        n = len(reference)
        cuts = sorted(set(cuts) | set(range(max(0, n - tail), n + 1)))
        window = max(window, tail + 1)
    states = _states_in_one_pass(make, cuts, save, view, reference, length) if saved == "in one pass" else None
    for k, cut in enumerate(cuts):
        state = states[cut] if states is not None else _state_of_a_run_to(make(), cut, save)
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


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """The state as it comes back from a checkpoint file: it must be plain JSON data."""
    return json.loads(json.dumps(state))


def _state_of_a_run_to(obj: Any, cut: int, save: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    it = iter(obj)
    for _ in range(cut):
        next(it)
    state = _plain(save(obj))
    del it
    return state


def save_along_one_run(
    obj: Any,
    counts: Iterable[int],
    save: Callable[[Any], dict[str, Any]] = lambda obj: obj.state_dict(),
    *,
    view: Callable[[Any], Any] = lambda item: item,
    until: int | None = None,
) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """Iterate ``obj`` once, as a training loop that checkpoints and goes on: its state (as plain
    data) after each of ``counts`` items, taken before it asks for the next (so the state after the
    last item is the one from before the end is seen). Stops after ``until`` items (None: at the
    end of the stream). Returns the items (viewed) and ``{count: state}``; a count past the end of
    the stream has no state."""
    wanted = set(counts)
    items: list[Any] = []
    states = {0: _plain(save(obj))} if 0 in wanted else {}
    if until == 0:  # (no iterator: a loader's would start its workers for nothing)
        return items, states
    it = iter(obj)
    while until is None or len(items) < until:
        try:
            item = next(it)
        except StopIteration:
            break
        items.append(view(item))
        if len(items) in wanted:
            states[len(items)] = _plain(save(obj))
    del it
    return items, states


def _states_in_one_pass(
    make: Callable[[], Any],
    cuts: Sequence[int],
    save: Callable[[Any], dict[str, Any]],
    view: Callable[[Any], Any],
    reference: list[Any],
    length: int | None,
) -> dict[int, dict[str, Any]]:
    """``{cut: state}`` from one run (:func:`save_along_one_run`) to ``length`` items (None: to its
    end), which must hand out the reference's items."""
    items, states = save_along_one_run(make(), cuts, save, view=view, until=length)
    expected = len(reference) if length is None else min(length, len(reference))
    assert len(items) == expected, (
        f"a run that saves its state at the cuts handed out {len(items)} items, not {expected}"
    )
    for i, (a, b) in enumerate(zip(reference, items)):
        assert _equal(a, b), f"a run that saves its state at the cuts differs from one that does not, at item {i}"
    missing = sorted(set(cuts) - set(states))
    assert not missing, f"the stream ended after {len(items)} items, before the cuts {missing}"
    return states


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def batch_view(batch: Any) -> tuple[Any, ...]:
    """What must be identical: keys, sources and every tensor."""
    return (tuple(batch.keys), batch.source.clone(), batch.lengths.clone(), batch.tokens.clone(), batch.meta.step)
