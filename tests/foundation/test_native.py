"""The one switch for the compiled cores (``MIXER_NATIVE=0``): the pure-Python path imports, streams
and gives the very batches the compiled cores give, in a fresh interpreter as a no-compiler install
would run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from shardutil import LogNormal

import mixer
from mixer import _native

REPO = Path(__file__).resolve().parents[2]
RUN = """
import hashlib, json, sys
import mixer, mixer._native
patterns = json.loads(sys.argv[1])
mix = mixer.Mixture([mixer.Source(n, p) for n, p in patterns.items()], batching=mixer.TokenBudget(max_tokens=2048),
                    stop="all_exhausted", shuffle_buffer=32, state_every=4)
h = hashlib.sha256()
count = 0
for workers in (0, 2):
    for b in mixer.make_loader(mix, num_workers=workers):
        h.update(repr(b.keys).encode()); h.update(b.buffer.numpy().tobytes()); count += 1
print(json.dumps({"cores": mixer._native.cores(), "digest": h.hexdigest(), "batches": count, "file": mixer.__file__}))
"""


def _run(patterns: dict[str, str], native: bool, path: Path = REPO) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(path), MIXER_NATIVE="1" if native else "0")
    proc = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(patterns)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=path,  # not the repository: `import mixer` must find the tree at `path`
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_pure_python_path_gives_the_same_batches(make_sources):
    sources = make_sources(
        {
            "web": LogNormal(shards=4, samples=300, median=120, sigma=0.8, lo=2, hi=2048, seed=40),
            "code": LogNormal(shards=2, samples=80, median=400, sigma=1.0, lo=2, hi=2048, seed=41),
        }
    )
    patterns = {name: pattern for name, (pattern, _) in sources.items()}
    python = _run(patterns, native=False)
    assert python["cores"] == {"tarwalk": False, "rows": False, "loops": False}
    assert python["batches"] > 20
    if not any(_native.cores().values()):
        pytest.skip("the compiled cores were not built here: nothing to compare the pure-Python path with")
    compiled = _run(patterns, native=True)
    assert compiled["cores"] == {"tarwalk": True, "rows": True, "loops": True}
    assert python["digest"] == compiled["digest"] and python["batches"] == compiled["batches"]


@pytest.mark.slow
def test_a_wheel_built_without_a_compiler_installs_imports_and_streams(make_sources, tmp_path):
    # CC=/bin/false makes every compiled core fail to build, as on a machine with no C compiler
    env = dict(os.environ, CC="/bin/false", CXX="/bin/false")
    tree = tmp_path / "tree"  # a clean copy of the sources: no build/ left by earlier, compiled builds
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    for name in tracked.split():
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "wheel"), str(tree)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    assert "compiled cores" in build.stderr and "were NOT built" in build.stderr  # said loudly, not one log line
    (wheel,) = (tmp_path / "wheel").glob("wds_mixer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert not [name for name in archive.namelist() if name.endswith(".so")]
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    sources = make_sources({"web": LogNormal(shards=2, samples=120, median=100, sigma=0.8, lo=2, hi=1024, seed=42)})
    patterns = {name: pattern for name, (pattern, _) in sources.items()}
    installed = _run(patterns, native=True, path=target)  # the switch on: nothing compiled to load
    assert Path(str(installed["file"])).is_relative_to(target)
    assert installed["cores"] == {"tarwalk": False, "rows": False, "loops": False}
    assert installed["digest"] == _run(patterns, native=False)["digest"]  # the source tree's pure-Python path
    version = subprocess.run(
        [sys.executable, "-m", "mixer.cli", "--version"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(target)),
        cwd=target,
        timeout=120,
    )
    assert "compiled cores active: none" in version.stdout, version.stdout + version.stderr


def test_every_native_flag_follows_the_one_switch():
    # each hot path's own flag (the tests' per-process toggle) starts from what mixer._native loaded
    from mixer.batching import batchers, collate
    from mixer.mixing import selector
    from mixer.plan import world
    from mixer.read import decode, tario

    loaded = _native.cores()
    assert tario.NATIVE == decode.NATIVE == loaded["tarwalk"]
    assert collate.NATIVE == loaded["rows"]
    assert selector.NATIVE == world.NATIVE == batchers.NATIVE == loaded["loops"]
    assert mixer.__name__ == "mixer"
