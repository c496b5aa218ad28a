"""Total CPU per sample over all processes, mixer with 0 vs 2 DataLoader workers (issue 2, item 7; issue 17).

Each run reads the same shards through `mixer.make_loader(mixture, num_workers=W)` and stops after the
same number of real tokens (`throughput.mixer_e2e`, the code of the throughput run's `mixer` and
`mixer_w2` rows, so both benchmarks time exactly the same thing). CPU is user+system time of this
process plus its children, from `getrusage(RUSAGE_SELF)` + `getrusage(RUSAGE_CHILDREN)`; a child's time
appears in RUSAGE_CHILDREN only once it has been waited for, so each run closes its iterator and joins
the exited workers before the clock stops. Worker start-up and shutdown are included (they are part of
the price), and so are the batches the workers prefetched but nobody consumed.

That makes the ratio depend on how long a pass runs: 2 workers cost a roughly fixed amount more per
pass (a second reader filling its shuffle buffers and buckets, the fork, batches made ahead, exit)
and a little more per batch. So every round also runs both at half the budget, and two figures
come out of the pair: the *marginal* ratio, (CPU at the budget - CPU at half) per sample added, the
price of a long run, where the fixed part vanishes; and the *fixed* extra CPU of the workers per pass,
in seconds (what is left of the 2-worker CPU at the budget after the marginal price of its samples,
less the same for 0 workers). The main process's own share with 2 workers is reported per batch:
what receiving the batches costs there, beside the bookkeeping every loader does. Target: CPU-µs/sample
with 2 workers <= 1.2x that with 0 at the default budget (one pass of the data, ~200k samples); it was
1.3 before.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from . import common
from .common import Measurement, Method, Outcome, ShardSet
from .throughput import MAX_TOKENS, mixer_e2e

NAME = "cpu_per_sample"
WORKERS = (0, 2)
HALF = "_half"  # suffix of the methods run at half the budget


def methods(shards: ShardSet, budget: int) -> list[Method]:
    skip = common.missing("mixer", "Source", "Mixture", "TokenBudget", "make_loader")
    return [
        Method(
            f"mixer_w{w}{suffix}",
            f"mixer, num_workers={w}{', half budget' if suffix else ''}",
            mixer_e2e(shards, b, w),
            skip=skip,
            note=f"TokenBudget({MAX_TOKENS}); stops at {b / 1e6:.1f}M real tokens; CPU incl. workers",
        )
        for suffix, b in (("", budget), (HALF, budget // 2))
        for w in WORKERS
    ]


def _pairs(full: Outcome, half: Outcome) -> list[tuple[Measurement, Measurement]]:
    return [
        (f, h) for f, h in zip(full.rounds, half.rounds) if f is not None and h is not None and f.samples > h.samples
    ]


def marginal_us(full: Outcome, half: Outcome) -> list[float]:
    """Per round: CPU-µs per sample added between half the budget and the budget."""
    return [1e6 * (f.cpu_s - h.cpu_s) / (f.samples - h.samples) for f, h in _pairs(full, half)]


def fixed_s(full: Outcome, half: Outcome) -> list[float]:
    """Per round: CPU seconds at the budget that its samples' marginal price does not explain."""
    return [f.cpu_s - f.samples * (f.cpu_s - h.cpu_s) / (f.samples - h.samples) for f, h in _pairs(full, half)]


def split_checks(outcomes: dict[str, Outcome]) -> list[dict]:
    """The marginal ratio and the workers' fixed extra CPU per pass (see the module docstring)."""
    w0, w2 = (outcomes["mixer_w0"], outcomes["mixer_w0" + HALF]), (outcomes["mixer_w2"], outcomes["mixer_w2" + HALF])
    m0, m2 = marginal_us(*w0), marginal_us(*w2)
    ratios = [b / a for a, b in zip(m0, m2) if a > 0]
    extra = [b - a for a, b in zip(fixed_s(*w0), fixed_s(*w2))]
    main = [
        1e6 * r.main_cpu_s / r.batches for r in w2[0].rounds if r is not None and r.main_cpu_s is not None and r.batches
    ]
    return [
        common.values_check(
            NAME, "marginal CPU-µs/sample (half budget to budget), 2 workers / 0 workers", ratios, None, "<="
        ),
        common.values_check(NAME, "marginal CPU-µs/sample, 0 workers", m0, None, "<="),
        common.values_check(NAME, "fixed CPU-s per pass, 2 workers minus 0 workers", extra, None, "<="),
        common.values_check(
            NAME, "main-process CPU-µs per batch with 2 workers (receiving, bookkeeping, start, stop)", main, None, "<="
        ),
    ]


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    budget = int(opts.budget * shards.tokens)
    table = methods(shards, budget)
    outcomes = common.run_rounds(table, opts.rounds, shards.weights, opts.window_tokens, log)
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in table]
    w0, w2 = outcomes["mixer_w0"], outcomes["mixer_w2"]
    checks = [
        common.ratio_check(NAME, "CPU-µs/sample, 2 workers / 0 workers", w2, w0, "cpu_us_per_sample", 1.2, "<="),
        common.ratio_check(
            NAME,
            "CPU-µs/sample at half the budget, 2 workers / 0 workers",
            outcomes["mixer_w2" + HALF],
            outcomes["mixer_w0" + HALF],
            "cpu_us_per_sample",
            None,
            "<=",
        ),
        *split_checks(outcomes),
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
