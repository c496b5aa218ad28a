"""Batch layouts (issue 8): packed vs padded on the same token mix, and speech batches from FLAC.

    python -m benchmarks layouts [--quick] [--rounds N]

Text: the web/code/books shard set of `throughput`, mixed by the same mixture (deficit selector,
0.6/0.3/0.1 token shares), each method stopping after the same number of real tokens:

* `padded` — `TokenBudget(65536)`: length buckets, padded `[B, L]` (the reference);
* `packed_rows` — `Packed(65536, seq_len=8192, split_documents=True)`: 8 rows of 8192, first fit,
  long documents split across rows; padding only in the last batch of a pass;
* `packed_rows_whole` — `Packed(65536, seq_len=32768)`: 2 rows, documents never split (the longest
  books are 32768 tokens), so rows end with padding;
* `packed_flat` — `Packed(65536)`: one flat run of whole documents per batch, no padding at all.

Padding efficiency is real tokens / token slots in the batches (for packed: `tokens.numel()`).
"samples" of a packed method are segments (documents, or pieces of split documents).

Speech: two FLAC corpora (synthetic, tones with a noise floor so that FLAC works as hard as on
speech), `SpeechDecode` + `Mixture(fields=...)` + `TokenBudget` of 60 s of 16 kHz audio, one pass
(`stop="all_exhausted"`) with 0 and 2 DataLoader workers, and the decode alone (tar read + FLAC
decode, no batching) as the ceiling. Rates: utterances/s and audio-seconds/s.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import common
from .common import Method, ShardSet, Tally

NAME = "layouts"
MAX_TOKENS = 65_536
RATE = 16_000
SPEECH = {"full": (1200, 120), "quick": (240, 24)}  # utterances of 'read' and 'commands'
SPEECH_VERSION = 1


# ---- text: packed vs padded ----------------------------------------------------------------------


def batching(kind: str):
    import mixer

    return {
        "padded": lambda: mixer.TokenBudget(MAX_TOKENS),
        "packed_rows": lambda: mixer.Packed(MAX_TOKENS, seq_len=8192, split_documents=True),
        "packed_rows_whole": lambda: mixer.Packed(MAX_TOKENS, seq_len=32768),
        "packed_flat": lambda: mixer.Packed(MAX_TOKENS),
    }[kind]()


def text_method(shards: ShardSet, kind: str, budget: int) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        import mixer

        sources = [mixer.Source(s.name, s.pattern, weight=s.weight) for s in shards.sources]
        loader = mixer.make_loader(mixer.Mixture(sources, batching=batching(kind), seed=0), num_workers=0)
        for batch in loader:
            tally.add_batch(batch.lengths.numpy(), batch.source.numpy(), batch.tokens.numel())
            if tally.tokens >= budget:
                break
        split = sum(c["split"] for c in loader.counters().values())
        if split:
            tally.note(f"{split:,} documents split")

    return run


# ---- speech ------------------------------------------------------------------------------------


def ensure_speech(
    profile: str, bench_dir: Path, log: Callable[[str], None] | None
) -> dict[str, tuple[str, int, float]]:
    """Cached FLAC shards: ``{name: (pattern, utterances, audio seconds)}``."""
    root = Path(bench_dir) / "speech" / profile
    spec = {"version": SPEECH_VERSION, "profile": profile, "counts": list(SPEECH[profile]), "rate": RATE}
    manifest = root / "manifest.json"
    if manifest.exists():
        try:
            saved = json.loads(manifest.read_text())
            if saved["spec"] == spec and all(
                (root / f).is_file() for src in saved["sources"].values() for f in src["files"]
            ):
                return {
                    n: (str(root / src["pattern"]), src["utterances"], src["seconds"])
                    for n, src in saved["sources"].items()
                }
        except (OSError, ValueError, KeyError, TypeError):
            pass
    import soundfile as sf
    import webdataset as wds

    if log:
        log(f"writing {profile} speech shards to {root} (once) ...")
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sources = {}
    for seed, (name, n, median_s, per_shard) in enumerate(
        [("read", SPEECH[profile][0], 6.0, 100), ("commands", SPEECH[profile][1], 1.5, 20)]
    ):
        rng = np.random.default_rng([20240801, seed])
        seconds = np.clip(rng.lognormal(math.log(median_s), 0.5, n), 0.3, 25.0)
        total = 0.0
        with wds.ShardWriter(str(tmp / f"{name}-%04d.tar"), maxcount=per_shard, verbose=0, mtime=common.MTIME) as sink:
            for i, sec in enumerate(seconds):
                frames = int(sec * RATE)
                t = np.arange(frames) / RATE
                f0 = 120 + 80 * rng.random()
                # a gliding harmonic tone with a -40 dB noise floor: FLAC compresses it about as
                # well as it does speech (~55-65% of PCM), so decoding costs what it would on speech
                audio = 0.3 * np.sin(
                    2 * np.pi * f0 * t * (1 + 0.1 * np.sin(2 * np.pi * 0.5 * t))
                ) + 0.01 * rng.standard_normal(frames)
                buf = io.BytesIO()
                sf.write(buf, audio.astype(np.float32), RATE, format="FLAC", subtype="PCM_16")
                words = rng.integers(1, 5000, size=max(1, int(sec * 2.5)))
                sink.write({"__key__": f"{name}-{i:06d}", "flac": buf.getvalue(), "tokens.npy": words.astype(np.int32)})
                total += frames / RATE
        files = sorted(p.name for p in tmp.glob(f"{name}-*.tar"))
        sources[name] = {
            "pattern": f"{name}-{{0000..{len(files) - 1:04d}}}.tar",
            "files": files,
            "utterances": int(n),
            "seconds": total,
        }
    (tmp / "manifest.json").write_text(json.dumps({"spec": spec, "sources": sources}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return {n: (str(root / src["pattern"]), src["utterances"], src["seconds"]) for n, src in sources.items()}


def speech_mixture(corpora: dict[str, tuple[str, int, float]]):
    import mixer

    decode = mixer.SpeechDecode(sample_rate=RATE)
    sources = [mixer.Source(n, p, decode=decode, length="audio", size=u) for n, (p, u, _) in corpora.items()]
    return mixer.Mixture(
        sources,
        schedule=mixer.Temperature(5.0),
        unit="samples",
        batching=mixer.TokenBudget(60 * RATE, max_length=25 * RATE, multiple_of=2),
        fields={"audio": mixer.Field("float32"), "text": mixer.Field("int32")},
        stop="all_exhausted",
        seed=0,
    )


def speech_method(mixture, utterances: int, workers: int) -> Callable[[Tally], None]:
    """One pass of an already built mixture (building it profiles up to 2048 utterances per source
    once, which a small shard set would otherwise charge to every round)."""

    def run(tally: Tally) -> None:
        import mixer

        loader = mixer.make_loader(mixture, num_workers=workers)
        for batch in loader:
            tally.add_batch(batch.lengths.numpy(), batch.source.numpy(), batch["audio"].numel())
        del loader
        common.reap_children()
        if tally.samples != utterances:
            raise RuntimeError(f"one pass delivered {tally.samples} utterances of {utterances}")

    return run


def speech_decode_only(corpora: dict[str, tuple[str, int, float]]) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        import mixer
        from mixer.read.tario import read_samples
        from mixer.storage import expand_urls

        decode = mixer.SpeechDecode(sample_rate=RATE)
        for pattern, _, _ in corpora.values():
            for url, _ in expand_urls([pattern]):
                with open(url, "rb") as stream:
                    for raw in read_samples(stream, url=url):
                        tally.add_samples(1, len(decode(raw)["audio"]))

    return run


# ---- the suite's entry -------------------------------------------------------------------------


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    budget = int(opts.budget * shards.tokens)
    skip = common.missing("mixer", "Packed", "Mixture", "make_loader")
    note = f"stops at {budget / 1e6:.1f}M real tokens"
    text = [
        Method("padded", "padded: TokenBudget(65536)", text_method(shards, "padded", budget), skip=skip, note=note),
        Method(
            "packed_rows",
            "packed: 8 x 8192 rows, split",
            text_method(shards, "packed_rows", budget),
            skip=skip,
            note=note,
        ),
        Method(
            "packed_rows_whole",
            "packed: 2 x 32768 rows, whole docs",
            text_method(shards, "packed_rows_whole", budget),
            skip=skip,
            note=note,
        ),
        Method(
            "packed_flat", "packed: flat, no padding", text_method(shards, "packed_flat", budget), skip=skip, note=note
        ),
    ]
    text_out = common.run_rounds(text, opts.rounds, shards.weights, opts.window_tokens, log)
    rows = [common.summarize(NAME, text_out[m.name], shards) for m in text]

    speech_skip = common.missing("mixer", "SpeechDecode", "Field") or common.missing("soundfile", "read")
    corpora = ensure_speech(opts.profile, opts.bench_dir, log) if speech_skip is None else {}
    seconds = sum(s for _, _, s in corpora.values())
    utterances = sum(u for _, u, _ in corpora.values())
    describe = f"{utterances} utterances, {seconds / 3600:.2f} h of 16 kHz FLAC" if corpora else ""
    built_s = math.nan
    mixture = None
    if corpora:
        t0 = time.perf_counter()
        mixture = speech_mixture(corpora)
        built_s = time.perf_counter() - t0
        log(f"speech mixture built (profiling included) in {built_s:.2f} s")
    speech = [
        Method(
            "speech_decode",
            "speech: tar read + FLAC decode only",
            speech_decode_only(corpora),
            kind="read",
            skip=speech_skip,
            note=describe,
        ),
        *(
            Method(
                f"speech_w{w}",
                f"speech batches, num_workers={w}",
                speech_method(mixture, utterances, w),
                skip=speech_skip,
                note=f"{describe}; TokenBudget(60 s), one pass",
            )
            for w in (0, 2)
        ),
    ]
    speech_targets = np.full(2, 0.5)
    speech_out = common.run_rounds(speech, opts.rounds, speech_targets, 1 << 62, log)
    speech_set = types.SimpleNamespace(weights=speech_targets)  # summarize's share columns do not apply here
    for m in speech:
        row = common.summarize(NAME, speech_out[m.name], speech_set)  # type: ignore[arg-type]
        row.pop("share", None), row.pop("share_err", None)
        if "tokens_per_s" in row:
            row["audio_seconds_per_s"] = row["tokens_per_s"] / RATE
            row["note"] = f"{row['audio_seconds_per_s']:,.0f} audio-s/s; " + row["note"]
        rows.append(row)

    by = {r["method"]: r for r in rows}
    checks = [
        common.value_check(NAME, "packed rows (split) padding efficiency", by["packed_rows"].get("pad_eff"), 0.99),
        common.value_check(NAME, "packed flat padding efficiency", by["packed_flat"].get("pad_eff"), 0.99),
        common.value_check(NAME, "padded (TokenBudget) padding efficiency", by["padded"].get("pad_eff"), None),
        common.value_check(
            NAME, "packed rows (whole docs) padding efficiency", by["packed_rows_whole"].get("pad_eff"), None
        ),
        common.ratio_check(
            NAME,
            "packed rows / padded, real tokens/s",
            text_out["packed_rows"],
            text_out["padded"],
            "tokens_per_s",
            None,
        ),
        common.ratio_check(
            NAME,
            "packed flat / padded, real tokens/s",
            text_out["packed_flat"],
            text_out["padded"],
            "tokens_per_s",
            None,
        ),
        common.ratio_check(
            NAME,
            "packed rows / padded, real tokens per CPU-s",
            text_out["packed_rows"],
            text_out["padded"],
            "tokens_per_cpu_s",
            None,
        ),
        common.value_check(NAME, "speech Mixture(...) construction incl. profiling, s", built_s, None),
        common.value_check(NAME, "speech audio-seconds/s, 0 workers", by["speech_w0"].get("audio_seconds_per_s"), None),
        common.value_check(NAME, "speech audio-seconds/s, 2 workers", by["speech_w2"].get("audio_seconds_per_s"), None),
        common.ratio_check(
            NAME,
            "speech samples/s, 2 workers / 0 workers",
            speech_out["speech_w2"],
            speech_out["speech_w0"],
            "samples_per_s",
            None,
        ),
        common.ratio_check(
            NAME,
            "speech batches (0 workers) / decode only, samples/s",
            speech_out["speech_w0"],
            speech_out["speech_decode"],
            "samples_per_s",
            None,
        ),
    ]
    config = {
        "profile": opts.profile,
        "rounds": opts.rounds,
        "budget_tokens": budget,
        "targets": shards.weights.tolist(),
        "shards": shards.describe(),
        "speech": {n: {"utterances": u, "seconds": s} for n, (_, u, s) in corpora.items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return common.BenchResult(NAME, rows, checks, config)
