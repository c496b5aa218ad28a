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
* `mixer_reader` — `mixer.read.tario.read_samples` + `mixer.read.decode.default_tokens` over all shards.
* `mixer` — `mixer.Mixture(..., TokenBudget(65536), seed=0)` through `mixer.make_loader(num_workers=0)`,
  stop="never" (default), stopped after the same number of real tokens as `randommix`.
* `mixer_all_exhausted` — the same with stop="all_exhausted": one pass over everything.
* `torchdata`, `torchdata_tokprobs`, `mixer_w1`, `mixer_w2` — see `benchmarks/peers.py`.
* `raw_pax`, `mixer_reader_pax`, `randommix_tokprobs_pax`, `torchdata_tokprobs_pax`, `mixer_pax` — the
  same on the same samples as `webdataset.ShardWriter` writes them with its defaults (`TarWriter`'s
  float mtime makes Python's tarfile put a PAX header before every member): the shards users have.
  Written once beside the shard set (`shards/<profile>-pax`).

Mixing methods stop after `--budget` x (all tokens in the shard set) real tokens; readers read every
shard once and must see every sample. Beside each wall-clock ratio the checks give the same ratio per
CPU-second, which a noisy neighbour disturbs much less.
"""

from __future__ import annotations

import argparse
import json
import random
import tarfile
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import common, peers
from .common import Method, ShardSet, Tally

# the baselines' cheap decode yields read-only views; torch warns once when wrapping them (harmless here:
# the collate only reads them)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

NAME = "throughput"
BATCH_SIZE = 32
MAX_TOKENS = 65_536
PAX_METHODS = ("raw", "mixer_reader", "randommix_tokprobs", "torchdata_tokprobs", "mixer")
METHODS = (
    "raw",
    "wds",
    "randommix",
    "randommix_tokprobs",
    "mixer_reader",
    "mixer",
    "mixer_all_exhausted",
    *peers.METHODS,
    *(f"{m}_pax" for m in PAX_METHODS),
)


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
        from mixer.read.decode import default_tokens
        from mixer.read.tario import read_samples

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


def mixer_e2e(shards: ShardSet, budget: int, workers: int = 0) -> Callable[[Tally], None]:
    """`make_loader(num_workers=workers)` until `budget` real tokens, ended the same way for every
    worker count, so that 0 and N workers are timed alike (`throughput`, `peers` and `cpu_per_sample`
    all use this one): the iterator is closed explicitly (its workers shut down), the exited workers
    are joined (a child's CPU shows in RUSAGE_CHILDREN only then), and no garbage collection is
    forced inside the timing: a full `gc.collect()` walks the process's whole heap (torch alone is
    ~170k objects, ~80 ms here) whatever the loader did, and when only the worker runs paid it, as
    before, it alone added ~0.03-0.06 to their CPU ratio over 0 workers at `--budget 1`, twice that at 0.5."""

    def run(tally: Tally) -> None:
        import mixer

        batches = iter(mixer.make_loader(make_mixture(shards), num_workers=workers))
        try:
            consume_mixer(batches, tally, budget)
            common.record_worker_rss(tally)  # the workers still run: read their peaks now
        finally:
            batches.close()  # type: ignore[attr-defined]  # a generator: Loader.__iter__'s finally shuts the workers down
        alive = common.reap_children()
        if alive:
            tally.note(f"{alive} child process(es) still alive after 60 s: their CPU is not counted")

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
# the same samples as ShardWriter writes them by default (a PAX header before every member)


def pax_shards(shards: ShardSet, log: Callable[[str], None] | None = None) -> ShardSet:
    """`shards` rewritten shard by shard with `webdataset.TarWriter`'s defaults (what `ShardWriter`
    uses): same keys, same member bytes, same shard boundaries; cached in `<root>-pax`, reused while
    every file has its recorded size."""
    import webdataset as wds

    root = shards.root.with_name(shards.root.name + "-pax")
    manifest_path = root / "manifest.json"
    names = [Path(u).name for u in shards.urls]
    try:
        sizes = json.loads(manifest_path.read_text())
        if sorted(sizes) == sorted(names) and all((root / f).stat().st_size == sizes[f] for f in names):
            return _pax_set(shards, root, sizes)
    except (OSError, ValueError, TypeError):
        pass
    if log:
        log(f"writing ShardWriter-default (PAX) copies of {len(names)} shards to {root} (once) ...")
    root.mkdir(parents=True, exist_ok=True)
    for url, name in zip(shards.urls, names):
        with tarfile.open(url) as src, wds.TarWriter(str(root / name)) as sink:
            sample: dict[str, object] = {}
            for member in src:
                key, ext = member.name.split(".", 1)
                if sample and sample["__key__"] != key:
                    sink.write(sample)
                    sample = {}
                f = src.extractfile(member)
                assert f is not None, f"{url}: {member.name} is not a file"
                sample["__key__"] = key
                sample[ext] = f.read()
            if sample:
                sink.write(sample)
    with open(root / names[0], "rb") as f:
        if f.read(512)[156:157] != b"x":
            raise RuntimeError(
                f"{root / names[0]}: the first member has no PAX header; TarWriter's default mtime changed?"
            )
    sizes = {f: (root / f).stat().st_size for f in names}
    manifest_path.write_text(json.dumps(sizes, indent=1))
    return _pax_set(shards, root, sizes)


def _pax_set(shards: ShardSet, root: Path, sizes: dict[str, int]) -> ShardSet:
    sources = tuple(
        replace(
            s,
            pattern=s.pattern.replace(str(shards.root), str(root)),
            urls=tuple(str(root / Path(u).name) for u in s.urls),
            bytes=sum(sizes[Path(u).name] for u in s.urls),
        )
        for s in shards.sources
    )
    return replace(shards, root=root, profile=f"{shards.profile}, PAX", sources=sources)


# --------------------------------------------------------------------------------------------------


def build_table(shards: ShardSet, opts: argparse.Namespace) -> dict[str, Method]:
    decode = common.DECODERS[opts.decode]
    budget = int(opts.budget * shards.tokens)
    probs = [s.weight for s in shards.sources]
    mean = np.array([s.mean_length for s in shards.sources])
    tokprobs = (np.array(probs) / mean / (np.array(probs) / mean).sum()).tolist()
    api = common.missing("mixer", "Source", "Mixture", "TokenBudget", "make_loader")
    reader = common.missing("mixer.read.tario", "read_samples") or common.missing("mixer.read.decode", "default_tokens")
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
            note=f"probs {'/'.join(f'{p:.3f}' for p in tokprobs)} (w / mean length); decode: {opts.decode}; "
            f"{budget_note}",
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
    return table


def build_methods(shards: ShardSet, opts: argparse.Namespace, pax: ShardSet | None = None) -> list[Method]:
    table = build_table(shards, opts)
    if pax is not None:  # issue 17: the same on ShardWriter-default (PAX) shards
        same = build_table(pax, opts)
        table.update(
            {f"{k}_pax": replace(same[k], name=f"{k}_pax", label=f"{same[k].label} [PAX shards]") for k in PAX_METHODS}
        )
    return common.select_methods("throughput", table, opts.methods or list(METHODS))


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    names = opts.methods or list(METHODS)
    pax = pax_shards(shards, log) if any(n.endswith("_pax") for n in names) else None
    methods = build_methods(shards, opts, pax)
    window = opts.window_tokens
    outcomes = common.run_rounds(methods, opts.rounds, shards.weights, window, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in methods]
    get = outcomes.get
    by = {r["method"]: r for r in rows}
    mixer_row = by.get("mixer", {})
    checks = [
        common.ratio_check(
            NAME, "mixer reader / webdataset, samples/s", get("mixer_reader"), get("wds"), "samples_per_s", 3.0
        ),
        common.ratio_check(
            NAME, "mixer / RandomMix pipeline, real tokens/s", get("mixer"), get("randommix"), "tokens_per_s", 3.0
        ),
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
            NAME,
            "mixer reader / webdataset, samples per CPU-s",
            get("mixer_reader"),
            get("wds"),
            "samples_per_cpu_s",
            None,
        ),
        common.ratio_check(
            NAME,
            "mixer / RandomMix pipeline, real tokens per CPU-s",
            get("mixer"),
            get("randommix"),
            "tokens_per_cpu_s",
            None,
        ),
        common.ratio_check(
            NAME,
            "mixer / RandomMix (token-corrected probs), real tokens per CPU-s",
            get("mixer"),
            get("randommix_tokprobs"),
            "tokens_per_cpu_s",
            5.0,  # issue 17
        ),
        common.ratio_check(NAME, "webdataset / raw read, samples/s", get("wds"), get("raw"), "samples_per_s", None),
        common.ratio_check(
            NAME, "mixer reader / raw read, samples/s", get("mixer_reader"), get("raw"), "samples_per_s", None
        ),
        common.ratio_check(
            NAME, "mixer / RandomMix pipeline, samples/s", get("mixer"), get("randommix"), "samples_per_s", None
        ),
        *peers.checks(NAME, get, by, window),
        *pax_checks(get, by, window),
    ]
    config = {
        "pax_shards": pax.describe() if pax is not None else None,
        "profile": opts.profile,
        "rounds": opts.rounds,
        "decode": opts.decode,
        "budget_tokens": int(opts.budget * shards.tokens),
        "window_tokens": window,
        "targets": shards.weights.tolist(),
        "sources": [
            {
                "name": s.name,
                "weight": s.weight,
                "samples": s.samples,
                "tokens": s.tokens,
                "shards": len(s.urls),
                "bytes": s.bytes,
            }
            for s in shards.sources
        ],
        "shards": shards.describe(),
    }
    return common.BenchResult(NAME, rows, checks, config)


def pax_checks(get: Callable[[str], common.Outcome | None], by: dict[str, dict], window: int) -> list[dict]:
    """Issue 17's targets on ShardWriter-default (PAX) shards."""
    row = by.get("mixer_pax", {})
    return [
        common.ratio_check(
            NAME,
            "PAX shards: mixer / RandomMix (token-corrected), real tokens per CPU-s",
            get("mixer_pax"),
            get("randommix_tokprobs_pax"),
            "tokens_per_cpu_s",
            5.0,
        ),
        common.ratio_check(
            NAME,
            "PAX shards: mixer / torchdata.nodes (token-corrected), real tokens per CPU-s",
            get("mixer_pax"),
            get("torchdata_tokprobs_pax"),
            "tokens_per_cpu_s",
            4.0,
        ),
        common.ratio_check(
            NAME,
            "PAX shards: mixer reader / raw read, CPU-µs/sample",
            get("mixer_reader_pax"),
            get("raw_pax"),
            "cpu_us_per_sample",
            4.0,
            "<=",
        ),
        common.value_check(NAME, "PAX shards: mixer padding efficiency", row.get("pad_eff"), 0.95),
        common.value_check(
            NAME,
            f"PAX shards: mixer worst windowed token-share error (windows of {window / 1e6:g}M tokens)",
            row.get("window_err"),
            0.005,
            "<=",
        ),
    ]
