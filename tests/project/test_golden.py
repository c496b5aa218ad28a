"""Golden tests: outputs that runs persist or compare, pinned to what today's code produces, so that the
coming move of the flat package ``mixer/*.py`` into layered subpackages provably changes none of them.

Each value is compared with a JSON file in ``tests/project/golden/`` (``pytest tests/project/test_golden.py
--regen-golden`` rewrites them from the current code; do that only for an intended change of output,
and say why in the commit). Pinned:

* ``fingerprints.json``: ``Mixture.fingerprint`` of fixed padded (`TokenBudget`), packed (`Packed`),
  multi-field (`Field`s, speech decoded by `mixer.SpeechDecode`) and `Adaptive`-schedule
  configurations (an indexed one is in ``index.json``), next to the ``describe()`` pieces it is
  composed of, so that a mismatch names the piece that moved. A source's ``decode`` enters the
  fingerprint by its qualified name (``mixer.audio.SpeechDecode(...)``), and a state saved before
  the move must still load after it: that module path must survive the move.
* ``states.json``: the exact JSON text of ``make_loader(mix, num_workers=W).state_dict()`` after 13
  batches (padded at 0 and 2 workers; packed, multi-field and adaptive-with-feedback at 0): the
  resume format saved in every checkpoint.
* ``index.json``: the JSON text of index files (``Source(index=True)``, `mixer.build_index`; they are
  persisted next to the shards and read by later runs) and the profile cache's keys and entries
  (`mixer.profile_cache`; a changed key silently re-reads every source on start).
* ``batches.json``: sha256 of the first 200 batches (keys, sources, lengths and the bytes of every
  view) for each layout x selector x ``mix`` mode, with a digest every 20 batches to say where a
  stream first differs.

What could make a golden value depend on the machine, and how it is kept out:

* Shard paths. Shard URLs enter the fingerprint (``ListedSource.describe()`` lists every shard), the
  profile-cache key (it hashes every URL) and index files (the index location is derived from the
  shard URL; entries are keyed by the shard's path relative to it). The library keeps a local path
  as given (no ``abspath``), so the tests write the shards under a tmp dir, ``chdir`` there and use
  relative patterns (``shards/web-{000000..000003}.tar``): nothing is normalised, and every golden
  value is also checked to hold no part of pytest's tmp path.
* File modification times. Index validators (``mtime:<ns>``) and the profile-cache key (size and
  mtime of the local shards it reads) hold the shards' mtime on disk, so every shard file is given
  the fixed mtime `FILE_MTIME_NS` after it is written (the members inside already have a fixed one).
* Encoder versions. Shard byte sizes enter the fingerprint through the size estimate (tokens per byte
  times bytes), so the speech shards hold WAV written by the standard library's ``wave`` (fixed
  bytes), not FLAC (whose encoder writes its vendor version into every file).
* Vector widths. A float computed by a vectorised kernel may differ in its last bit between CPUs, so
  floats are compared to ``FLOAT_REL_TOL`` (12 significant digits); all else exactly.
* Left as is: compressed state columns and index blobs are zlib output; a Python linked to another
  deflate implementation (zlib-ng) would need the files regenerated, on the code before the change.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import math
import os
import wave
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile  # noqa: F401 (mixer.SpeechDecode needs it: without it this module fails, it is not skipped)
from shardutil import LogNormal, lognormal_lengths, split_evenly, write_samples, write_sources

import mixer

GOLDEN = Path(__file__).parent / "golden"
REGEN = "pytest tests/project/test_golden.py --regen-golden"

# ---- the fixed corpus ---------------------------------------------------------------------------

FILE_MTIME_NS = 1_700_000_000 * 10**9  # every shard file's mtime (validators and cache keys hold it)

TOKENS = {
    "web": LogNormal(shards=4, samples=400, median=100, sigma=0.8, lo=2, hi=1024, seed=0),
    "code": LogNormal(shards=2, samples=150, median=300, sigma=1.0, lo=2, hi=1024, seed=1),
    # Few samples: its epoch turns over several times within 200 batches (reshuffles, restarts).
    "tiny": LogNormal(shards=2, samples=30, median=50, sigma=0.5, lo=2, hi=1024, seed=2),
}
WEIGHTS = {"web": 0.5, "code": 0.3, "tiny": 0.2}

RATE = 8000  # not SpeechDecode's default: the fingerprint pins that the decode's options enter it
# name: (shards, utterances, median seconds, longest seconds)
SPEECH = {"read": (3, 48, 0.3, 0.8), "commands": (2, 32, 0.12, 0.3)}
FIELDS = {"audio": mixer.Field("float32", pad=-2.0), "text": mixer.Field("int32", pad=-1)}

# Non-default options, so that each of them is seen to enter the fingerprint and the stream.
COMMON: dict[str, Any] = {"seed": 7, "shuffle_buffer": 64, "state_every": 5}
SELECTORS = ("deficit", "random", "round_robin")
MIXES = ("batch", "sample")
# Batches before a state is taken: at 0 workers past two snapshots (state_every 5) and 3 batches into the
# replay; at 2 workers (7 and 6 batches) each reader past one snapshot, into the replay.
N_STATE = 13
N_BATCHES = 200
EVERY = 20  # batches per partial digest in batches.json


def _seeded(key: str) -> np.random.Generator:
    return np.random.Generator(
        np.random.PCG64(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))
    )


def wav_bytes(key: str, frames: int) -> bytes:
    """Mono 16-bit PCM noise for ``key`` as a WAV file, byte for byte the same on every machine."""
    pcm = _seeded(key).integers(-12000, 12000, size=frames, dtype=np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def utterance(key: str, frames: int) -> dict[str, Any]:
    """A speech sample as `mixer.SpeechDecode` reads it: ``wav`` audio and a ``tokens.npy`` transcript."""
    return {
        "__key__": key,
        "wav": wav_bytes(key, frames),
        "tokens.npy": _seeded(key).integers(1, 5000, 1 + frames // 400).astype(np.int32),
    }


def write_corpus(root: Path) -> dict[str, str]:
    """Write every source under ``root`` and give each shard file the fixed mtime; returns
    ``{source: brace pattern relative to root}`` (the tests run with ``root`` as the cwd)."""
    patterns = {name: pattern for name, (pattern, _) in write_sources(root / "shards", TOKENS).items()}
    for seed, (name, (shards, n, median, longest)) in enumerate(SPEECH.items()):
        frames = lognormal_lengths(n, median=median * RATE, sigma=0.6, lo=RATE // 20, hi=int(longest * RATE), seed=seed)
        per_shard = [
            [utterance(f"{name}-{s:03d}-{i:04d}", m) for i, m in enumerate(lengths)]
            for s, lengths in enumerate(split_evenly(frames, shards))
        ]
        patterns[name] = write_samples(root / "speech", name, per_shard)
    for folder in ("shards", "speech"):
        for entry in os.scandir(root / folder):
            os.utime(entry.path, ns=(FILE_MTIME_NS, FILE_MTIME_NS))
    return {name: os.path.relpath(pattern, root) for name, pattern in patterns.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("golden")
    return root, write_corpus(root)


@pytest.fixture()
def patterns(corpus: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The corpus's relative patterns, with the cwd at its root (DataLoader workers inherit it)."""
    root, rel = corpus
    monkeypatch.chdir(root)
    return rel


# ---- the configurations -------------------------------------------------------------------------


def token_mixture(
    patterns: dict[str, str], *, batching: mixer.TokenBudget | mixer.Packed, index: bool | None = None, **options: Any
) -> mixer.Mixture:
    sources = [mixer.Source(name, patterns[name], weight=w, index=index) for name, w in WEIGHTS.items()]
    return mixer.Mixture(sources, batching=batching, **{**COMMON, **options})


def padded(patterns: dict[str, str], **options: Any) -> mixer.Mixture:
    return token_mixture(patterns, batching=mixer.TokenBudget(1024, num_buckets=8), **options)


def packed(patterns: dict[str, str], **options: Any) -> mixer.Mixture:
    return token_mixture(
        patterns, batching=mixer.Packed(1024, seq_len=256, split_documents=True, open_batches=2), **options
    )


def speech_decode() -> mixer.SpeechDecode:
    return mixer.SpeechDecode(sample_rate=RATE)


def fields(patterns: dict[str, str], **options: Any) -> mixer.Mixture:
    weights = {"read": 0.6, "commands": 0.4}
    sources = [
        mixer.Source(n, patterns[n], weight=w, decode=speech_decode(), length="audio") for n, w in weights.items()
    ]
    batching = mixer.TokenBudget(2 * RATE, num_buckets=4, multiple_of=2)
    return mixer.Mixture(sources, batching=batching, fields=FIELDS, **{**COMMON, **options})


def adaptive(patterns: dict[str, str], **options: Any) -> mixer.Mixture:
    schedule = mixer.Adaptive(mixer.Weights(WEIGHTS), policy="exp3", lr=0.05, update_every=4, smoothing=0.2)
    return padded(patterns, schedule=schedule, **options)


LAYOUTS: dict[str, Callable[..., mixer.Mixture]] = {"padded": padded, "packed": packed, "fields": fields}
CONFIGS: dict[str, Callable[..., mixer.Mixture]] = {**LAYOUTS, "adaptive": adaptive}


# ---- comparing with the golden files -------------------------------------------------------------


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


# A float computed by vectorised kernels (torch's and numpy's reductions, exp) may differ in its last
# bit or two between CPUs of different vector widths (seen: AVX-512 Intel vs AMD EPYC, 1.3e-16
# relative in the adaptive policy's weights). Floats are compared to 12 significant digits, which
# no change of the library's arithmetic slips under; every other value is compared exactly.
FLOAT_REL_TOL = 1e-12
# The selectors' float vectors, saved as their float64 bytes compressed (`mixer.state.columns.pack_floats`):
# compared as floats too, by these key names only (an integer column's bytes are never read as floats).
FLOAT_COLUMNS = ("target", "delivered", "amount", "picks")


def _float_column(text: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<f8")


def _close_float_columns(want: str, got: str) -> bool:
    a, b = _float_column(want), _float_column(got)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=FLOAT_REL_TOL, atol=0.0))


def differences(want: Any, got: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Where two JSON values differ, in sorted key order: ``(path, expected, got)`` per leaf (floats to
    ``FLOAT_REL_TOL``)."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in want or k not in got:
                yield f"{path}.{k}", want.get(k, "<absent>"), got.get(k, "<absent>")
            else:
                yield from differences(want[k], got[k], f"{path}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        for i, (a, b) in enumerate(zip(want, got, strict=False)):
            yield from differences(a, b, f"{path}[{i}]")
        if len(want) != len(got):
            yield f"{path} (length)", len(want), len(got)
    elif isinstance(want, float) and isinstance(got, float):
        if not math.isclose(want, got, rel_tol=FLOAT_REL_TOL):
            yield path, want, got
    elif path.rsplit(".", 1)[-1] in FLOAT_COLUMNS and isinstance(want, str) and isinstance(got, str):
        if want != got and not _close_float_columns(want, got):
            yield path, want, got
    elif _text(want) != _text(got):
        yield path, want, got


def _shown(want: Any, got: Any) -> str:
    """Both values, short; two long strings (index file texts) around their first differing character."""
    if isinstance(want, str) and isinstance(got, str) and max(len(want), len(got)) > 160:
        at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        a = max(at - 40, 0)
        return f"at character {at}: expected ...{want[a : at + 60]!r}..., got ...{got[a : at + 60]!r}..."
    return f"expected {_short(want)}, got {_short(got)}"


def _pretty(value: Any, indent: str = "") -> str:
    """JSON with one key per line, lists of plain values on one line (short, diffable files)."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, inner)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _pretty(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)


def _short(value: Any) -> str:
    text = _text(value)
    return text if len(text) <= 160 else text[:157] + "..."


class Golden:
    """``check(file, key, value)``: ``value`` must equal ``tests/project/golden/<file>[key]`` leaf by leaf
    (as JSON text, floats to ``FLOAT_REL_TOL``); under ``--regen-golden`` it is written there instead."""

    def __init__(self, regen: bool, forbidden: list[str]) -> None:
        self.regen = regen
        self.forbidden = forbidden

    def check(self, file: str, key: str, value: Any) -> None:
        text = _text(value)
        leaked = [p for p in self.forbidden if p in text]
        assert not leaked, (
            f"golden value {file}[{key!r}] holds the tmp path {leaked[0]!r}: it would differ on every run"
        )
        path = GOLDEN / file
        shown = f"tests/project/golden/{file}"
        data = json.loads(path.read_text()) if path.exists() else None
        if self.regen:
            # Merged into the file: each test (and parameter) owns its key.
            data = dict(data or {}, **{key: json.loads(text)})
            GOLDEN.mkdir(exist_ok=True)
            path.write_text(_pretty(data) + "\n")
            return
        if data is None or key not in data:
            pytest.fail(f"{shown}: no golden value {key!r}; write it with `{REGEN}`", pytrace=False)
        found = list(differences(data[key], json.loads(text), key))
        if found:
            (where, want, got), more = found[0], [p for p, _, _ in found[1:]]
            also = (
                f" (and at {len(more)} more: {', '.join(more[:4])}{', ...' if len(more) > 4 else ''})" if more else ""
            )
            pytest.fail(
                f"{shown}: {key!r} differs from today's golden output, first at {where}: {_shown(want, got)}{also}. "
                f"If the change of output is intended, regenerate with `{REGEN}`",
                pytrace=False,
            )


@pytest.fixture()
def golden(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Golden:
    base = tmp_path_factory.getbasetemp()
    return Golden(bool(request.config.getoption("--regen-golden")), sorted({str(base), os.path.realpath(base)}))


# ---- what is pinned ------------------------------------------------------------------------------


def described(mix: mixer.Mixture) -> dict[str, Any]:
    """The fingerprint, with the configuration pieces it is composed of: a mismatch then names the
    piece that changed (a source's ``decode`` path, an edge, a size), or only the fingerprint when
    the pieces are composed differently."""
    fields = FIELDS if isinstance(mix.sources[0].decode, mixer.SpeechDecode) else None
    return {
        "fingerprint": mix.fingerprint,
        "sources": [listed.describe() for listed in mix.listed],
        "batching": mix.batching.describe(),
        "fields": None if fields is None else {name: f.describe() for name, f in fields.items()},
        "schedule": repr(mix.schedule),
        "edges": mix.edges,
        "sizes": mix.sizes,
    }


@pytest.mark.parametrize("config", CONFIGS)
def test_fingerprint(patterns, golden, config):
    golden.check("fingerprints.json", config, described(CONFIGS[config](patterns)))


def test_a_budget_in_samples_keeps_the_fingerprint_of_a_bare_count(patterns, golden):
    """``buffer_budget="65536 samples"`` is the budget a bare ``65536`` meant (the default before the
    budget counted tokens), and its fingerprint is the one that budget had: a state saved then loads."""
    golden.check(
        "fingerprints.json",
        "65536-samples",
        {name: make(patterns, buffer_budget="65536 samples").fingerprint for name, make in CONFIGS.items()},
    )


def take(loader: mixer.Loader, n: int, *, feedback: bool = False) -> Iterator[Any]:
    """The first ``n`` batches, not one more (the state counts what was handed out); with
    ``feedback``, each is reported back with a made-up per-sample loss, as a training loop does."""
    if n <= 0:
        return
    for i, batch in enumerate(loader, 1):
        if feedback:
            loader.feedback(batch, (batch.source.double() + 1) * 0.5 + batch.lengths.double() / 4096)
        yield batch
        if i == n:
            break


# Workers change the state's shape (one reader each, rotation, per-reader replay): pinned once, padded,
# as the other layouts' per-reader parts are pinned at 0 workers (starting workers costs ~1 s).
def test_floats_are_compared_to_twelve_digits_and_everything_else_exactly():
    ulp = 0.45689178727533997
    assert list(differences({"w": [ulp, 1]}, {"w": [math.nextafter(ulp, 1.0), 1]}, "k")) == []
    assert list(differences({"w": [ulp]}, {"w": [ulp * (1 + 1e-10)]}, "k")) == [("k.w[0]", ulp, ulp * (1 + 1e-10))]
    assert list(differences({"n": 1}, {"n": 1.0}, "k")) == [("k.n", 1, 1.0)]  # an int that became a float
    assert list(differences({"s": "0.5"}, {"s": "0.50"}, "k")) == [("k.s", "0.5", "0.50")]
    column = base64.b64encode(zlib.compress(np.array([ulp, 2.0]).tobytes())).decode()
    nudged = base64.b64encode(zlib.compress(np.array([math.nextafter(ulp, 1.0), 2.0]).tobytes())).decode()
    assert list(differences({"target": column}, {"target": nudged}, "k")) == []
    assert list(differences({"offsets": column}, {"offsets": nudged}, "k")) == [("k.offsets", column, nudged)]


@pytest.mark.parametrize(
    "config,num_workers", [("padded", 0), ("padded", 2), ("packed", 0), ("fields", 0), ("adaptive", 0)]
)
def test_loader_state_text(patterns, golden, config, num_workers):
    loader = mixer.make_loader(CONFIGS[config](patterns), num_workers=num_workers)
    assert sum(1 for _ in take(loader, N_STATE, feedback=config == "adaptive")) == N_STATE
    state = loader.state_dict()
    golden.check("states.json", f"{config}-w{num_workers}", state)
    if config == "adaptive":
        assert state["adaptive"] is not None  # the feedback part of the format is pinned too


def _views(batch: mixer.Batch) -> list[tuple[str, Any]]:
    """Every tensor a batch hands the training step, by name (public attributes only)."""
    if isinstance(batch, mixer.PackedBatch):
        names = ["tokens", "position_ids", "cu_seqlens", "offsets", "lengths", "source"]
        return [(n, getattr(batch, n)) for n in names]
    if isinstance(batch, mixer.FieldBatch):
        per_field = [(n, batch[n]) for f in batch.fields for n in (f, f"{f}_lengths")]
        return [*per_field, ("lengths", batch.lengths), ("source", batch.source)]
    return [("tokens", batch.tokens), ("lengths", batch.lengths), ("source", batch.source)]


def digest_batches(batches: Iterator[Any]) -> dict[str, Any]:
    """One sha256 over every batch (its type, keys, step, real tokens, shapes, target shares and every
    view's dtype, shape and bytes), the running digest every `EVERY` batches, and totals."""
    total, partial = hashlib.sha256(), []
    count = samples = tokens = 0
    for batch in batches:
        meta = batch.meta
        head = [
            type(batch).__name__,
            batch.keys,
            meta.step,
            meta.tokens,
            getattr(batch, "seq_len", None),
            getattr(batch, "max_seqlen", None),
        ]
        total.update(json.dumps(head).encode())
        total.update(np.asarray(meta.target, dtype=np.float64).tobytes())
        for name, view in _views(batch):
            array = np.ascontiguousarray(view.numpy())
            total.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            total.update(array.tobytes())
        count, samples, tokens = count + 1, samples + len(batch), tokens + int(batch.lengths.sum())
        if count % EVERY == 0:
            partial.append(total.hexdigest()[:16])  # the running digest: where a stream first differs
    return {
        "batches": count,
        "samples": samples,
        "tokens": tokens,
        f"every_{EVERY}": partial,
        "sha256": total.hexdigest(),
    }


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_batches(patterns, golden, layout, selector, mix):
    loader = mixer.make_loader(LAYOUTS[layout](patterns, selector=selector, mix=mix))
    out = digest_batches(take(loader, N_BATCHES))
    assert out["batches"] == N_BATCHES
    golden.check("batches.json", f"{layout}-{selector}-{mix}", out)


def test_index_files_and_profile_cache(tmp_path, monkeypatch, golden):
    # A private corpus: an index is written next to the shards, the profile cache into the cwd.
    monkeypatch.chdir(tmp_path)
    patterns = write_corpus(tmp_path)

    indexed = padded(patterns, index=True)  # builds shards/mixer-index.json.gz (nothing read up front)
    web = mixer.load_index(patterns["web"])
    speech = mixer.build_index(mixer.Source("read", patterns["read"], decode=speech_decode(), length="audio"))
    files = {}
    for index in (web, speech):
        assert len(index.locations) == 1 and not os.path.isabs(index.locations[0])  # relative: where the shards are
        with open(index.locations[0], "rb") as f:
            files[index.locations[0]] = gzip.decompress(f.read()).decode()  # the JSON text as written
    golden.check(
        "index.json",
        "index",
        {
            "fingerprint": described(indexed),
            "tokens_by": {"web": web.tokens_by, "read": speech.tokens_by},
            "files": files,
        },
    )

    cached = padded(patterns, profile_cache="cache")  # a relative cache directory: the key holds no path
    entries = sorted(Path("cache").glob("*.json"))
    assert len(entries) == len(WEIGHTS)
    # Built again from the cache (nothing read), the mixture is the same mixture.
    assert padded(patterns, profile_cache="cache").fingerprint == cached.fingerprint
    # The key is the file name; the entry (lengths, tokens per byte, size) is pinned by its digest.
    keys = {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in entries}
    golden.check("index.json", "profile_cache", {"keys": keys, "fingerprint": cached.fingerprint})
