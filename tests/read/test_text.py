"""Raw text with a real tokenizer (`mixer.TextDecode`): a byte-level BPE trained here with `tokenizers`
on the test corpus (no download). Every expectation is recomputed from the tokenizer itself."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import warnings

import numpy as np
import pytest
import textutil
import tokenizers  # noqa: F401 (the 'text' extra; without it this module fails, it is not skipped)
from resume_oracle import assert_resumes_exactly, batch_view, take
from textutil import EOS, expected, reassemble, write_text_shards

import mixer
from mixer.read import decode as decode_module
from mixer.read.counters import Counters
from mixer.read.text import MEASURE_CHARS, TextDecode

CHUNK = 96  # TextDecode(max_length=...): the long documents make a dozen chunks and more
BUDGET = mixer.TokenBudget(max_tokens=1024, max_length=256)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources: 'web' (txt, 3 shards, every 9th document ~40x longer than the rest) and 'news'
    (json:text, 2 shards), and a BPE trained on both."""
    folder = tmp_path_factory.mktemp("text")
    web = textutil.documents(90, median_words=25, sigma=0.6, seed=1, long_every=9)
    news = textutil.documents(50, median_words=40, sigma=0.4, seed=2)
    tok = textutil.train_tokenizer(web + news)
    web_pattern, web_texts = write_text_shards(folder, "web", [web[:30], web[30:60], web[60:]])
    news_pattern, news_texts = write_text_shards(folder, "news", [news[:25], news[25:]], member="json", extra={"id": 1})
    return {
        "tok": tok,
        "eos": tok.token_to_id(EOS),
        "folder": folder,
        "web": (web_pattern, web_texts),
        "news": (news_pattern, news_texts),
    }


def sources(corpus, *, weights=(0.7, 0.3), max_length=CHUNK, **options):
    tok = corpus["tok"]
    return [
        mixer.Source(
            "web",
            corpus["web"][0],
            weight=weights[0],
            decode=TextDecode(tok, eos=EOS, max_length=max_length),
            **options,
        ),
        mixer.Source(
            "news",
            corpus["news"][0],
            weight=weights[1],
            decode=TextDecode(tok, field="json:text", eos=EOS, max_length=max_length),
            **options,
        ),
    ]


def delivered(batches):
    """``{key: tokens}`` of every sample of ``batches``; a key delivered twice fails."""
    out: dict[str, np.ndarray] = {}
    for b in batches:
        for i, key in enumerate(b.keys):
            assert key not in out, f"{key} delivered twice"
            out[key] = b.tokens[i, : int(b.lengths[i])].numpy().astype(np.int64)
    return out


# ---- chunks: nothing truncated, every token once ------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_token_of_every_document_is_delivered_exactly_once_in_chunks(corpus, num_workers):
    mix = mixer.Mixture(sources(corpus), batching=BUDGET, stop="all_exhausted", shuffle_buffer=16, seed=3)
    batches = list(mixer.make_loader(mix, num_workers=num_workers))
    got = delivered(batches)
    assert max(len(t) for t in got.values()) <= CHUNK
    docs = reassemble(got)
    texts = {**corpus["web"][1], **corpus["news"][1]}
    assert sorted(docs) == sorted(texts)
    for key, text in texts.items():
        assert np.array_equal(docs[key], expected(corpus["tok"], text, corpus["eos"])), key
    # the long documents were cut, not truncated: their chunks carry "#k" and are counted as split
    cut = {k for k in texts if len(expected(corpus["tok"], texts[k], corpus["eos"])) > CHUNK}
    assert len(cut) >= 10 and {k.rpartition("#")[0] for k in got if "#" in k} == cut
    if num_workers == 0:
        last = np.asarray(batches[-1].meta.counters)
        split, truncated = (Counters.FIELDS.index(f) for f in ("split", "truncated"))
        assert last[:, truncated].tolist() == [0, 0]
        assert int(last[:, split].sum()) == len(cut)


def test_chunks_default_to_the_batchings_longest_sample(corpus):
    mix = mixer.Mixture(sources(corpus, max_length=None), batching=BUDGET, stop="all_exhausted", seed=1)
    got = delivered(mixer.make_loader(mix))
    assert max(len(t) for t in got.values()) == BUDGET.longest  # full chunks of 256 tokens
    texts = {**corpus["web"][1], **corpus["news"][1]}
    docs = reassemble(got)
    assert all(np.array_equal(docs[k], expected(corpus["tok"], t, corpus["eos"])) for k, t in texts.items())


def test_token_shares_between_text_sources_follow_the_targets(corpus):
    mix = mixer.Mixture(sources(corpus, weights=(0.75, 0.25)), batching=BUDGET, seed=5, shuffle_buffer=32)
    tokens = np.zeros(2)
    for b in take(mixer.make_loader(mix), 400):
        np.add.at(tokens, b.source.numpy(), b.lengths.numpy())
        # every row is the tokenizer's own tokens of a document (or a chunk of it)
        for i, key in enumerate(b.keys[:2]):
            doc = key.rpartition("#")[0] or key
            text = {**corpus["web"][1], **corpus["news"][1]}[doc]
            row = b.tokens[i, : int(b.lengths[i])].numpy()
            full = expected(corpus["tok"], text, corpus["eos"])
            k = int(key.rpartition("#")[2]) if "#" in key else 0
            assert np.array_equal(row, full[k * CHUNK : (k + 1) * CHUNK])
    share = tokens / tokens.sum()
    # the deficit selector keeps the realized share within a batch's worth of tokens of the target
    assert np.abs(share - [0.75, 0.25]).max() <= BUDGET.max_tokens / tokens.sum(), share


# ---- exact resume mid-document ----------------------------------------------------------------


def straddling(reference, cut):
    """Documents some of whose chunks were delivered before batch ``cut`` and some after."""
    before = {k.rpartition("#")[0] for b in reference[:cut] for k in b[0] if "#" in k}
    after = {k.rpartition("#")[0] for b in reference[cut:] for k in b[0] if "#" in k}
    return before & after


@pytest.mark.parametrize(
    "num_workers, mix_mode, batching",
    [
        (0, "batch", BUDGET),
        (2, "batch", BUDGET),
        (0, "sample", mixer.Packed(max_tokens=512, seq_len=128, split_documents=True)),
    ],
)
def test_resume_mid_document_is_exact(corpus, num_workers, mix_mode, batching):
    mix = mixer.Mixture(sources(corpus), batching=batching, mix=mix_mode, seed=7, shuffle_buffer=12, state_every=4)

    def make():
        return mixer.make_loader(mix, num_workers=num_workers)

    reference = [batch_view(b) for b in take(make(), 70)]
    cuts = [c for c in range(3, 60) if straddling(reference, c)]
    assert len(cuts) >= 10, "the corpus should cut documents across batches"
    cuts = cuts[:: max(1, len(cuts) // 6)]
    assert_resumes_exactly(make, cuts=cuts, window=10, view=batch_view, reference=reference)


# ---- the default byte decode on txt --------------------------------------------------------------


@pytest.mark.parametrize("looked", [True, False], ids=["profiled", "stream-only"])
def test_the_default_decode_warns_once_that_txt_is_read_as_bytes(corpus, monkeypatch, looked):
    monkeypatch.setattr(decode_module, "TXT_WARNED", False)
    # stream-only: a given size and explicit buckets, so the up-front look reads nothing
    options = {} if looked else {"size": 1e5}
    # no sample is cut (none is over 16 KiB): in the stream every one goes through the compiled fast lane
    budget = mixer.TokenBudget(max_tokens=16384, buckets=None if looked else [1024, 16384])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mix = mixer.Mixture([mixer.Source("web", corpus["web"][0], **options)], batching=budget)
        batches = take(mixer.make_loader(mix), 10)
    texts = [str(w.message) for w in seen if "reads the 'txt' member as UTF-8 bytes" in str(w.message)]
    assert len(texts) == 1, texts
    assert "mixer.TextDecode" in texts[0] and corpus["web"][0].split("{")[0] in texts[0]
    assert batches[0].tokens.max() < 256  # bytes, as it says


def test_text_decode_sources_do_not_warn(corpus, monkeypatch):
    monkeypatch.setattr(decode_module, "TXT_WARNED", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        take(mixer.make_loader(mixer.Mixture(sources(corpus), batching=BUDGET)), 5)
    assert [str(w.message) for w in seen] == []


# ---- fields: json extraction errors ---------------------------------------------------------------

BAD = {
    "missing key": ({"json": json.dumps({"body": "x"}).encode()}, "has no key 'text'"),
    "invalid json": ({"json": b"{not json"}, "is not valid JSON"),
    "not a string": ({"json": json.dumps({"text": [1, 2]}).encode()}, "holds a list, not a string"),
    "no member": ({"txt": b"plain"}, "no member 'json'"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("where", ["up-front look", "stream"])
def test_json_field_errors_name_the_source_shard_and_key(corpus, tmp_path, case, where):
    members, says = BAD[case]
    good = [{"__key__": f"ok-{i}", "json": json.dumps({"text": "fine words"}).encode()} for i in range(4)]
    pattern = textutil.write_samples(tmp_path, "bad", [[*good[:2], {"__key__": "broken-7", **members}, *good[2:]]])
    decode = TextDecode(corpus["tok"], field="json:text", eos=EOS)
    budget = BUDGET if where == "up-front look" else mixer.TokenBudget(max_tokens=1024, buckets=[64, 256])
    size = None if where == "up-front look" else 100.0
    with pytest.raises(mixer.SampleError) as err:
        mix = mixer.Mixture([mixer.Source("news", pattern, decode=decode, size=size)], batching=budget)
        take(mixer.make_loader(mix), 5)
    message = str(err.value)
    assert message.startswith("source 'news': shard ") and "bad-000000.tar" in message, message
    assert "key 'broken-7'" in message and says in message, message
    # under on_error="skip" the sample is skipped and counted, and the others are delivered
    mix = mixer.Mixture(
        [mixer.Source("news", pattern, decode=decode, size=100.0, on_error="skip")],
        batching=mixer.TokenBudget(max_tokens=1024, buckets=[64, 256]),
        stop="all_exhausted",
    )
    with pytest.warns(RuntimeWarning, match="broken-7"):
        batches = list(mixer.make_loader(mix))
    assert sorted(k for b in batches for k in b.keys) == [f"ok-{i}" for i in range(4)]
    assert batches[-1].meta.counters[0][Counters.FIELDS.index("skipped_samples")] == 1


def test_field_and_token_options_are_checked_at_construction(corpus):
    tok = corpus["tok"]
    for field in ("", "json:", ":text", "json:a..b", 3):
        with pytest.raises(mixer.ConfigError, match="TextDecode.field"):
            TextDecode(tok, field=field)
    with pytest.raises(mixer.ConfigError, match="TextDecode.eos: the tokenizer has no token '<end>'"):
        TextDecode(tok, eos="<end>")
    with pytest.raises(mixer.ConfigError, match="TextDecode.bos: must be <= "):
        TextDecode(tok, bos=10**6)
    with pytest.raises(mixer.ConfigError, match="TextDecode.max_length"):
        TextDecode(tok, max_length=0)
    with pytest.raises(mixer.ConfigError, match="tokenizers.Tokenizer, a transformers fast tokenizer"):
        TextDecode(object())
    with pytest.raises(AttributeError, match="TextDecode is frozen"):
        TextDecode(tok).eos = 3  # type: ignore[misc]
    src = mixer.Source("web", corpus["web"][0], decode=TextDecode(tok), length=lambda raw: 1)
    with pytest.raises(mixer.ConfigError, match="source 'web': a TextDecode source's samples are chunks"):
        mixer.Mixture([src], batching=BUDGET)


def test_nested_json_keys_bos_and_the_tokenizers_own_special_tokens(corpus, tmp_path):
    from tokenizers import processors

    tok = corpus["tok"]
    raw = {"__key__": "k", "__url__": "u", "json": json.dumps({"meta": {"body": "words and words"}}).encode()}
    ids = tok.encode("words and words", add_special_tokens=False).ids
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id(EOS)
    assert TextDecode(tok, field="json:meta.body", bos="<bos>", eos=eos)(raw).tolist() == [bos, *ids, eos]
    templated = textutil.train_tokenizer(["words and words"] * 5)
    templated.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    out = TextDecode(templated, field="json:meta.body", add_special_tokens=True)(raw).tolist()
    assert out == templated.encode("words and words").ids and out[0] == 1


# ---- pickling, processes, other tokenizer spellings --------------------------------------------------


def _decode_in_child(decode: TextDecode, raw: dict) -> tuple[list[int], str | None]:
    return decode(raw).tolist(), os.environ.get("TOKENIZERS_PARALLELISM")


def test_text_decode_pickles_as_json_and_rebuilds_its_tokenizer_in_another_process(corpus):
    decode = TextDecode(corpus["tok"], field="json:text", eos=EOS, max_length=64)
    raw = {"__key__": "k", "__url__": "u", "json": json.dumps({"text": "some words here"}).encode()}
    copy = pickle.loads(pickle.dumps(decode))
    assert copy == decode and repr(copy) == repr(decode) and copy._tokenizer is None
    assert copy(raw).tolist() == decode(raw).tolist()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        tokens, parallelism = pool.apply(_decode_in_child, (decode, raw))
    assert tokens == decode(raw).tolist()
    assert parallelism == "false"  # a process of several: the tokenizer's own threads are off there


def test_a_mixture_with_text_sources_pickles(corpus):
    mix = mixer.Mixture(sources(corpus), batching=BUDGET, seed=2)
    again = pickle.loads(pickle.dumps(mix))
    assert again.fingerprint == mix.fingerprint
    assert [batch_view(b)[0] for b in take(mixer.make_loader(again), 5)] == [
        batch_view(b)[0] for b in take(mixer.make_loader(mix), 5)
    ]


@pytest.mark.timeout(120)
def test_workers_forked_after_the_tokenizer_used_its_threads_do_not_deadlock(corpus, monkeypatch):
    # With TOKENIZERS_PARALLELISM=true and the thread pool started in this process, a forked child
    # that tokenizes a batch hangs for ever (the pool's threads did not survive the fork); TextDecode
    # turns the pool off in every process but its own.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    texts = list(corpus["web"][1].values())
    corpus["tok"].encode_batch(texts * 4)
    mix = mixer.Mixture(sources(corpus), batching=BUDGET, stop="all_exhausted", seed=4)
    got = delivered(mixer.make_loader(mix, num_workers=2))
    assert len(reassemble(got)) == len(corpus["web"][1]) + len(corpus["news"][1])
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"  # this process's setting is left alone


def test_transformers_fast_tokenizers_and_tokenizer_files_are_accepted(corpus, tmp_path):
    tok = corpus["tok"]

    class FastTokenizer:  # what the decode uses of transformers' PreTrainedTokenizerFast
        backend_tokenizer = tok
        eos_token_id = tok.token_to_id(EOS)

    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    raw = {"__key__": "k", "__url__": "u", "txt": b"some words and more words"}
    decodes = [TextDecode(t, eos=EOS) for t in (tok, FastTokenizer(), str(path), path)]
    assert len({repr(d) for d in decodes}) == 1
    assert all(d(raw).tolist() == decodes[0](raw).tolist() for d in decodes)


def test_the_fingerprint_follows_the_tokenizer_and_the_options(corpus):
    def fingerprint(tok, **options):
        src = mixer.Source("web", corpus["web"][0], decode=TextDecode(tok, **options), size=1e4)
        return mixer.Mixture([src], batching=mixer.TokenBudget(1024, buckets=[256, 1024])).fingerprint

    other = textutil.train_tokenizer(list(corpus["web"][1].values()), vocab_size=400)
    base = fingerprint(corpus["tok"], eos=EOS)
    assert base == fingerprint(pickle.loads(pickle.dumps(corpus["tok"])), eos=EOS)
    assert (
        len(
            {
                base,
                fingerprint(other, eos=EOS),
                fingerprint(corpus["tok"]),
                fingerprint(corpus["tok"], eos=EOS, max_length=64),
            }
        )
        == 4
    )


# ---- the up-front look --------------------------------------------------------------------------


def test_the_up_front_look_tokenizes_a_small_sample_and_estimates_the_rest(corpus, tmp_path, monkeypatch):
    docs = textutil.documents(900, median_words=60, sigma=0.7, seed=9)
    pattern, texts = write_text_shards(tmp_path, "big", [docs[i::3] for i in range(3)])
    counted: list[int] = []
    count, encode = TextDecode.count, TextDecode.encode
    monkeypatch.setattr(TextDecode, "count", lambda self, t: counted.extend(map(len, t)) or count(self, t))
    monkeypatch.setattr(TextDecode, "encode", lambda self, t: pytest.fail("the look called encode_batch"))
    mix = mixer.Mixture([mixer.Source("big", pattern, decode=TextDecode(corpus["tok"], eos=EOS))], batching=BUDGET)
    total_chars = sum(map(len, texts.values()))
    assert sum(counted) <= MEASURE_CHARS < total_chars / 4  # a small sample: the rest is estimated
    monkeypatch.setattr(TextDecode, "encode", encode)
    true = sum(len(expected(corpus["tok"], t, corpus["eos"])) for t in texts.values())
    assert abs(mix.sizes["big"] / true - 1) < 0.1, (mix.sizes, true)
    lengths = mix.profiles[0].lengths
    assert lengths.max() <= BUDGET.longest and len(lengths) >= 900  # chunk lengths, every document read


def test_an_indexed_text_source_reads_nothing_up_front_and_has_exact_sizes(corpus, tmp_path, monkeypatch):
    decode = TextDecode(corpus["tok"], eos=EOS, max_length=CHUNK)
    location = str(tmp_path / "web-index.json.gz")
    source = mixer.Source("web", corpus["web"][0], decode=decode, index=location)
    mixer.build_index(source, location=location)
    monkeypatch.setattr(TextDecode, "count", lambda self, t: pytest.fail("the look tokenized"))
    mix = mixer.Mixture([source], batching=BUDGET)
    true = sum(len(expected(corpus["tok"], t, corpus["eos"])) for t in corpus["web"][1].values())
    assert mix.sizes["web"] == true and mix.profiles[0].origin == "index"
    assert mix.profiles[0].lengths.max() <= CHUNK


def test_an_elastic_resume_delivers_every_chunk_once(corpus):
    """Saved on 1 rank x 2 workers mid-pass (chunks of some documents delivered, others in pools and
    buckets), continued on 2 ranks x 1 worker: every token of every document once over the pass."""

    def loader(rank, world_size, num_workers):
        mix = mixer.Mixture(
            sources(corpus),
            batching=BUDGET,
            stop="all_exhausted",
            seed=11,
            shuffle_buffer=12,
            state_every=3,
            rank=rank,
            world_size=world_size,
        )
        return mixer.make_loader(mix, num_workers=num_workers)

    old = loader(0, 1, 2)
    first = take(old, 9)
    states = json.loads(json.dumps([old.state_dict()]))
    rest = []
    for rank in range(2):
        new = loader(rank, 2, 1)
        new.load_state_dict(states)
        rest += list(new)
    got = delivered(first + rest)
    assert straddling([(b.keys,) for b in first + rest], len(first)), "the cut should fall inside documents"
    docs = reassemble(got)
    texts = {**corpus["web"][1], **corpus["news"][1]}
    assert sorted(docs) == sorted(texts)
    assert all(np.array_equal(docs[k], expected(corpus["tok"], t, corpus["eos"])) for k, t in texts.items())


def test_documents_of_no_tokens_are_dropped_and_counted_not_an_end(corpus, tmp_path):
    # Without eos an empty document has no tokens: a run of them leaves the pool empty, and the
    # stream goes on to the documents after them.
    docs = [""] * 40 + ["last words"] * 3
    pattern, _ = write_text_shards(tmp_path, "empty", [docs])
    src = mixer.Source("empty", pattern, decode=TextDecode(corpus["tok"]))
    mix = mixer.Mixture([src], batching=BUDGET, stop="all_exhausted", shuffle_buffer=0)
    batches = list(mixer.make_loader(mix))
    assert sorted(k for b in batches for k in b.keys) == ["empty-0000-00040", "empty-0000-00041", "empty-0000-00042"]
    assert batches[-1].meta.counters[0][Counters.FIELDS.index("dropped")] == 40


@pytest.mark.parametrize("shuffle_buffer", [1000, 1])
def test_a_text_stream_hands_out_all_of_a_source_epoch_before_the_next(corpus, shuffle_buffer):
    """Without a finite pass, a run of documents tokenized together is of one source-epoch, so the
    chunks of an epoch all leave before any of the next and ``on_epoch`` is called between them
    (the mixing loops close the source's buckets then), shuffled or in order."""
    from mixer.plan.profiling import list_source
    from mixer.plan.world import World
    from mixer.read.counters import Counters
    from mixer.stream.text_stream import make_stream

    source = sources(corpus)[0]
    stream = make_stream(
        list_source(source),
        World(),
        seed=0,
        budget=mixer.TokenBudget(max_tokens=4 * CHUNK, max_length=CHUNK),
        shuffle_buffer=shuffle_buffer,
        finite=False,
        counters=Counters(),
    )
    keys, turns = [], []
    stream.on_epoch = lambda: turns.append(len(keys))
    for _ in range(2000):
        keys.append(next(stream).key)
    n = len(set(keys))
    assert any("#" in k for k in keys) and n > len(corpus["web"][1])  # long documents came in chunks
    assert turns[:3] == [n, 2 * n, 3 * n]
    for e in range(len(keys) // n):
        assert len(set(keys[e * n : (e + 1) * n])) == n
