"""Total CPU per sample over all processes, mixer with 0 vs 2 DataLoader workers (issue 2, item 7).

Both runs read the same shards through `mixer.make_loader(mixture, num_workers=W)` and stop after the
same number of real tokens. CPU is user+system time of this process plus its children, from
`getrusage(RUSAGE_SELF)` + `getrusage(RUSAGE_CHILDREN)`; a child's time appears in RUSAGE_CHILDREN only
once it has been waited for, so each run drops its loader and joins the exited workers
(`multiprocessing.active_children()`) before the clock stops. Worker start-up and shutdown are
included (they are part of the price), and so are the batches the workers prefetched but nobody
consumed (a few out of hundreds). Target: CPU-µs/sample with 2 workers <= 1.2x that with 0 (the target of the worker-overhead work; it was 1.3 before).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

from . import common
from .common import Method, ShardSet, Tally
from .throughput import MAX_TOKENS, consume_mixer, make_mixture

NAME = "cpu_per_sample"
WORKERS = (0, 2)


def mixer_workers(shards: ShardSet, workers: int, budget: int) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        import mixer

        loader = mixer.make_loader(make_mixture(shards), num_workers=workers)
        consume_mixer(loader, tally, budget)
        del loader
        gc.collect()
        alive = common.reap_children()
        if alive:
            tally.note(f"{alive} child process(es) still alive after 60 s: their CPU is not counted")

    return run


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    budget = int(opts.budget * shards.tokens)
    skip = common.missing("mixer", "Source", "Mixture", "TokenBudget", "make_loader")
    methods = [
        Method(
            f"mixer_w{w}",
            f"mixer, num_workers={w}",
            mixer_workers(shards, w, budget),
            skip=skip,
            note=f"TokenBudget({MAX_TOKENS}); stops at {budget / 1e6:.1f}M real tokens; CPU incl. workers",
        )
        for w in WORKERS
    ]
    outcomes = common.run_rounds(methods, opts.rounds, shards.weights, opts.window_tokens, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in methods]
    w0, w2 = outcomes["mixer_w0"], outcomes["mixer_w2"]
    checks = [
        common.ratio_check(NAME, "CPU-µs/sample, 2 workers / 0 workers", w2, w0, "cpu_us_per_sample", 1.2, "<="),
        common.ratio_check(NAME, "wall samples/s, 2 workers / 0 workers", w2, w0, "samples_per_s", None),
    ]
    config = {
        "profile": opts.profile,
        "rounds": opts.rounds,
        "budget_tokens": budget,
        "workers": list(WORKERS),
        "targets": shards.weights.tolist(),
        "shards": shards.describe(),
    }
    return common.BenchResult(NAME, rows, checks, config)
