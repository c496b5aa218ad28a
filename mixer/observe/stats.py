"""Run statistics, built in the main process from what the batches carry (no extra IPC).

Every batch's :class:`~mixer.BatchMeta` holds its reader's cumulative per-source
:class:`~mixer.read.counters.Counters`, the
global ``step`` and the schedule's ``target`` share at that step, as computed in the worker. The main
process keeps the last counters of each worker and, per batch handed out, one snapshot of their sum
in a ring buffer; a window's counters are then the difference of two snapshots, so the per-batch
cost is a few small numpy operations whatever the window size, and no tensor is touched (a batch
may already be on the GPU; the one exception is each reader's first batch after a resume).

Targets are integrated: each batch adds ``target(step) * batch size`` in the mixture's unit (real
tokens, or samples with ``unit="samples"``), so with a moving schedule the realized share is compared
with what the schedule asked for over the same tokens (samples). Shares, errors and starvation are
in the mixture's unit; both the token and the sample share of every source are reported as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mixer.errors import ConfigError
from mixer.read.counters import Counters

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from numpy.typing import ArrayLike

    from mixer.batching.batch import Batch, BatchMeta

log = logging.getLogger(__name__)

FIELDS = Counters.FIELDS
_F = {name: i for i, name in enumerate(FIELDS)}
DEFAULT_WINDOW = 1000
#: A source is *starved* over a window when its realized share is below this fraction of its target.
STARVED_BELOW = 0.5


class Stats:
    """Per-source counters, cumulative and over the last ``window`` batches, fed one batch's metadata
    at a time by :class:`~mixer.Loader` (see :meth:`as_dict` for what comes out). Cumulative means
    since the loader's pass began, and after ``load_state_dict`` since the resume (the readers' raw
    counters, saved run included, are :meth:`mixer.Loader.counters`).

    ``epochs`` is the number of source-epochs completed by *every* reader of this rank (the minimum
    over the DataLoader workers): each reader reads its own part of a source-epoch. All the other
    counters are sums over the workers.

    ``unit`` is the mixture's (:class:`~mixer.Mixture`'s ``unit``): ``target``, ``realized`` and
    ``error`` are shares of real tokens, or of samples with ``"samples"``.

    A source is reported ``starved`` over the window when its realized share is below half of its
    (integrated) target *and* the shortfall exceeds two batches per reader (``2 * readers *
    max_tokens`` tokens; in samples, twice the largest batch seen so far per reader): the deficit
    selector keeps each reader within about a batch of its target, so a shortfall that large cannot
    come from batch granularity at the start of a run or of a window.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        window: int = DEFAULT_WINDOW,
        num_workers: int = 0,
        max_tokens: int = 0,
        unit: str = "tokens",
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"stats_window must be an int >= 1 (got {window!r})")
        if unit not in ("tokens", "samples"):
            raise ConfigError(f"unit must be 'tokens' or 'samples' (got {unit!r})")
        self.names = tuple(names)
        self.window = window
        self.unit = unit
        self.readers = max(1, int(num_workers))
        self.max_tokens = max(int(max_tokens), 0)
        self.reset()

    def reset(self, *, resumed: bool = False) -> None:
        """Start over (a new pass of the loader). ``resumed``: the readers continue from a saved state,
        so their counters start where the saved run left them (see :meth:`update`)."""
        n, k = len(self.names), self.window + 1
        self.resumed = resumed
        self._base: list[np.ndarray | None] = [None] * self.readers
        self.batches = 0
        self.step = -1
        self.largest = 0  # the most samples in one batch so far (the batch granularity in samples)
        self.target_now = np.zeros(n)
        self._last = np.zeros((self.readers, n, len(FIELDS)), dtype=np.int64)
        self._sum = np.zeros((n, len(FIELDS)), dtype=np.int64)
        self._target = np.zeros(n)
        # Slot b % (window + 1) holds the state after b batches; slot 0 starts as "before any batch".
        self._ring_counters = np.zeros((k, n, len(FIELDS)), dtype=np.int64)
        self._ring_target = np.zeros((k, n))
        self._ring_time = np.zeros(k)
        self.started = time.perf_counter()
        self._ring_time[0] = self.started

    def update(self, meta: BatchMeta) -> None:
        """Account one batch handed out, from its metadata.

        Everything counts from the start of this pass. After a resume the readers' counters include
        the saved run's: a resumed reader's first batch carries its counters as they stood at the
        resume point (``resumed_counters``), which become its baseline."""
        rows = np.asarray(meta.counters, dtype=np.int64)
        worker = meta.worker
        if self.resumed:
            base = self._base[worker]
            if base is None:
                resumed = meta.resumed_counters
                base = self._base[worker] = (
                    np.asarray(resumed, dtype=np.int64) if resumed is not None else np.zeros_like(rows)
                )
            rows = rows - base
        # A reader's counters are cumulative and already include this batch: the difference is it.
        delta = rows - self._last[worker]
        self._sum += delta
        self._last[worker] = rows
        if self.unit == "tokens":
            size = meta.tokens
        else:
            size = int(delta[:, _F["samples"]].sum())
            self.largest = max(self.largest, size)
        if meta.target:
            self.target_now = np.asarray(meta.target, dtype=np.float64)
            self._target += self.target_now * size
        self.step = meta.step
        self.batches += 1
        slot = self.batches % (self.window + 1)
        snap = self._ring_counters[slot]
        snap[:] = self._sum
        snap[:, _F["epochs"]] = self._last[:, :, _F["epochs"]].min(axis=0)
        self._ring_target[slot] = self._target
        self._ring_time[slot] = time.perf_counter()

    def cumulative(self) -> np.ndarray:
        """``[sources, fields]``: the readers' own cumulative counters (a resumed run's history
        included), summed over workers, as of the last batch accounted."""
        bases = [b for b in self._base if b is not None]
        return self._last.sum(axis=0) + (sum(bases) if bases else 0)

    def _at(self, batches: int) -> tuple[np.ndarray, np.ndarray, float]:
        slot = batches % (self.window + 1)
        return self._ring_counters[slot], self._ring_target[slot], float(self._ring_time[slot])

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (plain ints, floats, strings, lists and dicts)::

            {"batches", "step", "seconds", "window_size", "unit",
             "total":  {"batches", "tokens", "samples", "padded", "padding_efficiency",
                        "tokens_per_second", "samples_per_second"},
             "window": {the same, over the last min(batches, window_size) batches},
             "sources": {name: {"target_now", "starved",
                                "total":  {"target", "realized", "error", "token_share", "sample_share",
                                           "padding_efficiency", <every Counters field>},
                                "window": {the same}}},
             "starved": [names of the sources starved over the window]}

        In the mixture's ``unit`` (real tokens or samples): ``target`` is the schedule's share
        integrated over the same tokens (samples), ``realized`` the share delivered, ``error =
        realized - target``. ``token_share`` and ``sample_share`` are the realized shares of real
        tokens and of samples whatever the unit; ``target_now`` is the schedule's share at the last
        step handed out."""
        now_c, now_t, now_time = self._at(self.batches)
        start = max(self.batches - self.window, 0)
        old_c, old_t, old_time = self._at(start)
        total = self._section(now_c, now_t, self.batches, now_time - self.started)
        window = self._section(now_c - old_c, now_t - old_t, self.batches - start, now_time - old_time)
        starved = window.pop("_starved")
        total.pop("_starved")
        sources = {}
        for i, name in enumerate(self.names):
            sources[name] = {
                "target_now": float(self.target_now[i]),
                "starved": bool(starved[i]),
                "total": total["_sources"][i],
                "window": window["_sources"][i],
            }
        del total["_sources"], window["_sources"]
        return {
            "batches": self.batches,
            "step": self.step,
            "seconds": now_time - self.started,
            "window_size": self.window,
            "unit": self.unit,
            "total": total,
            "window": window,
            "sources": sources,
            "starved": [n for n, s in zip(self.names, starved) if s],
        }

    def _section(self, counters: np.ndarray, target: np.ndarray, batches: int, seconds: float) -> dict[str, Any]:
        tokens = counters[:, _F["tokens"]]
        padded = counters[:, _F["padded"]]
        total_tokens = int(tokens.sum())
        samples = int(counters[:, _F["samples"]].sum())
        token_share = _shares(tokens)
        sample_share = _shares(counters[:, _F["samples"]])
        if self.unit == "tokens":
            amount, realized, slack = tokens, token_share, 2.0 * self.readers * self.max_tokens
        else:
            amount, realized, slack = counters[:, _F["samples"]], sample_share, 2.0 * self.readers * self.largest
        share = _shares(target)
        shortfall = share * float(amount.sum()) - amount
        starved = (realized < STARVED_BELOW * share) & (shortfall > slack)
        per_source = []
        for i in range(len(self.names)):
            row = {
                "target": float(share[i]),
                "realized": float(realized[i]),
                "error": float(realized[i] - share[i]),
                "token_share": float(token_share[i]),
                "sample_share": float(sample_share[i]),
                "padding_efficiency": float(tokens[i] / padded[i]) if padded[i] else 1.0,
            }
            row.update(zip(FIELDS, map(int, counters[i])))
            per_source.append(row)
        seconds = max(seconds, 1e-9)
        return {
            "batches": int(batches),
            "tokens": total_tokens,
            "samples": samples,
            "padded": int(padded.sum()),
            "padding_efficiency": total_tokens / int(padded.sum()) if padded.sum() else 1.0,
            "tokens_per_second": total_tokens / seconds,
            "samples_per_second": samples / seconds,
            "_sources": per_source,
            "_starved": starved,
        }


def _shares(x: np.ndarray) -> np.ndarray:
    """``x`` normalised to sum 1 (all zeros when it sums to 0)."""
    total = float(x.sum())
    return x / total if total > 0 else np.zeros(len(x))


def _unit_word(stats: dict[str, Any]) -> str:
    return "sample" if stats["unit"] == "samples" else "token"


def format_line(stats: dict[str, Any]) -> str:
    """One compact line: step, throughput, padding, and per source realized/target share (in the
    mixture's unit) over the window; with adaptive mixing, the last window's mean loss per source."""
    w = stats["window"]
    shares = " ".join(
        f"{name} {s['window']['realized']:.3f}/{s['window']['target']:.3f}" for name, s in stats["sources"].items()
    )
    return (
        f"step {stats['step']} | {w['tokens_per_second']:,.0f} tok/s | pad eff {w['padding_efficiency']:.3f} | "
        f"realized/target {_unit_word(stats)} share over {w['batches']} batches: "
        f"{shares}{format_adaptive(stats.get('adaptive'))}"
    )


def log_every(loader: Iterable[Batch], n: int, *, logger: logging.Logger | None = None) -> Iterator[Batch]:
    """Iterate ``loader`` (a :class:`~mixer.Loader`), logging :func:`format_line` of ``loader.stats()``
    at INFO every ``n`` batches, and a WARNING for each source starved over the stats window (realized
    share, in the mixture's unit, below half its target; see :class:`Stats`)::

        for batch in mixer.log_every(loader, 100):
            ...
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"log_every: n must be an int >= 1 (got {n!r})")
    stats_of = getattr(loader, "stats", None)
    if not callable(stats_of):
        raise ConfigError(f"log_every: needs a mixer.Loader (with stats()), got {type(loader).__name__}")
    out = logger if logger is not None else log
    for k, batch in enumerate(loader, 1):
        if k % n == 0:
            stats = stats_of()
            out.info("%s", format_line(stats))
            for name in stats["starved"]:
                s = stats["sources"][name]["window"]
                out.warning(
                    "source %r is starved: realized %s share %.4f over the last %d batches, below half its target %.4f "
                    "(exhausted, too few samples for its share, or too few shards for the readers?)",
                    name,
                    _unit_word(stats),
                    s["realized"],
                    stats["window"]["batches"],
                    s["target"],
                )
        yield batch


# --------------------------------------------------------------------------------------- reports


#: (key, title, format) of the end-of-run table; ``target``, ``realized`` and ``error`` are in the
#: mixture's unit, and the table adds the share in the other unit (``token_share`` / ``sample_share``).
TABLE_COLUMNS = (
    ("target", "target", ".4f"),
    ("realized", "realized", ".4f"),
    ("error", "error", "+.4f"),
    ("token_share", "token share", ".4f"),
    ("sample_share", "sample share", ".4f"),
    ("tokens", "tokens", ","),
    ("samples", "samples", ","),
    ("read", "read", ","),
    ("padding_efficiency", "pad eff", ".3f"),
    ("epochs", "epochs", ","),
    ("skipped_samples", "skipped", ","),
    ("skipped_shards", "bad shards", ","),
    ("skipped_unknown", "rest unknown", ","),
    ("skipped_bytes", "bytes lost", ","),
)


def report(stats: dict[str, Any]) -> dict[str, Any]:
    """The end-of-run report: per source the table's columns (over the whole run), plus totals and
    (``"adaptive"``, None without) the adaptive part of :meth:`~mixer.Loader.stats`."""
    t = stats["total"]
    return {
        "unit": stats["unit"],
        "batches": t["batches"],
        "tokens": t["tokens"],
        "samples": t["samples"],
        "padding_efficiency": t["padding_efficiency"],
        "seconds": stats["seconds"],
        "tokens_per_second": t["tokens_per_second"],
        "samples_per_second": t["samples_per_second"],
        "sources": {
            name: {key: s["total"][key] for key, _, _ in TABLE_COLUMNS} | {"target_now": s["target_now"]}
            for name, s in stats["sources"].items()
        },
        "adaptive": stats.get("adaptive"),
    }


def format_table(rep: dict[str, Any]) -> str:
    """The per-source table printed at the end of ``mixer demo`` / ``mixer run`` (from :func:`report`):
    target, realized and error in the mixture's unit, then the share in the other unit."""
    word = _unit_word(rep)
    columns = [c for c in TABLE_COLUMNS if c[0] != f"{word}_share"]
    rows = [("source",) + tuple(title for _, title, _ in columns)]
    for name, s in rep["sources"].items():
        rows.append((name,) + tuple(format(s[key], spec) for key, _, spec in columns))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"target, realized and error are {word} shares (unit: {rep['unit']})")
    lines.append(
        f"{rep['batches']:,} batches, {rep['samples']:,} samples, {rep['tokens']:,} real tokens in "
        f"{rep['seconds']:.1f} s: {rep['tokens_per_second']:,.0f} tokens/s, "
        f"{rep['samples_per_second']:,.0f} samples/s, padding efficiency {rep['padding_efficiency']:.3f}"
    )
    return "\n".join(lines)


class History:
    """Per batch handed out: its global step, what it delivered per source in the mixture's ``unit``
    (real tokens, or samples) and the worker's target share; what :func:`plot_run` draws. Reads
    ``batch.source``/``batch.lengths`` (keep it on host batches)."""

    def __init__(self, names: Sequence[str], *, unit: str = "tokens") -> None:
        if unit not in ("tokens", "samples"):
            raise ConfigError(f"unit must be 'tokens' or 'samples' (got {unit!r})")
        self.names = tuple(names)
        self.unit = unit
        self.steps: list[int] = []
        self.tokens: list[np.ndarray] = []  # per batch and source: real tokens, or samples (unit="samples")
        self.targets: list[Sequence[float]] = []

    def update(self, batch: Batch) -> None:
        n = len(self.names)
        src = batch.source.numpy().astype(np.int64, copy=False)
        weights = batch.lengths.numpy() if self.unit == "tokens" else None
        self.tokens.append(np.bincount(src, weights=weights, minlength=n).astype(np.float64))
        self.steps.append(batch.meta.step)
        self.targets.append(batch.meta.target)

    def realized(self, width: int) -> np.ndarray:
        """Realized share (in the unit) per source over a centred window of ``width`` batches, ``[batches,
        sources]``."""
        tokens = np.asarray(self.tokens, dtype=np.float64).reshape(-1, len(self.names))
        cum = np.vstack([np.zeros((1, tokens.shape[1])), np.cumsum(tokens, axis=0)])
        b = np.arange(len(tokens))
        lo = np.clip(b - width // 2, 0, len(tokens))
        hi = np.clip(lo + width, 0, len(tokens))
        lo = np.clip(hi - width, 0, None)
        span = cum[hi] - cum[lo]
        return span / np.maximum(span.sum(axis=1, keepdims=True), 1.0)


def human(x: float) -> str:
    """``2e11`` → ``"200B"``, ``65536`` → ``"65.54K"``: counts of tokens or steps for tables and axes."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{suffix}"
    return f"{x:.4g}"


def _figure() -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            f"plotting needs matplotlib, which is not installed ({exc}); install the extra: pip install "
            "'wds-mixer[plot]'"
        ) from None
    return Figure(figsize=(9, 4.8), layout="constrained")


def check_plotting() -> None:
    """Raise a clear :class:`~mixer.ConfigError` now if matplotlib is missing (before a long run)."""
    _figure()


def plot_run(history: History, path: str | None = None, *, width: int | None = None) -> Figure:
    """Target (dashed, as computed in the workers) and realized share in the history's unit (solid,
    over a centred window of ``width`` batches, default 1/15 of the run) per source against the global
    step: two series per source. Saved as PNG to ``path`` if given."""
    fig = _figure()
    ax = fig.add_subplot()
    steps = np.asarray(history.steps)
    if width is None:
        width = max(1, len(steps) // 15)
    realized = history.realized(width) if len(steps) else np.zeros((0, len(history.names)))
    target = np.asarray(history.targets, dtype=np.float64).reshape(-1, len(history.names))
    for i, name in enumerate(history.names):
        (line,) = ax.plot(steps, target[:, i], linestyle="--", label=f"{name} target")
        ax.plot(steps, realized[:, i], color=line.get_color(), label=f"{name} realized")
    ax.set_xlabel("global step")
    word = "sample" if history.unit == "samples" else "token"
    ax.set_ylabel(f"{word} share")
    ax.set_ylim(0, 1)
    ax.set_title(f"target vs realized {word} share (realized over {width} batches)")
    ax.legend(loc="best", fontsize="small", ncols=2)
    if path is not None:
        fig.savefig(path, format="png", dpi=100)
    return fig


def plot_schedule(
    names: Sequence[str],
    steps: np.ndarray,
    probs: np.ndarray,
    path: str | None = None,
    *,
    tokens_per_step: float | None = None,
    boundaries: Sequence[float] = (),
    title: str = "",
) -> Figure:
    """The target share of every source (one series each) over global steps; with ``tokens_per_step``
    a second x axis on top gives the tokens seen. ``boundaries`` (steps) are marked with thin vertical
    lines (unlabelled)."""
    fig = _figure()
    ax = fig.add_subplot()
    for i, name in enumerate(names):
        ax.plot(steps, probs[:, i], label=name)
    for b in boundaries:
        ax.axvline(b, color="0.7", linewidth=0.8, linestyle=":", label="_boundary")
    ax.set_xlabel("global step")
    ax.set_ylabel("target share")
    ax.set_ylim(0, 1)
    ax.set_xlim(float(steps[0]), float(steps[-1]))
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))
    if tokens_per_step:
        tps = float(tokens_per_step)

        def to_tokens(x: ArrayLike) -> np.ndarray:
            return np.asarray(x, dtype=np.float64) * tps

        def to_steps(x: ArrayLike) -> np.ndarray:
            return np.asarray(x, dtype=np.float64) / tps

        top = ax.secondary_xaxis("top", functions=(to_tokens, to_steps))
        top.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))
        top.set_xlabel(f"tokens seen (at {tps:,.0f} tokens per step)")
    if title:
        ax.set_title(title)
    ax.legend(loc="best", fontsize="small")
    if path is not None:
        fig.savefig(path, format="png", dpi=100)
    return fig


def format_adaptive(adaptive: dict[str, Any] | None) -> str:
    """The adaptive part of a :func:`mixer.log_every` line, from ``Loader.stats()["adaptive"]``
    (:meth:`mixer.runtime.feedback.Feedback.as_dict`): the updates so far, the step the latest takes effect from and
    the last
    closed window's mean loss per source (``-``: no sample of it in that window); '' without."""
    if adaptive is None:
        return ""
    loss = " ".join(f"{name} {'-' if v is None else format(v, '.4g')}" for name, v in adaptive["loss"].items())
    since = f" (in effect from step {adaptive['from_step']})" if adaptive["updates"] else ""
    return f" | adaptive: {adaptive['updates']} update(s){since}, last window's mean loss: {loss}"
