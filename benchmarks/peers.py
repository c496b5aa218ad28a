"""The peers and worker counts that issue 7 adds to the `throughput` run (same shards, same rounds).

* `torchdata` — `torchdata.nodes` as its docs compose it: one `IterableWrapper(WebDataset(...).map(decode))`
  node per source, `MultiNodeWeightedSampler(nodes, weights, stop_criteria=CYCLE_FOREVER)`,
  `Batcher(32)`, `Mapper(pad collate)`, `Loader`, in the main process (as the RandomMix pipeline).
  Weights 0.6/0.3/0.1 per *sample*, as a user passes them.
* `torchdata_tokprobs` — the same with weights corrected to token shares (w / mean length).
* `mixer_w1`, `mixer_w2` — the mixer through `make_loader(num_workers=1 / 2)`; the throughput run's
  `mixer` row is the same code (`throughput.mixer_e2e`) with 0 workers. CPU counts the workers
  (joined before the clock stops) and the peak RSS of each worker is read while it runs. Their CPU
  ratio over `mixer` includes the workers' fixed cost per pass, so it grows as `--budget` shrinks:
  `cpu_per_sample` splits the two.

torchdata installs beside torch 2.13 with `pip install --no-deps torchdata==0.11.0` (its other
requirements, requests and urllib3, come with the test extras); without it the rows say so.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import numpy as np

from . import common
from .common import Method, Outcome, ShardSet, Tally

TORCHDATA_VERSION = "0.11.0"
METHODS = ("torchdata", "torchdata_tokprobs", "mixer_w1", "mixer_w2")


def torchdata_missing() -> str | None:
    try:
        import torchdata.nodes as tn
    except Exception as exc:
        return (
            f"torchdata.nodes not importable ({type(exc).__name__}); it installs beside torch 2.13 with "
            f"`pip install --no-deps torchdata=={TORCHDATA_VERSION}`"
        )
    return None if hasattr(tn, "MultiNodeWeightedSampler") else "this torchdata has no nodes.MultiNodeWeightedSampler"


def torchdata_loader(shards: ShardSet, decode: Callable[[bytes], np.ndarray], weights: list[float], batch_size: int):
    import torchdata.nodes as tn
    import webdataset as wds

    from .throughput import pad_collate

    def tagger(index: int) -> Callable[[dict], tuple[np.ndarray, int]]:
        def tag(sample: dict) -> tuple[np.ndarray, int]:
            return decode(sample["tokens.npy"]), index

        return tag

    nodes = {
        src.name: tn.IterableWrapper(wds.WebDataset(list(src.urls), shardshuffle=False).map(tagger(i)))
        for i, src in enumerate(shards.sources)
    }
    mixed = tn.MultiNodeWeightedSampler(
        nodes,
        {src.name: float(w) for src, w in zip(shards.sources, weights)},
        stop_criteria=tn.StopCriteria.CYCLE_FOREVER,
        rank=0,
        world_size=1,
        seed=0,
    )
    return tn.Loader(tn.Mapper(tn.Batcher(mixed, batch_size=batch_size, drop_last=False), pad_collate))


def torchdata_run(
    shards: ShardSet, decode: Callable[[bytes], np.ndarray], weights: list[float], budget: int, batch_size: int
):
    def run(tally: Tally) -> None:
        random.seed(0)
        for tokens, lengths, source in torchdata_loader(shards, decode, weights, batch_size):
            tally.add_batch(lengths.numpy(), source.numpy(), tokens.numel())
            if tally.tokens >= budget:
                break

    return run


def methods(
    shards: ShardSet, opts: argparse.Namespace, budget: int, batch_size: int, max_tokens: int
) -> dict[str, Method]:
    decode = common.DECODERS[opts.decode]
    probs = [s.weight for s in shards.sources]
    mean = np.array([s.mean_length for s in shards.sources])
    tokprobs = (np.array(probs) / mean / (np.array(probs) / mean).sum()).tolist()
    from .throughput import mixer_e2e  # here: throughput imports this module

    td = torchdata_missing()
    api = common.missing("mixer", "Source", "Mixture", "TokenBudget", "make_loader")
    budget_note = f"stops at {budget / 1e6:.1f}M real tokens"
    table = {
        "torchdata": Method(
            "torchdata",
            "torchdata.nodes MultiNodeWeightedSampler + Batcher(32) + pad collate",
            torchdata_run(shards, decode, probs, budget, batch_size),
            skip=td,
            note=f"weights {'/'.join(f'{p:g}' for p in probs)} (per sample); decode: {opts.decode}; {budget_note}",
        ),
        "torchdata_tokprobs": Method(
            "torchdata_tokprobs",
            "torchdata.nodes (token-corrected weights)",
            torchdata_run(shards, decode, tokprobs, budget, batch_size),
            skip=td,
            note=f"weights {'/'.join(f'{p:.3f}' for p in tokprobs)} (w / mean length); decode: {opts.decode}; "
            f"{budget_note}",
        ),
    }
    for w in (1, 2):
        table[f"mixer_w{w}"] = Method(
            f"mixer_w{w}",
            f"mixer, num_workers={w}",
            mixer_e2e(shards, budget, w),
            skip=api,
            note=f"TokenBudget({max_tokens}); stop=never; {budget_note}; CPU incl. workers",
        )
    return table


def checks(bench: str, get: Callable[[str], Outcome | None], by: dict[str, dict], window: int) -> list[dict]:
    mixer_td = common.ratio_check(
        bench, "mixer / torchdata.nodes, real tokens/s", get("mixer"), get("torchdata"), "tokens_per_s", 2.5
    )
    w2 = by.get("mixer_w2", {})
    return [
        mixer_td,
        common.ratio_check(
            bench,
            "mixer / torchdata.nodes (token-corrected), real tokens/s",
            get("mixer"),
            get("torchdata_tokprobs"),
            "tokens_per_s",
            None,
        ),
        common.ratio_check(
            bench,
            "mixer / torchdata.nodes, real tokens per CPU-s",
            get("mixer"),
            get("torchdata"),
            "tokens_per_cpu_s",
            None,
        ),
        common.ratio_check(
            bench,
            "mixer / torchdata.nodes (token-corrected), real tokens per CPU-s",
            get("mixer"),
            get("torchdata_tokprobs"),
            "tokens_per_cpu_s",
            4.0,  # issue 17
        ),
        common.ratio_check(
            bench,
            "CPU-µs/sample, mixer 2 workers / 0 workers",
            get("mixer_w2"),
            get("mixer"),
            "cpu_us_per_sample",
            1.3,
            "<=",
        ),
        common.ratio_check(
            bench,
            "CPU-µs/sample, mixer 1 worker / 0 workers",
            get("mixer_w1"),
            get("mixer"),
            "cpu_us_per_sample",
            None,
            "<=",
        ),
        common.ratio_check(
            bench,
            "wall real tokens/s, mixer 2 workers / 0 workers",
            get("mixer_w2"),
            get("mixer"),
            "tokens_per_s",
            None,
        ),
        common.value_check(bench, "mixer 2 workers padding efficiency", w2.get("pad_eff"), 0.95),
        common.value_check(
            bench,
            f"mixer 2 workers worst windowed token-share error (windows of {window / 1e6:g}M tokens)",
            w2.get("window_err"),
            0.005,
            "<=",
        ),
        common.ratio_check(
            bench,
            "torchdata.nodes / RandomMix pipeline, real tokens/s",
            get("torchdata"),
            get("randommix"),
            "tokens_per_s",
            None,
        ),
    ]
