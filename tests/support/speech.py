"""Speech shards for the tests: deterministic PCM tones encoded as FLAC or WAV with soundfile, with their
transcript tokens, written as webdataset samples (`write_speech_shards`)."""

from __future__ import annotations

import hashlib
import io

import numpy as np
from shardutil import write_samples

RATE = 16000


def pcm(key: str, frames: int, *, channels: int = 1) -> np.ndarray:
    """Deterministic int16 PCM for ``key``: a tone whose pitch comes from the key, with a fade in
    and out (exactly representable, so lossless codecs give it back bit for bit)."""
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    t = np.arange(frames) / RATE
    wave = np.sin(2 * np.pi * (200 + digest % 800) * t) * np.minimum(1.0, np.minimum(t, t[::-1] if frames else t) * 50)
    out = np.rint(12000 * wave).astype(np.int16)
    return np.stack([out, out // 2], axis=1) if channels == 2 else out


def encode(audio: np.ndarray, fmt: str, rate: int = RATE) -> bytes:
    import soundfile  # imported here: the tests that need it skip without it (pytest.importorskip)

    buf = io.BytesIO()
    soundfile.write(buf, audio, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def text_tokens(key: str, n: int) -> np.ndarray:
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return ((np.arange(n) * 7919 + digest) % 5000 + 1).astype(np.int32)


def speech_sample(key: str, frames: int, *, fmt: str = "flac", words: int | None = None, rate: int = RATE) -> dict:
    """A tar sample as ShardWriter writes it: ``flac``/``wav`` bytes and ``tokens.npy``."""
    words = words if words is not None else 1 + frames // 2000
    return {"__key__": key, fmt: encode(pcm(key, frames), fmt.upper(), rate), "tokens.npy": text_tokens(key, words)}


def write_speech_shards(
    folder, name: str, frames_per_shard: list[list[int]], *, fmt: str = "flac"
) -> tuple[str, dict[str, int]]:
    """Shards of speech samples, key ``f"{name}-{shard}-{i}"``; returns (pattern, {key: frames})."""
    shards, frames = [], {}
    for s, lengths in enumerate(frames_per_shard):
        samples = []
        for i, n in enumerate(lengths):
            key = f"{name}-{s:03d}-{i:04d}"
            samples.append(speech_sample(key, n, fmt=fmt))
            frames[key] = n
        shards.append(samples)
    return write_samples(folder, name, shards), frames
