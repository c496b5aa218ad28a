"""Mix two speech corpora with temperature 5, as NeMo's ConcatDataset does, into audio-budget batches.

    python examples/asr_mix.py [--workers 2] [--batches 60] [--out DIR]

1. Synthesises two small corpora of real audio with their transcripts: ``read`` (many longer
   sentences) and ``commands`` (few short commands). With ``espeak-ng`` installed the audio is
   speech; without it, each character becomes a short tone whose pitch encodes the letter (a word
   gap is silence), so the audio still carries its transcript (the script decodes a batch back to
   text to show it). Shards are FLAC + ``txt`` samples written with ``webdataset.ShardWriter``.
2. Mixes them with ``mixer.Temperature(5.0)`` over the corpus sizes in utterances and
   ``unit="samples"``: NeMo's ``concat_sampling_technique: temperature`` with
   ``concat_sampling_temperature: 5`` (p_i ∝ n_i ** (1/5)), which lifts the small corpus from ~9% of
   the utterances to ~39%.
3. Batches are padded per field (``audio`` float32 ``[B, T]``, ``text`` int32 ``[B, S]``, with
   ``audio_lengths`` / ``text_lengths``), bucketed by audio length under a budget of audio samples
   per batch (fairseq2's ``max_num_elements``), with min/max duration filters.

Runs in well under 30 s on a laptop CPU.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import webdataset as wds

import mixer

sf = mixer.read.audio.soundfile()  # a clear error naming pip install 'wds-mixer[audio]' when it is missing

VOCAB = " abcdefghijklmnopqrstuvwxyz'"  # id 0 is the pad
WORDS = (
    "the a river light morning quiet garden stone window green small old paper voice bright over under "
    "before after slowly every evening north house water field winter summer music road little far"
).split()
COMMANDS = [
    "turn on the light",
    "stop",
    "play music",
    "next",
    "open the window",
    "volume up",
    "call home",
    "lights off",
]
TONE_SECONDS, GAP_SECONDS = 0.06, 0.04


def tokenize(text: str) -> list[int]:
    """Characters to ids 1..27 (what the example's model would predict)."""
    return [VOCAB.index(c) + 1 for c in text.lower() if c in VOCAB]


def detokenize(ids: np.ndarray) -> str:
    return "".join(VOCAB[i - 1] for i in ids if i > 0)


# ---- audio synthesis ---------------------------------------------------------------------------


def tone_frequency(ch: str) -> float:
    return 300.0 * 2 ** (VOCAB.index(ch) / 12)  # a semitone per letter, from 300 Hz


def tones(text: str, rate: int) -> np.ndarray:
    """One faded tone per character (a rest for a space): the transcript, audibly."""
    n, gap = int(TONE_SECONDS * rate), int(GAP_SECONDS * rate)
    t = np.arange(n) / rate
    fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
    parts = [np.zeros(gap)]
    for ch in text:
        parts.append(np.zeros(n) if ch == " " else 0.4 * np.sin(2 * np.pi * tone_frequency(ch) * t) * fade)
        parts.append(np.zeros(gap // 4))
    parts.append(np.zeros(gap))
    return np.concatenate(parts).astype(np.float32)


def tones_to_text(audio: np.ndarray, rate: int) -> str:
    """Reads tones() back: the strongest frequency of each tone slot (a check that it is no noise)."""
    n, step = int(TONE_SECONDS * rate), int(TONE_SECONDS * rate) + int(GAP_SECONDS * rate) // 4
    letters = {round(tone_frequency(c)): c for c in VOCAB[1:]}
    out, pos = [], int(GAP_SECONDS * rate)
    while pos + n <= len(audio) - int(GAP_SECONDS * rate):
        seg = audio[pos : pos + n]
        if np.abs(seg).max() < 1e-3:
            out.append(" ")
        else:
            spectrum = np.abs(np.fft.rfft(seg * np.hanning(n), 8 * n))
            freq = np.argmax(spectrum) * rate / (8 * n)
            out.append(letters[min(letters, key=lambda f: abs(f - freq))])
        pos += step
    return "".join(out)


def espeak(text: str) -> tuple[np.ndarray, int]:
    wav = subprocess.run(
        ["espeak-ng", "-v", "en", "-s", "165", "--stdout", text], capture_output=True, check=True
    ).stdout
    audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
    return audio, rate


def write_corpus(folder: Path, name: str, texts: list[str], speak: bool, rate: int, per_shard: int) -> int:
    """FLAC + txt samples in shards of `per_shard`; returns the number of utterances."""
    with ThreadPoolExecutor(8) as pool:
        audios = list(pool.map(lambda t: espeak(t)[0] if speak else tones(t, rate), texts))
    pattern = str(folder / f"{name}-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0, mtime=1_700_000_000) as sink:
        for i, (text, audio) in enumerate(zip(texts, audios)):
            flac = io.BytesIO()
            sf.write(flac, audio, rate, format="FLAC", subtype="PCM_16")
            sink.write({"__key__": f"{name}-{i:05d}", "flac": flac.getvalue(), "txt": text})
    return len(texts)


def make_corpora(folder: Path, rng: np.random.Generator) -> tuple[dict[str, tuple[str, int]], int, bool]:
    speak = shutil.which("espeak-ng") is not None
    rate = espeak("a")[1] if speak else 16000
    read = [" ".join(rng.choice(WORDS, size=rng.integers(3, 9))) for _ in range(300)]
    commands = [COMMANDS[i] for i in rng.integers(0, len(COMMANDS), size=30)]
    corpora = {}
    for name, texts, per_shard in (("read", read, 50), ("commands", commands, 10)):
        n = write_corpus(folder, name, texts, speak, rate, per_shard)
        shards = sorted(folder.glob(f"{name}-*.tar"))
        corpora[name] = (str(folder / f"{name}-{{0000..{len(shards) - 1:04d}}}.tar"), n)
    return corpora, rate, speak


# ---- the mixture ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--batches", type=int, default=60, help="batches to draw (default 60)")
    p.add_argument("--out", type=Path, default=None, help="where to write the shards (default: a temporary folder)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    tmp = None
    if args.out is None:
        tmp = tempfile.TemporaryDirectory(prefix="asr_mix-")
        args.out = Path(tmp.name)
    args.out.mkdir(parents=True, exist_ok=True)
    corpora, rate, speak = make_corpora(args.out, np.random.default_rng(0))
    print(
        f"synthesised {sum(n for _, n in corpora.values())} utterances at {rate} Hz "
        f"({'espeak-ng speech' if speak else 'tones encoding the transcripts'}) in {time.perf_counter() - t0:.1f} s"
    )

    decode = mixer.SpeechDecode(sample_rate=rate, tokenizer=tokenize, min_seconds=0.2, max_seconds=8.0)
    sources = [
        # size: utterances, so that the temperature weights are NeMo's (p_i ∝ n_i ** (1/T))
        mixer.Source(name, pattern, decode=decode, length="audio", size=n)
        for name, (pattern, n) in corpora.items()
    ]
    mix = mixer.Mixture(
        sources,
        schedule=mixer.Temperature(5.0),
        unit="samples",  # NeMo draws utterances: shares count samples (unit="tokens": audio time)
        # 40 s of padded audio per batch (max_length: the longest bucket, fairseq2's max_audio_len)
        batching=mixer.TokenBudget(max_tokens=40 * rate, max_length=8 * rate, multiple_of=2),
        fields={"audio": mixer.Field("float32", pad=0.0), "text": mixer.Field("int32", pad=0)},
        shuffle_buffer=64,
        seed=1234,
    )
    sizes = np.array([n for _, n in corpora.values()], dtype=np.float64)
    nemo = sizes ** (1 / 5) / (sizes ** (1 / 5)).sum()
    loader = mixer.make_loader(mix, num_workers=args.workers)
    t1 = time.perf_counter()
    seconds = np.zeros(len(sources))
    for k, batch in enumerate(loader):
        if k == 0:
            print(f"first batch: {batch!r}")
            print(
                f"  audio {tuple(batch['audio'].shape)} {batch['audio'].dtype}, audio_lengths "
                f"{batch['audio_lengths'].tolist()}"
            )
            print(
                f"  text  {tuple(batch['text'].shape)} {batch['text'].dtype}, text_lengths "
                f"{batch['text_lengths'].tolist()}"
            )
            n, s = int(batch["audio_lengths"][0]), int(batch["text_lengths"][0])
            print(f"  {batch.keys[0]}: {detokenize(batch['text'][0, :s].numpy())!r}")
            if not speak:
                print(f"  the same, read back from its audio: {tones_to_text(batch['audio'][0, :n].numpy(), rate)!r}")
        seconds += np.bincount(batch.source.numpy(), weights=batch.lengths.numpy(), minlength=len(sources)) / rate
        if k + 1 == args.batches:
            break
    took = time.perf_counter() - t1
    stats = loader.stats()  # unit="samples": target and realized are shares of utterances
    counters = loader.counters()
    utterances = np.array([counters[s.name]["samples"] for s in sources], dtype=np.float64)
    print(
        f"\n{args.batches} batches in {took:.1f} s ({utterances.sum() / took:.0f} utterances/s, "
        f"{seconds.sum() / took:.0f} audio-s/s), audio padding efficiency {stats['total']['padding_efficiency']:.3f}"
    )
    print(
        f"{'source':10s} {'utterances':>10s} {'size share':>10s} {'NeMo T=5':>9s} {'target':>7s} {'realized':>9s} "
        f"{'audio s':>8s} {'dropped':>8s}"
    )
    for i, s in enumerate(sources):
        print(
            f"{s.name:10s} {int(sizes[i]):10d} {sizes[i] / sizes.sum():10.3f} {nemo[i]:9.3f} "
            f"{stats['sources'][s.name]['target_now']:7.3f} {stats['sources'][s.name]['total']['realized']:9.3f} "
            f"{seconds[i]:8.1f} {counters[s.name]['dropped']:8d}"
        )
    print(f"total {time.perf_counter() - t0:.1f} s")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
