"""The shuffle buffers' draws: PCG64 in blocks, whose whole state is the number of draws taken."""

import json

import numpy as np
import pytest

from mixer.errors import StateError
from mixer.plan.world import Draws, seed_for


@pytest.mark.parametrize(
    "cut", [0, 1, 100, Draws.BLOCK - 1, Draws.BLOCK, Draws.BLOCK + 3, 5 * Draws.BLOCK, 1000 * Draws.BLOCK + 17]
)
def test_a_restored_draws_continues_exactly(cut):
    first = Draws(7, "shuffle", "web", 0)
    head = [first.random() for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"taken": cut}
    tail = [first.random() for _ in range(600)]
    other = Draws(7, "shuffle", "web", 0)  # a resumed reader builds its Draws from the same parts
    other.random()  # and whatever it drew before the restore does not matter
    other.load_state_dict(state)
    assert [other.random() for _ in range(600)] == tail
    assert len(head) == cut


def test_the_state_belongs_to_its_seed():
    a, b = Draws(7, "shuffle", "web", 0), Draws(7, "shuffle", "web", 1)
    a.seek(300)
    b.seek(300)
    assert [a.random() for _ in range(5)] != [b.random() for _ in range(5)]


def test_draws_are_the_pcg64_stream_of_the_seed():
    draws = Draws(1, "x")
    expected = np.random.Generator(np.random.PCG64(seed_for(1, "x"))).random(3 * Draws.BLOCK)
    assert [draws.random() for _ in range(3 * Draws.BLOCK)] == expected.tolist()
    # seek() jumps with PCG64.advance: the same numbers as drawing through
    draws.seek(2 * Draws.BLOCK + 5)
    assert draws.random() == expected[2 * Draws.BLOCK + 5]


def test_a_foreign_state_is_refused():
    with pytest.raises(StateError, match="draws state: unknown key 'pos'"):
        Draws(1).load_state_dict({"pos": 3})
    with pytest.raises(StateError, match="draws state: missing key .taken."):
        Draws(1).load_state_dict({})
    with pytest.raises(StateError, match="'taken' must be an integer >= 0"):
        Draws(1).load_state_dict({"taken": -1})
