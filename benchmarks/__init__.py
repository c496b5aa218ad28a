"""Benchmark suite for `mixer` (not timed tests).

Run from the repository root::

    python -m benchmarks                      # every benchmark, full size, 3 alternating rounds
    python -m benchmarks throughput --quick   # small data, 1 round, a smoke run (< 30 s)
    python -m benchmarks cpu_per_sample --rounds 5

Each benchmark writes `.bench/<name>.json` (`<name>.quick.json` with `--quick`); the suite prints one
Markdown table of all rows and a second one of the targets with PASS/MISS.

The machine these run on is usually shared and noisy, so every headline figure is a ratio against a
baseline measured in the same run, methods alternate within each round (the order rotates from round
to round), the reported rate is the median over rounds, and each ratio is the median of the per-round
ratios. CPU time (this process plus its waited-for children, from `resource.getrusage`) is reported
beside wall time because neighbours swing wall time far more than CPU time.
"""

BENCHMARKS = (
    "throughput",
    "cpu_per_sample",
    "plan_scale",
    "resume",
    "remote",
    "layouts",
    "many_sources",
    "buffer_budget",
    "length_drift",
    "buffer_memory",
    "adaptive",
    "snapshot_cost",
    "world_scale",
    "text",
    "service",
)
