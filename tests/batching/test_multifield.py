"""Multi-field samples (Mixture(fields=...)): speech shards (real FLAC) round-trip exactly per field,
lengths and pads are right, audio length drives buckets and budgets, filters are counted, exact resume."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import shardutil
import torch
from resume_oracle import _equal, assert_resumes_exactly, take
from shardutil import lognormal_lengths, split_evenly, write_samples
from speech import RATE, encode, pcm, text_tokens, write_speech_shards

import mixer

pytest.importorskip("soundfile")

AUDIO_PAD, TEXT_PAD = -2.0, -1  # neither occurs in real data: float audio is in [-1, 1), ids >= 1
FIELDS = {"audio": mixer.Field("float32", pad=AUDIO_PAD), "text": mixer.Field("int32", pad=TEXT_PAD)}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two speech corpora: 'read' (longer utterances, 0.1-4 s) and 'commands' (short, 0.1-1 s)."""
    folder = tmp_path_factory.mktemp("speech")
    out = {}
    for seed, (name, shards, n, median, hi) in enumerate([("read", 3, 90, 1.2, 4.0), ("commands", 2, 60, 0.4, 1.0)]):
        secs = lognormal_lengths(n, median=median * 1000, sigma=0.6, lo=100, hi=int(hi * 1000), seed=seed)
        out[name] = write_speech_shards(folder, name, split_evenly([s * RATE // 1000 for s in secs], shards))
    return out


def mixture(corpora, *, decode=None, **kwargs):
    """`shardutil.mixture` over both corpora, each decoded by `decode` (default: SpeechDecode())."""
    options = {
        "fields": FIELDS,
        "batching": mixer.TokenBudget(max_tokens=8 * RATE, multiple_of=2),
        "shuffle_buffer": 16,
        "state_every": 3,
    }
    source_options = {"decode": decode or mixer.SpeechDecode(), "length": "audio"}
    return shardutil.mixture(
        corpora, weights={"read": None, "commands": None}, source_options=source_options, **{**options, **kwargs}
    )


def test_audio_and_text_round_trip_exactly_for_every_key(corpora):
    loader = mixer.make_loader(mixture(corpora, stop="all_exhausted"), num_workers=2)
    frames = {**corpora["read"][1], **corpora["commands"][1]}
    seen = set()
    for b in loader:
        assert isinstance(b, mixer.FieldBatch) and b.fields == ("audio", "text")
        audio, text = b["audio"], b["text"]
        assert audio.dtype == torch.float32 and text.dtype == torch.int32
        assert torch.equal(b.lengths, b["audio_lengths"])  # length="audio"
        assert audio.shape[1] == int(b["audio_lengths"].max()) and text.shape[1] == int(b["text_lengths"].max())
        for i, key in enumerate(b.keys):
            n, s = int(b["audio_lengths"][i]), int(b["text_lengths"][i])
            assert key not in seen and n == frames[key]
            seen.add(key)
            assert np.array_equal(audio[i, :n].numpy(), pcm(key, n).astype(np.float32) / 32768)
            assert np.array_equal(text[i, :s].numpy(), text_tokens(key, 1 + n // 2000))
            assert torch.all(audio[i, n:] == AUDIO_PAD) and torch.all(text[i, s:] == TEXT_PAD)
    assert seen == set(frames)


def test_buckets_and_budget_count_audio_samples(corpora):
    budget = mixer.TokenBudget(max_tokens=6 * RATE, num_buckets=4)
    loader = mixer.make_loader(mixture(corpora, batching=budget, stop="all_exhausted"))
    sizes = []
    for b in loader:
        # the padded audio B * T stays within the budget: max_tokens is fairseq2's max_num_elements
        assert b["audio"].numel() == len(b) * b.seq_len <= budget.max_tokens
        sizes.append(len(b))
    assert max(sizes) >= 8  # short utterances share batches
    total = sum(corpora["read"][1].values()) + sum(corpora["commands"][1].values())
    counters = loader.counters()
    assert sum(c["tokens"] for c in counters.values()) == total  # token shares count audio samples
    assert loader.stats()["total"]["padding_efficiency"] > 0.8


def test_duration_filters_are_counted_as_dropped(corpora):
    decode = mixer.SpeechDecode(min_seconds=0.3, max_seconds=2.5)
    loader = mixer.make_loader(mixture(corpora, decode=decode, stop="all_exhausted"))
    keys = {k for b in loader for k in b.keys}
    for name in ("read", "commands"):
        frames = corpora[name][1]
        kept = {k for k, n in frames.items() if 0.3 * RATE <= n <= 2.5 * RATE}
        assert 0 < len(kept) < len(frames)
        assert keys & set(frames) == kept
        assert loader.counters()[name]["dropped"] == len(frames) - len(kept)


def field_view(b):
    return (
        tuple(b.keys),
        b["audio"].clone(),
        b["text"].clone(),
        b["audio_lengths"].clone(),
        b["text_lengths"].clone(),
        b.source.clone(),
        b.meta.step,
    )


@pytest.mark.parametrize(
    "num_workers, mix, cuts", [(0, "batch", [1, 2, 5, 7]), (2, "batch", [2, 7]), (2, "sample", [3, 5])]
)
def test_resume_oracle_multi_field(corpora, num_workers, mix, cuts):
    mix_ = mixture(corpora, mix=mix, batching=mixer.TokenBudget(max_tokens=4 * RATE))
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix_, num_workers=num_workers), cuts=cuts, window=5, view=field_view
    )


def test_generic_fields_dtypes_casts_and_pads(tmp_path):
    """Not speech: any named 1-D arrays; each field keeps its own dtype and pad, inside one buffer."""
    lengths = lognormal_lengths(40, median=30, sigma=0.5, lo=1, hi=200, seed=3)
    samples = [
        {"__key__": f"k{i:03d}", "x.npy": np.arange(n, dtype=np.int16) + 1, "y.npy": np.linspace(0, 1, i % 5 + 1)}
        for i, n in enumerate(lengths)
    ]
    pattern = write_samples(tmp_path, "gen", split_evenly(samples, 2))

    def decode(raw):
        from mixer.read.decode import decode_npy

        return {"x": decode_npy(raw["x.npy"]), "y": decode_npy(raw["y.npy"])}

    fields = {"x": mixer.Field("int64", pad=7), "y": mixer.Field("float16", pad=-1.0)}
    mix = mixer.Mixture(
        [mixer.Source("g", pattern, decode=decode)],
        batching=mixer.TokenBudget(max_tokens=400),
        fields=fields,
        stop="all_exhausted",
        dtype="int32",
    )
    got = {}
    for b in mixer.make_loader(mix, num_workers=2):
        assert b["x"].dtype == torch.int64 and b["y"].dtype == torch.float16 and b.buffer.dtype == torch.int32
        ptr = b.buffer.untyped_storage().data_ptr()
        assert all(b[n].untyped_storage().data_ptr() == ptr for n in ("x", "y", "x_lengths", "source"))
        assert torch.equal(b.lengths, b["x_lengths"])  # default: the first field counts
        for i, key in enumerate(b.keys):
            nx, ny = int(b["x_lengths"][i]), int(b["y_lengths"][i])
            assert torch.all(b["x"][i, nx:] == 7) and torch.all(b["y"][i, ny:] == -1.0)
            got[key] = (b["x"][i, :nx].tolist(), b["y"][i, :ny].tolist())
    for i, s in enumerate(samples):
        assert got[s["__key__"]] == (list(range(1, lengths[i] + 1)), s["y.npy"].astype(np.float16).tolist())


def test_a_float_field_never_silently_becomes_int(tmp_path):
    pattern = write_samples(tmp_path, "f", [[{"__key__": "a", "v.npy": np.array([0.5, 1.5])}]])
    from mixer.read.decode import decode_npy

    decode = lambda raw: {"v": decode_npy(raw["v.npy"])}  # noqa: E731
    mix = mixer.Mixture(
        [mixer.Source("f", pattern, decode=decode)],
        batching=mixer.TokenBudget(max_tokens=64),
        fields={"v": mixer.Field("int32")},
    )
    with pytest.raises(mixer.SampleError, match=r"field 'v'.*same_kind"):
        take(mixer.make_loader(mix), 1)


def test_misconfigurations_fail_clearly(corpora):
    with pytest.raises(
        mixer.ConfigError,
        match=r"source 'read': length='audio' names a field, but the mixture's fields= \['text'\] lack it",
    ):
        mixture(corpora, fields={"text": mixer.Field("int32")})
    with pytest.raises(mixer.ConfigError, match=r"decode returned fields \['audio', 'text'\]; pass Mixture\(fields="):
        srcs = [mixer.Source("read", corpora["read"][0], decode=mixer.SpeechDecode())]
        take(mixer.make_loader(mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=8 * RATE))), 1)
    with pytest.raises(
        mixer.SampleError, match=r"decode gave \['audio', 'text'\], the mixture's fields need 'speaker'"
    ):
        take(mixer.make_loader(mixture(corpora, fields={**FIELDS, "speaker": mixer.Field()})), 1)
    for bad, match in [
        ({}, r"^fields: must be a non-empty mapping of name -> mixer.Field, got \{\} \(dict\)$"),
        ({"a b": mixer.Field()}, r"^fields\.a b: a field name must be an identifier, got 'a b'$"),
        ({"source": mixer.Field()}, r"^fields\.source: collides with a view every batch has"),
        ({"audio": "float32"}, r"^fields\.audio: expected a mixer.Field, got str$"),
    ]:
        with pytest.raises(mixer.ConfigError, match=match):
            mixture(corpora, fields=bad)
    # The same rules and words as a config file's fields.<name>.<key> (mixer._check).
    with pytest.raises(mixer.ConfigError, match=r"^Field\.pad: 0\.5 is not representable as int32$"):
        mixer.Field("int32", pad=0.5)
    with pytest.raises(
        mixer.ConfigError, match=r"^Field\.dtype: must be one of 'int8', .*'bfloat16'.*, got 'float8'; did you mean"
    ):
        mixer.Field("float8")
    with pytest.raises(mixer.ConfigError, match=r"^Field\.feature_shape\[1\]: must be >= 1, got 0$"):
        mixer.Field("float32", feature_shape=(80, 0))
    with pytest.raises(mixer.ConfigError, match=r"^Field\.feature_shape: must be a sequence of sizes, got 80"):
        mixer.Field("float32", feature_shape=80)


def test_pickle_to_and_device_feed_keep_views_consistent(corpora):
    (b,) = take(mixer.make_loader(mixture(corpora)), 1)
    for c in (pickle.loads(pickle.dumps(b)), b.to("cpu"), *take(mixer.make_loader(mixture(corpora), device="cpu"), 1)):
        assert type(c) is mixer.FieldBatch and _equal(field_view(c), field_view(b))
    with pytest.raises(AttributeError, match=r"FieldBatch has no 'tokens'.*\('audio', 'text'\)"):
        b.tokens  # noqa: B018
    assert "audio=(" in repr(b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_and_cuda_paths(corpora):
    (b,) = take(mixer.make_loader(mixture(corpora)), 1)
    pinned = b.pin_memory()
    assert pinned.is_pinned() and pinned["audio"].is_pinned() and torch.equal(pinned["audio"], b["audio"])
    on = pinned.to("cuda", non_blocking=True)
    assert on["audio"].is_cuda and torch.equal(on["text"].cpu(), b["text"]) and on["audio"].dtype == torch.float32
    (fed,) = take(mixer.make_loader(mixture(corpora), device="cuda"), 1)
    assert fed["audio"].is_cuda and _equal(field_view(fed.to("cpu")), field_view(b))


def test_npy_text_member_and_int16_audio(tmp_path):
    """tokens.npy transcripts and int16 PCM audio fields, with a Field casting int16 -> float32."""
    key = "only"
    sample = {"__key__": key, "wav": encode(pcm(key, 777), "WAV"), "tokens.npy": text_tokens(key, 5)}
    pattern = write_samples(tmp_path, "one", [[sample]])
    src = mixer.Source("one", pattern, decode=mixer.SpeechDecode(dtype="int16"), length="audio")
    mix = mixer.Mixture(
        [src],
        batching=mixer.TokenBudget(max_tokens=1000),
        fields={"audio": mixer.Field("float32"), "text": mixer.Field("int64")},
        stop="all_exhausted",
    )
    (b,) = list(mixer.make_loader(mix))
    assert b["audio"][0].tolist() == pcm(key, 777).astype(np.float32).tolist()
    assert b["text"].dtype == torch.int64 and b["text"][0].tolist() == text_tokens(key, 5).tolist()


def frames_decode(raw):
    from mixer.read.decode import decode_npy

    return {"mel": decode_npy(raw["mel.npy"]), "text": decode_npy(raw["text.npy"])}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_two_dimensional_fields_pad_along_time(tmp_path, workers, dtype):
    """Log-mel frames ``[T, 80]`` as one field: the batch holds ``[B, T_max, 80]``, each row's frames
    exact (bfloat16: rounded as torch rounds), the pad after them; lengths count frames."""
    rng = np.random.default_rng(5)
    lengths = lognormal_lengths(60, median=40, sigma=0.6, lo=1, hi=300, seed=8)
    samples = [
        {
            "__key__": f"u{i:03d}",
            "mel.npy": rng.standard_normal((n, 80)).astype(np.float32) * 100,
            "text.npy": np.arange(i % 7 + 1, dtype=np.int32),
        }
        for i, n in enumerate(lengths)
    ]
    pattern = write_samples(tmp_path, "mel", split_evenly(samples, 3))
    fields = {"mel": mixer.Field(dtype, pad=-5.0, feature_shape=(80,)), "text": mixer.Field("int32", pad=-1)}
    mix = mixer.Mixture(
        [mixer.Source("m", pattern, decode=frames_decode)],
        batching=mixer.TokenBudget(max_tokens=2000),
        fields=fields,
        stop="all_exhausted",
    )
    want = {s["__key__"]: torch.from_numpy(s["mel.npy"]).to(getattr(torch, dtype)) for s in samples}
    seen = set()
    for b in mixer.make_loader(mix, num_workers=workers):
        mel = b["mel"]
        assert mel.dtype == getattr(torch, dtype) and mel.ndim == 3 and mel.shape[2] == 80
        assert mel.shape[0] * mel.shape[1] <= 2000 and torch.equal(b.lengths, b["mel_lengths"])
        for i, key in enumerate(b.keys):
            n = int(b["mel_lengths"][i])
            assert n == len(want[key]) and torch.equal(mel[i, :n], want[key]), key
            assert torch.all(mel[i, n:] == -5.0)
            seen.add(key)
    assert seen == set(want)


def test_bfloat16_bits_round_as_torch_does():
    from mixer.spec.dtypes import bfloat16_bits

    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
            np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.0e38, 1e-40], dtype=np.float32),
        ]
    )
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bfloat16_bits(values), theirs)
    nan = bfloat16_bits(np.array([np.nan], dtype=np.float32))
    assert torch.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16)).all()


def test_a_frame_of_the_wrong_shape_names_the_sample(tmp_path):
    samples = [{"__key__": "a", "mel.npy": np.zeros((4, 80), np.float32), "text.npy": np.arange(2, dtype=np.int32)}]
    samples.append({"__key__": "b", "mel.npy": np.zeros((4, 64), np.float32), "text.npy": np.arange(2, dtype=np.int32)})
    pattern = write_samples(tmp_path, "bad", [samples])
    mix = mixer.Mixture(
        [mixer.Source("m", pattern, decode=frames_decode)],
        batching=mixer.TokenBudget(max_tokens=1000),
        fields={"mel": mixer.Field("float32", feature_shape=(80,)), "text": mixer.Field()},
    )
    with pytest.raises(
        mixer.SampleError,
        match=r"sample 'b': field 'mel' has shape \(4, 64\), .*feature_shape=\(80,\)\) needs \[length, 80\]",
    ):
        take(mixer.make_loader(mix), 2)


@pytest.mark.parametrize("dtype", ["uint8", "int16"])
def test_small_integer_fields(tmp_path, dtype):
    samples = [
        {"__key__": f"k{i}", "x.npy": (np.arange(i + 1) % 200).astype(dtype), "text.npy": np.arange(1, dtype=np.int32)}
        for i in range(30)
    ]
    pattern = write_samples(tmp_path, "small", [samples])

    def decode(raw):
        from mixer.read.decode import decode_npy

        return {"x": decode_npy(raw["x.npy"]), "text": decode_npy(raw["text.npy"])}

    mix = mixer.Mixture(
        [mixer.Source("s", pattern, decode=decode)],
        batching=mixer.TokenBudget(max_tokens=256),
        fields={"x": mixer.Field(dtype, pad=255 if dtype == "uint8" else -1), "text": mixer.Field()},
        stop="all_exhausted",
    )
    got = {}
    for b in mixer.make_loader(mix):
        assert b["x"].dtype == getattr(torch, dtype)
        for i, key in enumerate(b.keys):
            got[key] = b["x"][i, : int(b["x_lengths"][i])].tolist()
    assert got == {s["__key__"]: s["x.npy"].tolist() for s in samples}
