"""The shuffle buffers' draws: PCG64 in blocks, with a state of a few bytes that resumes exactly."""

import json

import numpy as np
import pytest

from mixer.errors import StateError
from mixer.world import Draws, seed_for


@pytest.mark.parametrize("cut", [0, 1, 100, Draws.BLOCK - 1, Draws.BLOCK, Draws.BLOCK + 3, 5 * Draws.BLOCK])
def test_a_restored_draws_continues_exactly(cut):
    first = Draws(7, "shuffle", "web", 0)
    head = [first.random() for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))
    tail = [first.random() for _ in range(600)]
    other = Draws(99, "another", "seed", 3)  # restoring replaces whatever it was seeded with
    other.load_state_dict(state)
    assert [other.random() for _ in range(600)] == tail
    assert len(head) == cut and len(json.dumps(state)) < 200


def test_draws_are_the_pcg64_stream_of_the_seed():
    draws = Draws(1, "x")
    expected = np.random.Generator(np.random.PCG64(seed_for(1, "x"))).random(3 * Draws.BLOCK)
    assert [draws.random() for _ in range(3 * Draws.BLOCK)] == expected.tolist()


def test_a_foreign_state_is_refused():
    with pytest.raises(StateError, match="draws state: missing key 'block_start'"):
        Draws(1).load_state_dict({"pos": 3})
