"""Speech samples: audio plus a transcript, decoded into the two fields ``audio`` and ``text``.

Use :class:`SpeechDecode` as a source's ``decode`` and collate with
``Mixture(fields={"audio": Field("float32"), "text": Field("int32")})``; a sample's length (what
buckets, budgets and token shares count) is then its number of audio samples, so
``TokenBudget(max_tokens=...)`` is fairseq2's ``max_num_elements`` and ``multiple_of`` its
``num_seqs_multiple_of``.

Audio is read with ``soundfile`` (libsndfile: FLAC, WAV, OGG/Vorbis/Opus, MP3 with libsndfile >= 1.1),
an optional dependency: ``pip install 'wds-mixer[audio]'``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from mixer.errors import ConfigError, SampleError
from mixer.read.decode import decode_npy

_AUDIO_DTYPES = ("float32", "float64", "int16", "int32")
_soundfile: Any = None


def soundfile() -> Any:
    """The ``soundfile`` module, or a clear error saying how to install it."""
    global _soundfile
    if _soundfile is None:
        try:
            import soundfile as sf
        except (ImportError, OSError) as exc:  # OSError: the package is there but libsndfile is not
            raise ConfigError(
                f"mixer.read.audio needs the 'soundfile' package and libsndfile ({exc}); install them with "
                "pip install 'wds-mixer[audio]'"
            ) from exc
        _soundfile = sf
    return _soundfile


@dataclass(frozen=True, kw_only=True)
class SpeechDecode:
    """``decode=`` for speech: ``{"audio": [T], "text": [S]}`` from one tar sample.

    * Audio: the first member present among ``audio_members`` (default ``flac``, ``wav``), read as
      ``dtype`` (float32 in [-1, 1) by default; ``int16`` keeps PCM values); several channels are
      averaged to mono. A sample rate other than ``sample_rate`` is a :class:`~mixer.SampleError`
      (the source's ``on_error`` policy applies) unless ``resample`` is given: a callable
      ``(audio, from_rate, to_rate) -> audio`` (e.g. around ``torchaudio.functional.resample`` or
      ``scipy.signal.resample_poly``). mixer does not resample by itself.
    * Text: ``tokens.npy`` (1-D integer array) if the sample has it, else ``txt`` passed through
      ``tokenizer(str) -> sequence of ints`` (default: its UTF-8 bytes).
    * ``min_seconds`` / ``max_seconds``: shorter or longer utterances are dropped (checked from the
      file header, before decoding) and counted in the source's ``dropped`` counter.
    """

    sample_rate: int = 16000
    tokenizer: Callable[[str], Sequence[int]] | None = None
    min_seconds: float | None = None
    max_seconds: float | None = None
    resample: Callable[[np.ndarray, int, int], np.ndarray] | None = None
    dtype: str = "float32"
    audio_members: tuple[str, ...] = ("flac", "wav")

    def __post_init__(self) -> None:
        soundfile()
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int) or self.sample_rate < 1:
            raise ConfigError(f"SpeechDecode: sample_rate must be a positive int in Hz (got {self.sample_rate!r})")
        for name in ("min_seconds", "max_seconds"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise ConfigError(f"SpeechDecode: {name} must be a number of seconds >= 0 or None (got {v!r})")
        if self.min_seconds is not None and self.max_seconds is not None and self.min_seconds > self.max_seconds:
            raise ConfigError(f"SpeechDecode: min_seconds={self.min_seconds} exceeds max_seconds={self.max_seconds}")
        for name in ("tokenizer", "resample"):
            v = getattr(self, name)
            if v is not None and not callable(v):
                raise ConfigError(f"SpeechDecode: {name} must be callable or None (got {v!r})")
        if self.dtype not in _AUDIO_DTYPES:
            raise ConfigError(f"SpeechDecode: dtype must be one of {_AUDIO_DTYPES} (got {self.dtype!r})")
        if (
            isinstance(self.audio_members, str)
            or not self.audio_members
            or not all(isinstance(m, str) and m for m in self.audio_members)
        ):
            raise ConfigError(
                "SpeechDecode: audio_members must be a non-empty tuple of member extensions (got "
                f"{self.audio_members!r})"
            )

    def __repr__(self) -> str:
        # Deterministic across processes (callables by name, not address): it is part of the
        # mixture's fingerprint, which a resumed run must reproduce.
        def show(v: Any) -> str:
            if callable(v):
                return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__qualname__)}"
            return repr(v)

        return "SpeechDecode(" + ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self)) + ")"

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        where = f"shard {sample.get('__url__', '?')}, key {sample.get('__key__')!r}"
        member = next((m for m in self.audio_members if m in sample), None)
        if member is None:
            members = sorted(k for k in sample if not k.startswith("__"))
            raise SampleError(
                f"{where}: no audio member: expected one of {list(self.audio_members)} (members: {members})"
            )
        sf = soundfile()
        try:
            with sf.SoundFile(io.BytesIO(sample[member])) as f:
                rate, frames = f.samplerate, f.frames
                seconds = frames / rate
                if (self.min_seconds is not None and seconds < self.min_seconds) or (
                    self.max_seconds is not None and seconds > self.max_seconds
                ):
                    return None
                audio = f.read(dtype=self.dtype, always_2d=True)
        except (RuntimeError, TypeError, ValueError) as exc:  # LibsndfileError is a RuntimeError
            raise SampleError(f"{where}: cannot decode audio member {member!r}: {exc}") from exc
        audio = audio[:, 0] if audio.shape[1] == 1 else audio.mean(axis=1).astype(self.dtype)
        if rate != self.sample_rate:
            if self.resample is None:
                raise SampleError(
                    f"{where}: audio member {member!r} is sampled at {rate} Hz, the decode expects {self.sample_rate} "
                    "Hz; "
                    "resample the corpus, or pass SpeechDecode(resample=...)"
                )
            audio = np.asarray(self.resample(audio, rate, self.sample_rate))
            if audio.ndim != 1:
                raise SampleError(f"{where}: resample returned shape {audio.shape}, expected 1-D")
        return {"audio": audio, "text": self._text(sample, where)}

    def _text(self, sample: Mapping[str, Any], where: str) -> np.ndarray:
        data = sample.get("tokens.npy")
        if data is not None:
            tokens = decode_npy(data, where=f"{where}, member 'tokens.npy'")
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise SampleError(
                    f"{where}: 'tokens.npy' must be a 1-D integer array (got dtype {tokens.dtype}, shape "
                    f"{tokens.shape})"
                )
            return tokens
        text = sample.get("txt")
        if text is None:
            members = sorted(k for k in sample if not k.startswith("__"))
            raise SampleError(f"{where}: no transcript: expected 'tokens.npy' or 'txt' (members: {members})")
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8") if isinstance(text, str) else bytes(text), np.uint8)
        if not isinstance(text, str):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SampleError(f"{where}: 'txt' is not UTF-8: {exc}") from exc
        ids = np.asarray(self.tokenizer(text))
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise SampleError(
                f"{where}: tokenizer must return a sequence of ints (got dtype {ids.dtype}, shape {ids.shape})"
            )
        return ids.astype(np.int64, copy=False)
