"""The formatter owns the layout of every Python file: ``ruff format --check`` (run by ``make test``)
proves it only where no ``fmt: skip`` / ``fmt: off`` comment opts a line or a block out of it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def opted_out(files: list[Path], root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OPT_OUT.search(line)
    ]


def test_no_python_file_opts_out_of_the_formatter():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    files = [REPO / name for name in listed.stdout.split()]
    assert len(files) > 100  # the whole repository, not an empty listing
    assert opted_out(files, REPO) == []


def test_the_check_finds_both_kinds_of_opt_out(tmp_path):
    sample = tmp_path / "sample.py"
    fmt = "# fmt" + ":"  # spelled apart, so that this file does not opt out itself
    sample.write_text(f"x = [1,2]  {fmt} skip\n{fmt} off\ny = 1\n{fmt} on\n", encoding="utf-8")
    assert [line.split(": ", 1)[0] for line in opted_out([sample], tmp_path)] == ["sample.py:1", "sample.py:2"]
