"""Run statistics built in the main process from the batches themselves (no extra IPC).

``target`` per source is the schedule's share integrated over the run: each batch adds
``p(step) * batch tokens``, so with a moving schedule the realized share is compared with what the
schedule asked for over the same tokens.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .batch import Batch
from .mixture import Mixture


class RunStats:
    """Cumulative per-source tallies: real tokens, samples, padded slots, batches, target tokens."""

    def __init__(self, mixture: Mixture) -> None:
        self.mixture = mixture
        n = len(mixture.sources)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.samples = np.zeros(n, dtype=np.int64)
        self.padded = np.zeros(n, dtype=np.int64)
        self.batches = np.zeros(n, dtype=np.int64)
        self.target = np.zeros(n, dtype=np.float64)
        self.started = time.perf_counter()
        self.num_batches = 0

    def update(self, batch: Batch) -> None:
        n = len(self.tokens)
        src = batch.source.numpy().astype(np.int64, copy=False)
        lengths = batch.lengths.numpy()
        per_source = np.bincount(src, weights=lengths, minlength=n).astype(np.int64)
        counts = np.bincount(src, minlength=n)
        self.tokens += per_source
        self.samples += counts
        self.padded += counts * batch.seq_len
        self.batches += counts > 0
        total = int(per_source.sum())
        step = int(batch.info.get("step", self.num_batches))
        self.target += self.mixture.target_at(step, float(self.tokens.sum())) * total
        self.num_batches += 1

    def summary(self) -> dict[str, Any]:
        """A JSON-ready dict: per-source realized vs target share, padding efficiency, throughput."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        total = max(int(self.tokens.sum()), 1)
        target_total = max(float(self.target.sum()), 1e-9)
        per_source = {}
        for i, name in enumerate(self.mixture.names):
            realized = self.tokens[i] / total
            target = self.target[i] / target_total
            per_source[name] = {
                "target_share": float(target),
                "realized_share": float(realized),
                "error": float(realized - target),
                "tokens": int(self.tokens[i]),
                "samples": int(self.samples[i]),
                "batches": int(self.batches[i]),
                "padding_efficiency": float(self.tokens[i] / self.padded[i]) if self.padded[i] else 1.0,
            }
        return {
            "batches": self.num_batches,
            "tokens": int(self.tokens.sum()),
            "samples": int(self.samples.sum()),
            "padding_efficiency": float(self.tokens.sum() / max(int(self.padded.sum()), 1)),
            "seconds": elapsed,
            "tokens_per_second": float(self.tokens.sum()) / elapsed,
            "samples_per_second": float(self.samples.sum()) / elapsed,
            "sources": per_source,
        }


def format_table(summary: dict[str, Any]) -> str:
    """The per-source table printed at the end of ``mixer demo`` / ``mixer run``."""
    rows = [("source", "target", "realized", "error", "tokens", "samples", "batches", "pad eff")]
    for name, s in summary["sources"].items():
        rows.append((
            name, f"{s['target_share']:.4f}", f"{s['realized_share']:.4f}", f"{s['error']:+.4f}",
            f"{s['tokens']:,}", f"{s['samples']:,}", f"{s['batches']:,}", f"{s['padding_efficiency']:.3f}",
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        f"{summary['batches']:,} batches, {summary['samples']:,} samples, {summary['tokens']:,} real tokens in "
        f"{summary['seconds']:.1f} s: {summary['tokens_per_second']:,.0f} tokens/s, "
        f"{summary['samples_per_second']:,.0f} samples/s, padding efficiency {summary['padding_efficiency']:.3f}"
    )
    return "\n".join(lines)
