"""Warnings point at the user's line, not at a line of the library: in the constructor that profiles
a source, in the loop over a loader reading in-process, and in a forked DataLoader worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from shardutil import npy_bytes, write_tar_members

import mixer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def bad_shards(tmp_path):
    """Shard 0 holds a sample without tokens between two good ones, shard 1 is good, shard 2 is not a
    tar at all (three shards: the up-front profile reads all of them)."""
    good = npy_bytes(np.arange(1, 6, dtype=np.int32))
    write_tar_members(tmp_path / "bad-000000.tar", [("a.tokens.npy", good), ("b.json", b"{}"), ("c.tokens.npy", good)])
    write_tar_members(tmp_path / "bad-000001.tar", [("d.tokens.npy", good)])
    (tmp_path / "bad-000002.tar").write_bytes(b"x" * 1024)
    return str(tmp_path / "bad-{000000..000002}.tar")


def test_warnings_name_the_callers_line(bad_shards):
    source = mixer.Source("bad", bad_shards, on_error="skip")
    with pytest.warns(RuntimeWarning, match="profiling skips shard") as profiled:
        line = sys._getframe().f_lineno + 1  # the next line builds the mixture
        mix = mixer.Mixture([source], batching=mixer.TokenBudget(max_tokens=64), stop="all_exhausted")
    # Profiling judges samples as readers do: it warns about the bad sample of shard 0 too.
    messages = sorted(str(w.message) for w in profiled)
    assert len(messages) == 2 and "profiling skips shard" in messages[0] and "skipping bad sample" in messages[1], (
        messages
    )
    assert {(w.filename, w.lineno) for w in profiled} == {(__file__, line)}

    loader = mixer.make_loader(mix)
    with pytest.warns(RuntimeWarning) as streamed:
        line = sys._getframe().f_lineno + 1  # the next line iterates the loader
        keys = sorted(key for batch in loader for key in batch.keys)
    assert keys == ["a", "c", "d"]
    messages = [str(w.message) for w in streamed]
    assert any("skipping bad sample" in m for m in messages) and len(messages) == 2, messages
    assert {(w.filename, w.lineno) for w in streamed} == {(__file__, line)}


@pytest.mark.slow
def test_a_worker_process_warning_names_the_users_line_too(bad_shards, tmp_path):
    # A forked worker's stack still holds the parent's frames down to the user's loop; the warning
    # printed by the worker shows that line, and no line of the library (nor of torch).
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import warnings
        import mixer

        warnings.simplefilter("ignore", RuntimeWarning)  # the profiling skip: not what is tested here
        mix = mixer.Mixture([mixer.Source("bad", {bad_shards!r}, on_error="skip")],
                            batching=mixer.TokenBudget(max_tokens=64), stop="all_exhausted")
        warnings.simplefilter("default", RuntimeWarning)
        loader = mixer.make_loader(mix, num_workers=1, multiprocessing_context="fork")
        for batch in loader:
            pass
    """).lstrip()
    )
    line = script.read_text().splitlines().index("for batch in loader:") + 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"{script}:{line}: RuntimeWarning: source 'bad':" in proc.stderr, proc.stderr
    assert "skipping bad sample" in proc.stderr
    assert f"{os.sep}mixer{os.sep}" not in proc.stderr and f"{os.sep}torch{os.sep}" not in proc.stderr, proc.stderr
