"""The speech decode (mixer.read.audio): real FLAC and WAV written with soundfile, transcripts, sample
rates, duration filters, and what happens without soundfile."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from shardutil import npy_bytes, write_samples
from speech import encode, pcm, speech_sample, text_tokens

import mixer
import mixer.read.audio
from mixer.read.audio import SpeechDecode

pytest.importorskip("soundfile")


def raw(sample: dict) -> dict:
    """A sample as the tar reader hands it to decode (bytes members)."""
    out = {k: (npy_bytes(v) if k.endswith(".npy") else v) for k, v in sample.items()}
    out.setdefault("__url__", "mem://shard.tar")
    return out


@pytest.mark.parametrize("fmt", ["flac", "wav"])
def test_real_flac_and_wav_decode_to_the_written_samples(fmt):
    key = "utt-1"
    x = pcm(key, 12345)
    sample = {"__key__": key, "__url__": "u", fmt: encode(x, fmt.upper()), "tokens.npy": npy_bytes(text_tokens(key, 9))}
    got = SpeechDecode()(sample)
    assert list(got) == ["audio", "text"]  # audio first: it is what a sample's length counts by default
    assert got["audio"].dtype == np.float32 and np.array_equal(got["audio"], x.astype(np.float32) / 32768)
    assert np.array_equal(got["text"], text_tokens(key, 9))
    as_int = SpeechDecode(dtype="int16")(sample)["audio"]
    assert as_int.dtype == np.int16 and np.array_equal(as_int, x)


def test_flac_and_wav_of_the_same_audio_agree_and_flac_is_smaller():
    x = pcm("same", 40000)
    flac = SpeechDecode()({"__key__": "a", "flac": encode(x, "FLAC"), "txt": "hi"})
    wav = SpeechDecode()({"__key__": "a", "wav": encode(x, "WAV"), "txt": "hi"})
    assert np.array_equal(flac["audio"], wav["audio"])
    assert len(encode(x, "FLAC")) < len(encode(x, "WAV"))


def test_member_order_and_stereo_downmix():
    x = pcm("st", 1000, channels=2)
    sample = {"__key__": "st", "wav": encode(x, "WAV"), "flac": encode(x[:, 0], "FLAC"), "txt": "a"}
    # flac comes first in audio_members: the mono flac member is read
    assert np.array_equal(SpeechDecode()(sample)["audio"], x[:, 0].astype(np.float32) / 32768)
    stereo = SpeechDecode(audio_members=("wav",))(sample)["audio"]
    assert np.allclose(stereo, x.astype(np.float32).mean(axis=1) / 32768, atol=1e-7)


def test_transcripts_tokens_npy_first_then_txt_through_the_tokenizer():
    audio = encode(pcm("k", 100), "FLAC")
    both = {"__key__": "k", "flac": audio, "txt": b"ignored", "tokens.npy": npy_bytes(np.array([4, 5], dtype=np.int64))}
    assert SpeechDecode()(both)["text"].tolist() == [4, 5]
    words = {"__key__": "k", "flac": audio, "txt": b"hello wide world"}
    vocab = {"hello": 1, "wide": 2, "world": 3}
    assert SpeechDecode(tokenizer=lambda s: [vocab[w] for w in s.split()])(words)["text"].tolist() == [1, 2, 3]
    assert SpeechDecode()(words)["text"].tolist() == list(b"hello wide world")  # default: UTF-8 bytes


@pytest.mark.parametrize(
    "sample, match",
    [
        (
            {"__key__": "k", "txt": "x"},
            r"key 'k': no audio member: expected one of \['flac', 'wav'\] \(members: \['txt'\]\)",
        ),
        ({"__key__": "k", "flac": b"not audio at all", "txt": "x"}, r"key 'k': cannot decode audio member 'flac'"),
        (
            {"__key__": "k", "flac": encode(pcm("k", 10), "FLAC")},
            r"key 'k': no transcript: expected 'tokens.npy' or 'txt'",
        ),
        (
            {"__key__": "k", "flac": encode(pcm("k", 10), "FLAC"), "tokens.npy": npy_bytes(np.ones((2, 2), np.int32))},
            r"1-D integer",
        ),
    ],
)
def test_bad_samples_are_sample_errors_naming_the_key(sample, match):
    with pytest.raises(mixer.SampleError, match=match):
        SpeechDecode()(sample)


def test_a_mismatched_sample_rate_is_refused_unless_a_resampler_is_given():
    sample = {"__key__": "k", "__url__": "s.tar", "flac": encode(pcm("k", 2205), "FLAC", rate=22050), "txt": "x"}
    with pytest.raises(
        mixer.SampleError,
        match=r"s.tar, key 'k': audio member 'flac' is sampled at 22050 Hz, the decode expects 16000 Hz",
    ):
        SpeechDecode()(sample)
    calls = []

    def halve(audio, src, dst):
        calls.append((len(audio), src, dst))
        return audio[::2]

    got = SpeechDecode(resample=halve)(sample)["audio"]
    assert calls == [(2205, 22050, 16000)] and len(got) == 1103


def test_duration_filters_read_the_header_and_return_none():
    short = {"__key__": "s", "flac": encode(pcm("s", 1600), "FLAC"), "txt": "x"}  # 0.1 s
    long = {"__key__": "l", "flac": encode(pcm("l", 48000), "FLAC"), "txt": "x"}  # 3 s
    decode = SpeechDecode(min_seconds=0.5, max_seconds=2.0)
    assert decode(short) is None and decode(long) is None
    assert len(SpeechDecode(min_seconds=0.1, max_seconds=3.0)(short)["audio"]) == 1600  # bounds are inclusive


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sample_rate": 0}, "sample_rate must be a positive int"),
        ({"min_seconds": -1}, "min_seconds must be a number of seconds >= 0"),
        ({"min_seconds": 3, "max_seconds": 2}, "min_seconds=3 exceeds max_seconds=2"),
        ({"tokenizer": "bpe"}, "tokenizer must be callable"),
        ({"dtype": "uint8"}, "dtype must be one of"),
        ({"audio_members": "flac"}, "audio_members must be a non-empty tuple"),
    ],
)
def test_configuration_is_checked_at_the_door(kwargs, match):
    with pytest.raises(mixer.ConfigError, match=match):
        SpeechDecode(**kwargs)


def test_without_soundfile_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(mixer.read.audio, "_soundfile", None)
    monkeypatch.setitem(sys.modules, "soundfile", None)  # makes `import soundfile` raise ImportError
    with pytest.raises(mixer.ConfigError, match=r"pip install 'wds-mixer\[audio\]'"):
        SpeechDecode()


def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_repr_is_stable_across_processes_for_the_state_fingerprint():
    text = repr(SpeechDecode(tokenizer=tokenize, max_seconds=20.0))
    assert "0x" not in text and "test_audio.tokenize" in text and "max_seconds=20.0" in text


def test_bad_sample_rate_in_a_mixture_follows_on_error(tmp_path):
    good = [speech_sample(f"g{i}", 1600 + 100 * i) for i in range(6)]
    bad = [speech_sample(f"b{i}", 2205, rate=22050) for i in range(2)]
    pattern = write_samples(tmp_path, "mixed", [good[:3] + bad + good[3:]])
    fields = {"audio": mixer.Field("float32"), "text": mixer.Field("int32")}
    src = mixer.Source("s", pattern, decode=SpeechDecode(), on_error="skip")
    mix = mixer.Mixture([src], batching=mixer.TokenBudget(max_tokens=64000), fields=fields, stop="all_exhausted")
    with pytest.warns(RuntimeWarning, match="22050 Hz"):
        loader = mixer.make_loader(mix)
        keys = sorted(k for b in loader for k in b.keys)
    assert keys == sorted(s["__key__"] for s in good)
    assert loader.counters()["s"]["skipped_samples"] == 2
    strict = mixer.Source("s", pattern, decode=SpeechDecode())
    with pytest.raises(mixer.SampleError, match="22050 Hz"):
        mixer.Mixture([strict], batching=mixer.TokenBudget(max_tokens=64000), fields=fields)


@pytest.mark.slow
def test_the_asr_example_runs_and_reports_sample_shares(tmp_path):
    # examples/asr_mix.py mixes by utterances (unit="samples"): its table's realized column is
    # loader.stats()'s, a share of utterances, within a batch or so of NeMo's T=5 target.
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [
            sys.executable,
            str(repo / "examples" / "asr_mix.py"),
            "--workers",
            "0",
            "--batches",
            "40",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["read"], ["commands"])
    }
    assert set(rows) == {"read", "commands"}, proc.stdout
    # columns: source, utterances, size share, NeMo T=5, target, realized, audio s, dropped
    target = {name: float(r[4]) for name, r in rows.items()}
    realized = {name: float(r[5]) for name, r in rows.items()}
    assert target == {"read": float(rows["read"][3]), "commands": float(rows["commands"][3])}
    assert sum(realized.values()) == pytest.approx(1.0, abs=2e-3)
    assert all(abs(realized[n] - target[n]) < 0.02 for n in rows), proc.stdout
