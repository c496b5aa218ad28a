"""The code a newcomer copies runs as written: the README's Quick start, every Python block of the
getting-started and write-your-shards pages (in order, in one fresh folder, as a reader would run
them), the commands the getting-started page gives, and the `stats()` layout the observing guide
shows is the real one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mixer
from mixer.cli import main

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(path: Path, language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(path.read_text(encoding="utf-8")) if lang == language]


def run_blocks(codes: list[str], where: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    for n, code in enumerate(codes):
        exec(compile(code, f"{where} block {n + 1}", "exec"), namespace)  # noqa: S102 (the docs' own code)
    return namespace


def quick_start(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    section = text[text.index("## Quick start") :]
    return BLOCK.search(section).group(2)  # type: ignore[union-attr]


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_blocks([quick_start(REPO / "README.md")], "README.md")
    out = capsys.readouterr().out
    for name in ("web", "code", "books"):
        assert re.search(rf"^{name}: target 0\.\d+ realized 0\.\d+$", out, re.MULTILINE), out
    assert float(re.search(r"padding efficiency (\S+)", out).group(1)) > 0.9  # type: ignore[union-attr]


@pytest.mark.slow
def test_getting_started_runs_as_written(tmp_path, monkeypatch, capsys):
    page = REPO / "docs" / "getting-started.md"
    assert quick_start(page) == quick_start(REPO / "README.md")  # one Quick start, not two that drift
    monkeypatch.chdir(tmp_path)
    (config,) = blocks(page, "yaml")
    Path("mix.yaml").write_text(config)
    namespace = run_blocks(blocks(page, "python"), "getting-started.md")
    assert isinstance(namespace["mix"], mixer.Mixture) and [s.name for s in namespace["mix"].sources] == [
        "web",
        "code",
        "books",
    ]
    for command in (line.split("#")[0].split() for code in blocks(page, "bash") for line in code.splitlines()):
        if command[:1] == ["mixer"] and command[1] in ("plan", "run"):
            assert main(command[1:]) == 0, command
    assert "realized" in capsys.readouterr().out


@pytest.mark.slow
def test_write_your_shards_runs_as_written(tmp_path, monkeypatch, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.chdir(tmp_path)
    # the page loads "tokenizer.json": a small BPE trained here, offline
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(["some text to train on, document by document"] * 50, trainer)
    tokenizer.save("tokenizer.json")
    run_blocks(blocks(REPO / "docs" / "guides" / "write-shards.md", "python"), "write-shards.md")
    out = capsys.readouterr().out
    assert re.search(r"^3100 samples; 0 skipped in web$", out, re.MULTILINE), out
    assert re.search(r"^torch\.Size\(\[\d+, \d+, 80\]\) \[\d+(, \d+)*\]$", out, re.MULTILINE), out


def test_the_observing_guide_shows_the_real_stats_layout(tmp_path):
    from shardutil import LogNormal, write_sources

    sources = write_sources(tmp_path, {"web": LogNormal(shards=2, samples=60, median=50, sigma=0.5, seed=1)})
    mix = mixer.Mixture(
        [mixer.Source(n, p) for n, (p, _) in sources.items()], batching=mixer.TokenBudget(max_tokens=1024)
    )
    loader = mixer.make_loader(mix)
    for step, _ in enumerate(loader):
        if step == 5:
            break
    stats = loader.stats()
    page = (REPO / "docs" / "guides" / "observing.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (.+?) \| ((?:`\w+` ?)+) \|$", page, re.MULTILINE))
    documented = {key: re.findall(r"`(\w+)`", value) for key, value in rows.items()}
    source = stats["sources"]["web"]
    assert documented == {
        "top level": list(stats),
        "`total`, `window`": list(stats["total"]),
        "`sources[name]`": list(source),
        '`sources[name]["total"]`, `["window"]`': list(source["total"]),
    }
    assert list(stats["window"]) == list(stats["total"]) and list(source["window"]) == list(source["total"])
