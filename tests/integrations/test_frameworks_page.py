"""The code of docs/guides/frameworks.md runs: its own snippets here, the examples it includes in
tests/test_lightning.py and tests/test_accelerate.py (the include markers must stand in them)."""

from __future__ import annotations

import re
from pathlib import Path

import shardutil
import torch
from resume_oracle import batch_view, take
from shardutil import RESUME_SOURCES

import mixer

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "guides" / "frameworks.md").read_text(encoding="utf-8")


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE, flags=re.DOTALL)


def test_the_page_includes_the_examples_between_markers_that_stand_in_them():
    includes = re.findall(
        r"```\{literalinclude\} \.\./\.\./(\S+)\n(?::[^\n]*\n)*?:start-after: (\S+)\n:end-before: (\S+)\n", PAGE
    )
    assert sorted(path for path, _, _ in includes) == ["examples/accelerate_train.py", "examples/lightning_train.py"]
    for path, start, end in includes:
        text = (REPO / path).read_text(encoding="utf-8")
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end), path


def test_the_fetch_ahead_snippet_saves_the_state_of_the_last_batch_trained(make_sources):
    mixture = shardutil.mixture(
        make_sources(RESUME_SOURCES),
        weights={"web": 0.5, "code": 0.3, "tiny": 0.2},
        batching=mixer.TokenBudget(max_tokens=2048),
        state_every=8,
    )
    trained: list[tuple] = []
    snippet = next(block for block in _python_blocks() if "state_dict(upto=" in block)
    namespace = {"mixer": mixer, "mixture": mixture, "train_step": lambda batch: trained.append(batch_view(batch))}
    exec(compile(snippet, "frameworks.md", "exec"), namespace)
    reference = [batch_view(b) for b in take(mixer.make_loader(mixture, num_workers=2), 16)]
    assert [view[0] for view in trained] == [view[0] for view in reference[:12]]
    resumed = mixer.make_loader(mixture, num_workers=2)
    resumed.load_state_dict(namespace["state"])  # saved at step 12 with three batches in flight
    following = [batch_view(b) for b in take(resumed, 4)]
    assert [v[0] for v in following] == [v[0] for v in reference[12:16]]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(following, reference[12:16]))


def test_the_hugging_face_snippet_is_python_at_least():
    """transformers is not installed here: the snippet is compiled, not run (the page says so)."""
    (snippet,) = [block for block in _python_blocks() if "transformers.Trainer" in block]
    compile(snippet, "frameworks.md", "exec")
    section = PAGE.split("## Hugging Face `Trainer`")[1].split("```python")[0]
    assert "Not tested here" in section
