"""Throughput of reading and mixing the same web/code/books shards, seven ways, in one run (issue 2).

Methods (alternating within each round, order rotated per round):

* `raw` — read every shard's bytes (1 MiB `readinto`): the I/O ceiling.
* `wds` — plain `webdataset.WebDataset(urls, shardshuffle=False)` over all shards, `.map(decode)` of
  `tokens.npy`; `decode` is the same cheap header-parse + `np.frombuffer` as in every baseline
  (`--decode np.load` for `np.load(io.BytesIO(...))`).
* `randommix` — the pipeline a user writes today: one `WebDataset(...).map(decode).repeat()` per
  source, `wds.RandomMix(datasets, probs=[0.6, 0.3, 0.1])`, `wds.batched(32)` with a pad-to-max int64
  collate, in a `DataLoader(batch_size=None, num_workers=0)`. RandomMix draws *samples* with these
  probabilities (from the global `random`, seeded 0 before each run), so the realized *token* share is
  far from the target: that is part of what it costs a user. No shuffle buffer (it would only slow it).
* `randommix_tokprobs`: the same with probs corrected to token shares (p_i ∝ w_i / mean length_i, from
  the shard set's true mean lengths), so that it delivers the same mixture as the mixer: the
  like-for-like peer. With probs 0.6/0.3/0.1 RandomMix serves mostly long books samples (~1200 tokens
  per sample instead of ~490), which flatters its tokens/s while missing the target mixture.
* `mixer_reader` — `mixer.tario.read_samples` + `mixer.decode.default_tokens` over all shards.
* `mixer` — `mixer.Mixture(..., TokenBudget(65536), seed=0)` through `mixer.make_loader(num_workers=0)`,
  stop="never" (default), stopped after the same number of real tokens as `randommix`.
* `mixer_all_exhausted` — the same with stop="all_exhausted": one pass over everything.
* `torchdata`, `torchdata_tokprobs`, `mixer_w1`, `mixer_w2` — see `benchmarks/peers.py`.

Mixing methods stop after `--budget` x (all tokens in the shard set) real tokens; readers read every
shard once and must see every sample. Beside each wall-clock ratio the checks give the same ratio per
CPU-second, which a noisy neighbour disturbs much less.
"""

from __future__ import annotations

import argparse
import random
import warnings
from collections.abc import Callable

import numpy as np

from . import common, peers
from .common import Method, ShardSet, Tally

# the baselines' cheap decode yields read-only views; torch warns once when wrapping them (harmless here:
# the collate only reads them)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

NAME = "throughput"
BATCH_SIZE = 32
MAX_TOKENS = 65_536
METHODS = ("raw", "wds", "randommix", "randommix_tokprobs", "mixer_reader", "mixer", "mixer_all_exhausted", *peers.METHODS)


# --------------------------------------------------------------------------------------------------
# baselines


def raw_read(shards: ShardSet) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        buf = bytearray(1 << 20)
        total = 0
        for url in shards.urls:
            with open(url, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        tally.bytes = total
        tally.add_samples(shards.samples, shards.tokens)  # "equivalent": what those bytes carry

    return run


def _expect_everything(tally: Tally, shards: ShardSet, samples: int, tokens: int, who: str) -> None:
    if (samples, tokens) != (shards.samples, shards.tokens):
        raise RuntimeError(
            f"{who} read {samples:,} samples / {tokens:,} tokens, the shards hold "
            f"{shards.samples:,} / {shards.tokens:,}"
        )
    tally.add_samples(samples, tokens)


def wds_plain(shards: ShardSet, decode: Callable[[bytes], np.ndarray]) -> Callable[[Tally], None]:
    import webdataset as wds

    def tokens_of(sample: dict) -> np.ndarray:
        return decode(sample["tokens.npy"])

    def run(tally: Tally) -> None:
        dataset = wds.WebDataset(shards.urls, shardshuffle=False).map(tokens_of)
        n = t = 0
        for toks in dataset:
            n += 1
            t += len(toks)
        _expect_everything(tally, shards, n, t, "webdataset")

    return run


def pad_collate(samples: list[tuple[np.ndarray, int]]):
    """Pad-to-max collate as a user writes it: one int64 [B, max_len] tensor, plus lengths and source."""
    import torch

    lengths = [len(toks) for toks, _ in samples]
    out = torch.zeros(len(samples), max(lengths), dtype=torch.int64)
    for i, (toks, _) in enumerate(samples):
        out[i, : len(toks)] = torch.from_numpy(toks)
    return out, torch.tensor(lengths), torch.tensor([src for _, src in samples])


def randommix_loader(shards: ShardSet, decode: Callable[[bytes], np.ndarray], probs: list[float]):
    import torch
    import webdataset as wds

    def tagger(index: int) -> Callable[[dict], tuple[np.ndarray, int]]:
        def tag(sample: dict) -> tuple[np.ndarray, int]:
            return decode(sample["tokens.npy"]), index  # the source index is kept only to measure shares

        return tag

    datasets = [
        wds.WebDataset(list(src.urls), shardshuffle=False).map(tagger(i)).repeat()
        for i, src in enumerate(shards.sources)
    ]
    mix = wds.RandomMix(datasets, probs=probs)
    pipeline = wds.DataPipeline(mix, wds.batched(BATCH_SIZE, collation_fn=pad_collate))
    return torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=0)


def randommix(shards: ShardSet, decode: Callable[[bytes], np.ndarray], probs: list[float], budget: int):
    def run(tally: Tally) -> None:
        random.seed(0)  # RandomMix draws from the global `random`
        for tokens, lengths, source in randommix_loader(shards, decode, probs):
            tally.add_batch(lengths.numpy(), source.numpy(), tokens.numel())
            if tally.tokens >= budget:
                break

    return run


# --------------------------------------------------------------------------------------------------
# the mixer


def mixer_reader(shards: ShardSet) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        from mixer.decode import default_tokens
        from mixer.tario import read_samples

        n = t = 0
        for url in shards.urls:
            with open(url, "rb") as stream:
                for sample in read_samples(stream, url=url):
                    toks = default_tokens(sample)
                    n += 1
                    t += len(toks)
        _expect_everything(tally, shards, n, t, "mixer reader")

    return run


def make_mixture(shards: ShardSet, **kwargs):
    import mixer

    sources = [mixer.Source(s.name, s.pattern, weight=s.weight) for s in shards.sources]
    return mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens=MAX_TOKENS), seed=0, **kwargs)


def consume_mixer(loader, tally: Tally, budget: int | None) -> None:
    """Tally batches until `budget` real tokens (None: until the loader ends)."""
    for batch in loader:
        tally.add_batch(batch.lengths.numpy(), batch.source.numpy(), batch.tokens.numel())
        if budget is not None and tally.tokens >= budget:
            break


def mixer_e2e(shards: ShardSet, budget: int) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        import mixer

        loader = mixer.make_loader(make_mixture(shards), num_workers=0)
        consume_mixer(loader, tally, budget)

    return run


def mixer_all_exhausted(shards: ShardSet) -> Callable[[Tally], None]:
    cap = 3 * shards.tokens

    def run(tally: Tally) -> None:
        import mixer

        loader = mixer.make_loader(make_mixture(shards, stop="all_exhausted"), num_workers=0)
        consume_mixer(loader, tally, cap)
        if tally.tokens >= cap:
            raise RuntimeError(f"stop='all_exhausted' still running after {cap:,} tokens (3x the data)")
        if (tally.samples, tally.tokens) != (shards.samples, shards.tokens):
            tally.note(
                f"one pass delivered {tally.samples:,}/{shards.samples:,} samples, "
                f"{tally.tokens:,}/{shards.tokens:,} tokens"
            )

    return run


# --------------------------------------------------------------------------------------------------


def build_methods(shards: ShardSet, opts: argparse.Namespace) -> list[Method]:
    decode = common.DECODERS[opts.decode]
    budget = int(opts.budget * shards.tokens)
    probs = [s.weight for s in shards.sources]
    mean = np.array([s.mean_length for s in shards.sources])
    tokprobs = (np.array(probs) / mean / (np.array(probs) / mean).sum()).tolist()
    api = common.missing("mixer", "Source", "Mixture", "TokenBudget", "make_loader")
    reader = common.missing("mixer.tario", "read_samples") or common.missing("mixer.decode", "default_tokens")
    budget_note = f"stops at {budget / 1e6:.1f}M real tokens"
    table = {
        "raw": Method("raw", "raw byte read (ceiling)", raw_read(shards), kind="raw"),
        "wds": Method(
            "wds",
            "webdataset.WebDataset",
            wds_plain(shards, decode),
            kind="read",
            note=f"decode: {opts.decode}",
        ),
        "randommix": Method(
            "randommix",
            "wds RandomMix + batched(32) + pad collate",
            randommix(shards, decode, probs, budget),
            note=f"probs {'/'.join(f'{p:g}' for p in probs)} (per sample); decode: {opts.decode}; {budget_note}",
        ),
        "randommix_tokprobs": Method(
            "randommix_tokprobs",
            "wds RandomMix (token-corrected probs)",
            randommix(shards, decode, tokprobs, budget),
            note=f"probs {'/'.join(f'{p:.3f}' for p in tokprobs)} (w / mean length); decode: {opts.decode}; {budget_note}",
        ),
        "mixer_reader": Method(
            "mixer_reader",
            "mixer reader (tario + default_tokens)",
            mixer_reader(shards),
            kind="read",
            skip=reader,
        ),
        "mixer": Method(
            "mixer",
            "mixer, num_workers=0",
            mixer_e2e(shards, budget),
            skip=api,
            note=f"TokenBudget({MAX_TOKENS}); stop=never; {budget_note}",
        ),
        "mixer_all_exhausted": Method(
            "mixer_all_exhausted",
            "mixer, num_workers=0, stop=all_exhausted",
            mixer_all_exhausted(shards),
            skip=api,
            note=f"TokenBudget({MAX_TOKENS}); one pass",
        ),
    }
    table.update(peers.methods(shards, opts, budget, BATCH_SIZE, MAX_TOKENS))  # issue 7: torchdata, 1-2 workers
    return common.select_methods("throughput", table, opts.methods or list(METHODS))


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    methods = build_methods(shards, opts)
    window = opts.window_tokens
    outcomes = common.run_rounds(methods, opts.rounds, shards.weights, window, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in methods]
    get = outcomes.get
    by = {r["method"]: r for r in rows}
    mixer_row = by.get("mixer", {})
    checks = [
        common.ratio_check(NAME, "mixer reader / webdataset, samples/s", get("mixer_reader"), get("wds"), "samples_per_s", 3.0),
        common.ratio_check(NAME, "mixer / RandomMix pipeline, real tokens/s", get("mixer"), get("randommix"), "tokens_per_s", 3.0),
        common.value_check(NAME, "mixer padding efficiency", mixer_row.get("pad_eff"), 0.95),
        common.value_check(
            NAME,
            f"mixer worst windowed token-share error (windows of {window / 1e6:g}M tokens)",
            mixer_row.get("window_err"),
            0.005,
            "<=",
        ),
        common.ratio_check(
            NAME,
            "mixer / RandomMix (token-corrected probs), real tokens/s",
            get("mixer"),
            get("randommix_tokprobs"),
            "tokens_per_s",
            3.0,
        ),
        common.ratio_check(
            NAME, "mixer reader / webdataset, samples per CPU-s", get("mixer_reader"), get("wds"), "samples_per_cpu_s", None
        ),
        common.ratio_check(
            NAME, "mixer / RandomMix pipeline, real tokens per CPU-s", get("mixer"), get("randommix"), "tokens_per_cpu_s", None
        ),
        common.ratio_check(
            NAME,
            "mixer / RandomMix (token-corrected probs), real tokens per CPU-s",
            get("mixer"),
            get("randommix_tokprobs"),
            "tokens_per_cpu_s",
            None,
        ),
        common.ratio_check(NAME, "webdataset / raw read, samples/s", get("wds"), get("raw"), "samples_per_s", None),
        common.ratio_check(NAME, "mixer reader / raw read, samples/s", get("mixer_reader"), get("raw"), "samples_per_s", None),
        common.ratio_check(NAME, "mixer / RandomMix pipeline, samples/s", get("mixer"), get("randommix"), "samples_per_s", None),
        *peers.checks(NAME, get, by, window),
    ]
    config = {
        "profile": opts.profile,
        "rounds": opts.rounds,
        "decode": opts.decode,
        "budget_tokens": int(opts.budget * shards.tokens),
        "window_tokens": window,
        "targets": shards.weights.tolist(),
        "sources": [
            {"name": s.name, "weight": s.weight, "samples": s.samples, "tokens": s.tokens, "shards": len(s.urls), "bytes": s.bytes}
            for s in shards.sources
        ],
        "shards": shards.describe(),
    }
    return common.BenchResult(NAME, rows, checks, config)
