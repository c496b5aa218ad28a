"""What a user installs: the sdist carries what the README, ``mixer run --help`` and the tests refer to,
and ``mixer info`` / ``mixer --version`` say which compiled cores are active."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mixer import _native
from mixer.cli import main
from mixer.cli.info import extras

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_sdist_carries_examples_benchmarks_docs_and_tests(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (sdist,) = tmp_path.glob("wds_mixer-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    tracked = subprocess.run(
        ["git", "ls-files", "examples", "benchmarks", "mixer", "docs"], capture_output=True, text=True, cwd=REPO
    ).stdout.split()
    assert tracked and not set(tracked) - names  # every tracked file of these folders
    assert {"Makefile", "constraints-dev.txt", "setup.py", "README.md"} <= names
    assert not [name for name in names if name.endswith((".so", ".pyc"))]


def test_version_says_which_cores_are_active(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("wds-mixer ")
    expected = "compiled cores active)" if all(_native.cores().values()) else "compiled cores"
    assert expected in out


def test_info_lists_every_core_and_extra(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name, on in _native.cores().items():
        assert f"  {name}: {'compiled' if on else 'pure Python'}" in out
    assert {"s3", "http", "zstd", "plot"} <= set(extras())
    for extra in extras():
        assert f"  {extra}: " in out
