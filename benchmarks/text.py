"""Raw text through a tokenizer: CPU per delivered token with `mixer.TextDecode` against a hand-written
per-sample decode, at 0 and 2 DataLoader workers, and the up-front look's cost, measured in one run.

Data: three sources of synthetic English-like text (`txt` members; words drawn from a Zipf vocabulary,
sentences, paragraphs): "web" (many short documents), "code" (longer, with a long tail) and "books"
(few, long: every one is longer than a chunk), at token shares 0.6 / 0.3 / 0.1; a byte-level BPE of
4,096 tokens trained on them with `tokenizers` (no download). Both the shards and the tokenizer are
written once under `<bench-dir>/text/<profile>/`.

Methods (each builds its mixture outside the timing, then streams `TokenBudget(16384, max_length=2048)`
batches until the same number of real tokens; CPU is this process plus its waited-for workers):

* ``textdecode_w0`` / ``textdecode_w2``: ``decode=mixer.TextDecode(tokenizer, eos="<eos>")``: runs of
  documents tokenized in one ``encode_batch`` call as they leave the shuffle buffer, long documents
  cut into chunks of at most 2,048 tokens (nothing truncated);
* ``encode_w0`` / ``encode_w2``: the decode a user writes by hand, ``tokenizer.encode(text).ids + [eos]``
  per sample: every sample tokenized as it enters the shuffle buffer, long documents truncated at 2,048
  tokens by the budget (the work on the rest wasted).

A control runs in the same rounds: the same tokenizer work in two forked processes, one after the
other and both at once. On a machine whose cores are shared (SMT siblings, a loaded VM) two busy
processes each take more CPU time for the same work, which a 2-worker loader pays as well; their
ratio is reported, and the workers' ratio is also given over it.

TextDecode also runs to half the tokens: from CPU at both budgets come a marginal price per token
(fixed costs cancel) and the fixed CPU of a run: with 2 workers each worker fills its own length
buckets (about ``num_buckets`` batches of tokens per source) and makes its prefetched batches.

Checks: the 2-worker / 0-worker CPU per token of each (target <= 1.2 for TextDecode: as measured,
marginal, and over the control's ratio), TextDecode against the hand-written decode at each worker count, and the
seconds each mixture's up-front look takes (the hand-written decode's look tokenizes up to 2,048
samples per source; TextDecode's measures tokens per character on 64 Ki characters and estimates the
rest). Every process tokenizes single-threaded (``TOKENIZERS_PARALLELISM=false`` unless set): the
tokenizer's own thread pool in the main process would charge 0 workers for its spinning threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import common
from .common import Method, Tally
from .throughput import consume_mixer

NAME = "text"
MAX_TOKENS = 16384
MAX_LENGTH = 2048
VOCAB = 4096
WORKERS = (0, 2)
# total tokens of the corpus (about); a run streams RUN_SHARE of it
PROFILES = {"full": 8_000_000, "quick": 1_500_000}
RUN_SHARE = 0.75
MANIFEST_VERSION = 1
# name: (token share, median words per document, sigma, shards)
SOURCES = {"web": (0.6, 180, 0.8, 8), "code": (0.3, 500, 1.0, 4), "books": (0.1, 5000, 0.3, 2)}


# --------------------------------------------------------------------------------------------------
# the corpus and the tokenizer


def _words(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1.0 / np.arange(1, 27) ** 0.9
    lens = np.clip(rng.geometric(0.28, size=n), 1, 14)
    chars = rng.choice(letters, size=int(lens.sum()), p=p / p.sum())
    ends = np.cumsum(lens)
    return sorted({"".join(chars[e - k : e]) for e, k in zip(ends, lens)})


def _documents(rng: np.random.Generator, vocab: list[str], counts: np.ndarray) -> list[str]:
    zipf = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    words = np.asarray(vocab)[rng.choice(len(vocab), size=int(counts.sum()), p=zipf / zipf.sum())]
    marks = rng.choice(np.array([" ", " ", " ", " ", " ", " ", " ", ", ", ". ", ".\n\n"]), size=words.size)
    marks[np.cumsum(counts) - 1] = ".\n"
    text = np.char.add(words, marks)
    out, start = [], 0
    for c in counts:
        out.append("".join(text[start : start + c].tolist()).capitalize())
        start += c
    return out


def ensure_corpus(profile: str, bench_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The cached corpus of ``profile``: ``{"root", "tokenizer", "sources": {name: {pattern, docs, chars}}}``."""
    import webdataset as wds

    root = Path(bench_dir) / "text" / profile
    spec = {"version": MANIFEST_VERSION, "profile": profile, "tokens": PROFILES[profile], "sources": SOURCES}
    manifest = root / "manifest.json"
    if manifest.exists():
        try:
            saved = json.loads(manifest.read_text())
            if saved["spec"] == json.loads(json.dumps(spec)):
                return dict(saved, root=str(root))
        except (OSError, ValueError, KeyError):
            pass
    log(f"writing the {profile} text corpus and its tokenizer to {root} (once) ...")
    t0 = time.perf_counter()
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(20240917)
    vocab = _words(rng, 60_000)
    sources: dict[str, Any] = {}
    sample: list[str] = []  # what the tokenizer is trained on: the first web documents
    for name, (share, median, sigma, shards) in SOURCES.items():
        words = share * PROFILES[profile] / 1.3  # ~1.3 tokens per word with this tokenizer
        mean = median * math.exp(sigma**2 / 2)
        n = max(shards, round(words / mean))
        counts = np.clip(np.rint(rng.lognormal(math.log(median), sigma, size=n)), 3, None).astype(np.int64)
        docs = _documents(rng, vocab, counts)
        per = math.ceil(n / shards)
        pattern = str(tmp / f"{name}-%06d.tar")
        with wds.ShardWriter(pattern, maxcount=per, maxsize=1e15, verbose=0, mtime=common.MTIME) as sink:
            for i, doc in enumerate(docs):
                sink.write({"__key__": f"{name}-{i:08d}", "txt": doc})
        last = len(list(tmp.glob(f"{name}-*.tar"))) - 1
        sources[name] = {
            "pattern": f"{name}-{{000000..{last:06d}}}.tar" if last else f"{name}-000000.tar",
            "docs": n,
            "chars": int(sum(map(len, docs))),
        }
        sample = sample or docs[:4000]
    _train_tokenizer(sample, tmp / "tokenizer.json")
    saved = {"spec": spec, "sources": sources, "tokenizer": "tokenizer.json"}
    (tmp / "manifest.json").write_text(json.dumps(saved, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    log(f"wrote the corpus in {time.perf_counter() - t0:.1f} s")
    return dict(saved, root=str(root))


def _train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


# --------------------------------------------------------------------------------------------------
# the two decodes


class PerSampleEncode:
    """The decode a user writes by hand: one ``encode()`` per sample, its ids plus ``eos``."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)
        self.eos = self.tokenizer.token_to_id("<eos>")

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        ids = self.tokenizer.encode(raw["txt"].decode("utf-8")).ids
        ids.append(self.eos)
        return np.asarray(ids, dtype=np.int32)

    def __repr__(self) -> str:
        return "PerSampleEncode()"


def make_mixture(corpus: dict[str, Any], decode: str) -> Any:
    import mixer

    path = str(Path(corpus["root"]) / corpus["tokenizer"])
    dec = mixer.TextDecode(path, eos="<eos>") if decode == "textdecode" else PerSampleEncode(path)
    sources = [
        mixer.Source(name, str(Path(corpus["root"]) / s["pattern"]), weight=SOURCES[name][0], decode=dec)
        for name, s in corpus["sources"].items()
    ]
    return mixer.Mixture(sources, batching=mixer.TokenBudget(MAX_TOKENS, max_length=MAX_LENGTH), seed=0)


def stream(mixture: Any, budget: int, workers: int) -> Callable[[Tally], None]:
    """`make_loader(num_workers=workers)` over a mixture built beforehand, until `budget` real tokens,
    ended as `throughput.mixer_e2e` ends it (iterator closed, exited workers joined)."""

    def run(tally: Tally) -> None:
        import mixer

        batches = iter(mixer.make_loader(mixture, num_workers=workers))
        try:
            consume_mixer(batches, tally, budget)
        finally:
            batches.close()  # type: ignore[attr-defined]
        alive = common.reap_children()
        if alive:
            tally.note(f"{alive} child process(es) still alive after 60 s: their CPU is not counted")

    return run


CONTENTION_CHARS = 6_000_000  # text each of the two processes of the control tokenizes


def _texts(corpus: dict[str, Any], chars: int) -> list[str]:
    """Documents of the corpus, about ``chars`` characters of them, from the first shard of each source."""
    from mixer.read.tario import read_samples

    out: list[str] = []
    share = chars // len(corpus["sources"])
    for name in corpus["sources"]:
        first = Path(corpus["root"]) / f"{name}-000000.tar"
        taken = 0
        with open(first, "rb") as f:
            for raw in read_samples(f, url=str(first)):
                out.append(raw["txt"].decode("utf-8"))
                taken += len(out[-1])
                if taken >= share:
                    break
    return out


def contention(corpus: dict[str, Any], concurrent: bool) -> Callable[[Tally], None]:
    """The machine's control: the same tokenizer work (runs of 32 texts through ``encode_batch``) in
    two forked processes, one after the other or both at once. Where cores are shared (SMT siblings,
    a loaded VM) two busy processes each take more CPU time for the same work; the ratio of the two
    is that inflation, measured in the same run as the loaders, which a 2-worker loader pays too."""
    texts = _texts(corpus, CONTENTION_CHARS)

    def run(tally: Tally) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(corpus["root"]) / corpus["tokenizer"]))
        pids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:  # a child: tokenize, exit
                for i in range(0, len(texts), 32):
                    tok.encode_batch_fast(texts[i : i + 32])
                os._exit(0)
            if concurrent:
                pids.append(pid)
            else:
                os.waitpid(pid, 0)
        for pid in pids:
            os.waitpid(pid, 0)
        tally.add_samples(2 * len(texts), 0)

    return run


class Corpus:
    """What `common.summarize` reads of a shard set: the target shares."""

    def __init__(self, corpus: dict[str, Any]) -> None:
        self.corpus = corpus
        w = np.array([SOURCES[n][0] for n in corpus["sources"]], dtype=np.float64)
        self.weights = w / w.sum()

    def describe(self) -> str:
        return "; ".join(
            f"{n} {s['docs']:,} docs / {s['chars'] / 1e6:.1f}M chars" for n, s in self.corpus["sources"].items()
        )


HALF = "_half"  # methods run to half the tokens: CPU at both budgets splits a marginal and a fixed part


def _pairs(full: common.Outcome, half: common.Outcome) -> list[tuple[common.Measurement, common.Measurement]]:
    return [(f, h) for f, h in zip(full.rounds, half.rounds) if f is not None and h is not None and f.tokens > h.tokens]


def _marginal_us(full: common.Outcome, half: common.Outcome) -> list[float]:
    """Per round: CPU-µs per token added between half the tokens and all of them (fixed costs cancel)."""
    return [1e6 * (f.cpu_s - h.cpu_s) / (f.tokens - h.tokens) for f, h in _pairs(full, half)]


def _fixed_s(full: common.Outcome, half: common.Outcome) -> list[float]:
    """Per round: the CPU seconds of the full run that its tokens' marginal price does not explain."""
    return [f.cpu_s - f.tokens * (f.cpu_s - h.cpu_s) / (f.tokens - h.tokens) for f, h in _pairs(full, half)]


def _cpu_per_token(outcome: common.Outcome) -> list[float]:
    return [1e6 * r.cpu_s / r.tokens if r is not None and r.tokens else math.nan for r in outcome.rounds]


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    # The same single-threaded tokenizer in every process: with the tokenizer's own thread pool in
    # the main process, 0 workers would be charged for its threads' spinning (and be faster).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpus = ensure_corpus(opts.profile, opts.bench_dir, log)
    shards = Corpus(corpus)
    log(shards.describe())
    for path in Path(corpus["root"]).glob("*.tar"):
        path.read_bytes()  # warm the page cache
    budget = int(RUN_SHARE * PROFILES[opts.profile])
    looks: dict[str, float] = {}
    mixtures: dict[str, Any] = {}
    for decode in ("textdecode", "encode"):  # the up-front look, timed on its own (the mixture is then reused)
        t0 = time.perf_counter()
        mixtures[decode] = make_mixture(corpus, decode)
        looks[decode] = time.perf_counter() - t0
        log(f"{decode}: up-front look {looks[decode]:.2f} s")
    table = (
        [
            Method(
                f"{decode}_w{w}",
                f"{'mixer.TextDecode' if decode == 'textdecode' else 'per-sample encode()'}, num_workers={w}",
                stream(mixtures[decode], budget, w),
                note=f"TokenBudget({MAX_TOKENS}, max_length={MAX_LENGTH}); stops at {budget / 1e6:.1f}M real tokens; "
                "CPU incl. workers",
            )
            for decode in mixtures
            for w in WORKERS
        ]
        + [
            Method(
                f"textdecode_w{w}{HALF}",
                f"mixer.TextDecode, num_workers={w}, half the tokens",
                stream(mixtures["textdecode"], budget // 2, w),
                note=f"stops at {budget / 2e6:.1f}M real tokens (for the marginal and fixed CPU)",
            )
            for w in WORKERS
        ]
        + [
            Method(
                f"tokenize_{mode}",
                f"control: encode_batch in 2 processes, {mode}",
                contention(corpus, mode == "concurrent"),
                kind="read",
                note=f"{CONTENTION_CHARS / 1e6:.0f}M characters each; CPU of both",
            )
            for mode in ("sequential", "concurrent")
        ]
    )
    outcomes = common.run_rounds(table, opts.rounds, shards.weights, opts.window_tokens, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in table]  # type: ignore[arg-type]
    per_token = {m.name: _cpu_per_token(outcomes[m.name]) for m in table if m.kind == "batched"}
    for row in rows:
        if row["method"] in per_token:
            row["cpu_us_per_token"] = common._median(per_token[row["method"]])

    def ratio(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(per_token[a], per_token[b]) if y > 0 and not math.isnan(x / y)]

    inflation = [
        c.cpu_s / s.cpu_s
        for c, s in zip(outcomes["tokenize_concurrent"].rounds, outcomes["tokenize_sequential"].rounds)
        if c is not None and s is not None and s.cpu_s > 0
    ]
    workers = ratio("textdecode_w2", "textdecode_w0")
    marginal = {w: _marginal_us(outcomes[f"textdecode_w{w}"], outcomes[f"textdecode_w{w}{HALF}"]) for w in WORKERS}
    fixed = {w: _fixed_s(outcomes[f"textdecode_w{w}"], outcomes[f"textdecode_w{w}{HALF}"]) for w in WORKERS}
    checks = [
        *(
            common.values_check(NAME, f"CPU-µs/token, {label}, {w} workers", per_token[f"{name}_w{w}"], None, "<=")
            for name, label in (("textdecode", "TextDecode"), ("encode", "per-sample encode()"))
            for w in WORKERS
        ),
        common.values_check(NAME, "CPU-µs/token, TextDecode, 2 workers / 0 workers", workers, 1.2, "<="),
        common.values_check(
            NAME,
            "marginal CPU-µs/token (half the tokens to all), TextDecode, 2 workers / 0 workers",
            [b / a for a, b in zip(marginal[0], marginal[2]) if a > 0],
            1.2,
            "<=",
        ),
        common.values_check(
            NAME,
            "fixed CPU-s per run, TextDecode, 2 workers minus 0 workers (each worker fills its own buckets)",
            [b - a for a, b in zip(fixed[0], fixed[2])],
            None,
            "<=",
        ),
        common.values_check(
            NAME,
            "CPU-µs/token, per-sample encode(), 2 workers / 0 workers",
            ratio("encode_w2", "encode_w0"),
            None,
            "<=",
        ),
        common.values_check(
            NAME, "control: CPU of 2 tokenizing processes, at once / one after the other", inflation, None, "<="
        ),
        common.values_check(
            NAME,
            "CPU-µs/token, TextDecode, 2 workers / 0 workers, over the control's ratio",
            [r / i for r, i in zip(workers, inflation)],
            1.2,
            "<=",
        ),
        *(
            common.values_check(
                NAME,
                f"CPU-µs/token, TextDecode / per-sample encode(), {w} workers",
                ratio(f"textdecode_w{w}", f"encode_w{w}"),
                None,
                "<=",
            )
            for w in WORKERS
        ),
        common.value_check(NAME, "up-front look seconds, TextDecode", looks["textdecode"], None, "<="),
        common.value_check(NAME, "up-front look seconds, per-sample encode()", looks["encode"], None, "<="),
    ]
    config = {
        "profile": opts.profile,
        "rounds": opts.rounds,
        "budget_tokens": budget,
        "workers": list(WORKERS),
        "targets": shards.weights.tolist(),
        "shards": shards.describe(),
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
    }
    return common.BenchResult(NAME, rows, checks, config)
