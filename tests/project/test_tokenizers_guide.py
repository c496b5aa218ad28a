"""The tokenizers guide's code runs as written: its Python snippets, in order, in an empty directory."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tokenizers  # noqa: F401 (the 'text' extra; without it this module fails, it is not skipped)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "tokenizers.md"


def blocks(language: str) -> list[str]:
    """The page's fenced blocks of ``language`` ("" for those with none), in order."""
    out, open_as, lines = [], None, []
    for line in GUIDE.read_text(encoding="utf-8").splitlines():
        if open_as is None and (m := re.fullmatch(r"```(\S*)", line)):
            open_as, lines = m.group(1), []
        elif open_as is not None and line == "```":
            if open_as == language:
                out.append("\n".join(lines) + "\n")
            open_as = None
        elif open_as is not None:
            lines.append(line)
    return out


@pytest.mark.slow
def test_the_tokenizers_guide_runs_as_written(tmp_path, monkeypatch, capsys):
    from mixer.cli.commands import main

    code = blocks("python")
    assert len(code) == 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "guide"}
    for i, snippet in enumerate(code):
        exec(compile(snippet, f"{GUIDE.name}, snippet {i + 1}", "exec"), namespace)
    assert namespace["done"].written and (tmp_path / "tokens" / "web" / "mixer-index.json.gz").is_file()
    # the command line shown does what the function did: the same directory, found complete
    (command,) = [b for b in blocks("") if b.startswith("mixer pretokenize")]
    capsys.readouterr()
    assert main(shlex.split(command)[1:] + ["--quiet"]) == 0
    assert "(0 written now, 2 complete before)" in capsys.readouterr().out
