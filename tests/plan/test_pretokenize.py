"""`mixer.pretokenize` / `mixer pretokenize`: raw text shards into tokens.npy shards and their index,
in parallel processes, resumable after an interruption. A BPE trained here (no download)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import textutil
import tokenizers  # noqa: F401 (the 'text' extra; without it this module fails, it is not skipped)
from textutil import EOS, expected, reassemble, write_text_shards

import mixer
from mixer.cli.commands import main as cli_main

REPO = Path(__file__).resolve().parents[2]
CHUNK = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("raw")
    docs = textutil.documents(240, median_words=30, sigma=0.6, seed=4, long_every=12)
    tok = textutil.train_tokenizer(docs)
    pattern, texts = write_text_shards(folder, "web", [docs[i * 30 : (i + 1) * 30] for i in range(8)])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return {"tok": tok, "eos": tok.token_to_id(EOS), "pattern": pattern, "texts": texts, "tokenizer": str(path)}


def read_back(folder: Path) -> dict[str, np.ndarray]:
    """Every sample of the token shards in ``folder``, through the default decode and their index."""
    source = mixer.Source("tok", str(folder) + "/", index=True)
    mix = mixer.Mixture([source], batching=mixer.TokenBudget(max_tokens=16384), stop="all_exhausted")
    assert mix.profiles[0].origin == "index"  # nothing read up front
    out = {}
    for b in mixer.make_loader(mix):
        for i, key in enumerate(b.keys):
            assert key not in out
            out[key] = b.tokens[i, : int(b.lengths[i])].numpy().astype(np.int64)
    return out


@pytest.mark.parametrize("max_length", [None, CHUNK])
def test_pretokenize_writes_token_shards_and_their_index(corpus, tmp_path, max_length):
    decode = mixer.TextDecode(corpus["tok"], eos=EOS)
    done = mixer.pretokenize(
        corpus["pattern"], tmp_path, decode=decode, max_length=max_length, workers=2, progress=False
    )
    names = [f"web-{i:06d}.tar" for i in range(8)]
    assert [Path(p).name for p in done.shards] == names and list(done.written) == list(done.shards)
    assert Path(done.index) == tmp_path / "mixer-index.json.gz"
    got = read_back(tmp_path)
    docs = reassemble(got)
    assert sorted(docs) == sorted(corpus["texts"])
    for key, text in corpus["texts"].items():
        assert np.array_equal(docs[key], expected(corpus["tok"], text, corpus["eos"])), key
    if max_length is None:
        assert done.samples == len(corpus["texts"]) and not any("#" in k for k in got)
    else:
        assert max(map(len, got.values())) == CHUNK and done.samples == len(got) > len(corpus["texts"])
    assert done.tokens == sum(map(len, got.values()))
    # run again: everything is complete, nothing is written
    again = mixer.pretokenize(corpus["pattern"], tmp_path, decode=decode, max_length=max_length, progress=False)
    assert again.written == () and again.shards == done.shards and again.tokens == done.tokens


def test_an_interrupted_pretokenize_continues_where_it_stopped(corpus, tmp_path):
    out, clean = tmp_path / "out", tmp_path / "clean"
    cmd = [sys.executable, "-m", "mixer.cli", "pretokenize", corpus["pattern"], "-o", str(out)]
    cmd += ["--tokenizer", corpus["tokenizer"], "--eos", EOS, "--max-length", str(CHUNK), "--workers", "1", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("web-*.tar")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-run: some shards complete, one perhaps half written
    finally:
        proc.wait()
    complete = sorted(p.name for p in out.glob("web-*.tar"))
    assert 1 <= len(complete) < 8, (complete, proc.stderr.read().decode() if proc.stderr else "")
    proc.stderr.close()  # type: ignore[union-attr]
    decode = mixer.TextDecode(corpus["tokenizer"], eos=EOS)
    done = mixer.pretokenize(corpus["pattern"], out, decode=decode, max_length=CHUNK, workers=2, progress=False)
    assert sorted(Path(p).name for p in done.written) == sorted(
        set(f"web-{i:06d}.tar" for i in range(8)) - set(complete)
    )
    assert list(out.glob(".*")) == []  # what the killed run was writing is gone
    mixer.pretokenize(corpus["pattern"], clean, decode=decode, max_length=CHUNK, workers=1, progress=False)
    for name in (f"web-{i:06d}.tar" for i in range(8)):  # byte for byte what an uninterrupted run writes
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert reassemble(read_back(out)).keys() == corpus["texts"].keys()


def test_a_directory_is_continued_only_with_what_it_was_made_with(corpus, tmp_path):
    decode = mixer.TextDecode(corpus["tok"], eos=EOS)
    first = corpus["pattern"].replace("{000000..000007}", "000000")
    mixer.pretokenize(first, tmp_path, decode=decode, progress=False)
    with pytest.raises(mixer.ConfigError, match="pretokenized with other max_length"):
        mixer.pretokenize(first, tmp_path, decode=decode, max_length=CHUNK, progress=False)
    with pytest.raises(mixer.ConfigError, match="pretokenized with other decode"):
        mixer.pretokenize(first, tmp_path, decode=mixer.TextDecode(corpus["tok"]), progress=False)
    with pytest.raises(mixer.ConfigError, match="shard patterns need decode=mixer.TextDecode"):
        mixer.pretokenize(first, tmp_path, progress=False)
    with pytest.raises(mixer.ConfigError, match="pretokenize.dtype"):
        mixer.pretokenize(first, tmp_path, decode=decode, dtype="float32", progress=False)  # type: ignore[arg-type]


def test_bad_samples_follow_the_sources_on_error(corpus, tmp_path):
    good = [{"__key__": f"ok-{i}", "json": b'{"text": "fine words"}'} for i in range(3)]
    pattern = textutil.write_samples(
        tmp_path / "in", "j", [[good[0], {"__key__": "broken-3", "json": b"{"}, *good[1:]]]
    )
    decode = mixer.TextDecode(corpus["tok"], field="json:text", eos=EOS)
    with pytest.raises(
        mixer.SampleError, match=r"source 'news': shard .*j-000000.tar, key 'broken-3': member 'json' is not valid JSON"
    ):
        mixer.pretokenize(mixer.Source("news", pattern, decode=decode), tmp_path / "a", progress=False)
    assert list((tmp_path / "a").glob("*.tar")) == [] and list((tmp_path / "a").glob(".*")) == []
    done = mixer.pretokenize(
        mixer.Source("news", pattern, decode=decode, on_error="skip"), tmp_path / "b", progress=False
    )
    assert done.skipped == 1 and done.samples == 3
    assert sorted(read_back(tmp_path / "b")) == ["ok-0", "ok-1", "ok-2"]


def test_the_command_line_pretokenizes_and_reports(corpus, tmp_path, capsys):
    first = corpus["pattern"].replace("{000000..000007}", "{000000..000001}")
    args = ["pretokenize", first, "-o", str(tmp_path), "--tokenizer", corpus["tokenizer"], "--eos", EOS, "--quiet"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 shards (2 written now, 0 complete before), 60 samples, ") and str(tmp_path) in out
    assert cli_main([*args, "--max-length", "7"]) == 2  # refused: made without a chunk length
    assert "pretokenized with other max_length" in capsys.readouterr().err
