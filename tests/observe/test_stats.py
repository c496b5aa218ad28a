"""Run statistics: counters carried by the batches, the sliding window, starvation warnings, reports and plots.

Every expectation is counted independently from the batches the test received (their tensors), or
computed from the schedule directly; the statistics themselves come only from ``batch.meta``.
"""

from __future__ import annotations

import json
import logging
import struct
import sys

import numpy as np
import pytest
from shardutil import write_token_shards

import mixer
from mixer.batching.batch import BatchMeta
from mixer.observe.stats import History, Stats, format_line, format_table, plot_run, plot_schedule, report
from mixer.read.counters import Counters

WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}
DELIVERED = ("samples", "tokens", "padded", "batches")  # the counters a test can recount from batches

# Targets move with the global step (a ramp between two phases), so a window's integrated target
# differs from the whole run's and from the target at any single step.
STEP_CURRICULUM = mixer.Curriculum(
    [
        mixer.Phase({"web": 0.2, "code": 0.4, "books": 0.4}, until=10),
        mixer.Phase({"web": 0.7, "code": 0.2, "books": 0.1}, ramp=20),
    ],
    unit="steps",
)


def sources_from(three_sources, weights=WEIGHTS):
    return [mixer.Source(name, three_sources[name][0], weight=w) for name, w in weights.items()]


class Tally:
    """The test's own accounting of the batches it received, batch by batch, in the mixture's unit."""

    def __init__(self, mix):
        self.mix = mix
        self.column = 1 if mix.unit == "tokens" else 0  # the DELIVERED column the shares count
        self.rows = []  # per batch: [sources, len(DELIVERED)] int
        self.target = []  # per batch: target(step) * real tokens (samples), from the schedule itself
        self.steps = []

    def add(self, batch):
        n = len(self.mix.names)
        src = batch.source.numpy().astype(np.int64)
        lengths = batch.lengths.numpy().astype(np.int64)
        count = np.bincount(src, minlength=n)
        tokens = np.bincount(src, weights=lengths, minlength=n).astype(np.int64)
        self.rows.append(np.stack([count, tokens, count * batch.seq_len, (count > 0).astype(np.int64)], axis=1))
        # A step-based schedule does not depend on tokens: the main process gets the exact value.
        size = lengths.sum() if self.mix.unit == "tokens" else len(lengths)
        self.target.append(self.mix.target_at(batch.meta.step, 0.0) * size)
        self.steps.append(batch.meta.step)

    def expect(self, stats, last):
        """Check ``stats`` (as of now) against the last ``last`` batches (all when None)."""
        section = "total" if last is None else "window"
        rows = np.sum(self.rows[-last if last else 0 :], axis=0)
        target = np.sum(self.target[-last if last else 0 :], axis=0)
        tokens, samples = rows[:, 1].sum(), rows[:, 0].sum()
        assert stats["unit"] == self.mix.unit
        for i, name in enumerate(self.mix.names):
            got = stats["sources"][name][section]
            assert [got[f] for f in DELIVERED] == rows[i].tolist(), (section, name)
            assert got["token_share"] == pytest.approx(rows[i, 1] / tokens, abs=1e-12)
            assert got["sample_share"] == pytest.approx(rows[i, 0] / samples, abs=1e-12)
            assert got["realized"] == pytest.approx(rows[i, self.column] / rows[:, self.column].sum(), abs=1e-12)
            assert got["target"] == pytest.approx(target[i] / target.sum(), abs=1e-9)
            assert got["error"] == pytest.approx(got["realized"] - got["target"], abs=1e-12)
            assert got["padding_efficiency"] == pytest.approx(rows[i, 1] / rows[i, 2] if rows[i, 2] else 1.0)
        whole = stats[section]
        assert whole["batches"] == len(self.rows[-last if last else 0 :])
        assert (whole["tokens"], whole["samples"], whole["padded"]) == (tokens, rows[:, 0].sum(), rows[:, 2].sum())
        assert whole["padding_efficiency"] == pytest.approx(tokens / rows[:, 2].sum())
        assert whole["tokens_per_second"] > 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_counters_equal_what_the_batches_hold_and_the_window_moves(three_sources, num_workers):
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
        schedule=STEP_CURRICULUM,
        seed=3,
    )
    window = 7
    loader = mixer.make_loader(mix, num_workers=num_workers, stats_window=window)
    tally = Tally(mix)
    last_meta = {}
    for batch in loader:
        tally.add(batch)
        last_meta[batch.meta.worker] = batch.meta
        k = len(tally.rows)
        stats = loader.stats()
        tally.expect(stats, None)
        # The window holds the last `window` batches, and moves one batch per batch handed out.
        tally.expect(stats, min(k, window))
        assert stats["window"]["batches"] == min(k, window) and stats["batches"] == k
        assert stats["step"] == k - 1
        if k == 45:
            break
    assert tally.steps == list(range(45))
    stats = loader.stats()
    assert json.loads(json.dumps(stats, allow_nan=False)) == stats
    np.testing.assert_allclose([s["target_now"] for s in stats["sources"].values()], mix.target_at(44, 0.0), atol=1e-12)
    # The counters the batches cannot show (what was read, opened, skipped...) are the workers' own:
    # sums over workers of the last counters each sent; epochs: completed by every worker.
    per_worker = np.array([meta.counters for meta in last_meta.values()])
    assert len(per_worker) == max(num_workers, 1)
    for i, name in enumerate(mix.names):
        got = stats["sources"][name]["total"]
        for f, field in enumerate(Counters.FIELDS):
            want = per_worker[:, i, f].min() if field == "epochs" else per_worker[:, i, f].sum()
            assert got[field] == want, (name, field)
        assert got["read"] >= got["samples"] and got["bytes"] > 0 and got["shards_opened"] >= 1
        assert got["skipped_samples"] == got["skipped_shards"] == got["retries"] == 0
    # Every Counters field is reported, in both sections.
    assert set(Counters.FIELDS) <= set(stats["sources"]["web"]["window"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_after_a_resume_stats_count_from_the_resume(three_sources, num_workers):
    # The readers' counters come back with the state (the saved run included); loader.stats() counts
    # from the resume, exactly, while loader.counters() keeps the readers' raw totals.
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
        schedule=STEP_CURRICULUM,
        seed=3,
    )
    first = mixer.make_loader(mix, num_workers=num_workers)
    before = Tally(mix)
    for k, batch in enumerate(first, 1):
        before.add(batch)
        if k == 17:
            break
    second = mixer.make_loader(mix, num_workers=num_workers, stats_window=6)
    second.load_state_dict(first.state_dict())
    after = Tally(mix)
    for k, batch in enumerate(second, 1):
        after.add(batch)
        after.expect(second.stats(), None)
        after.expect(second.stats(), min(k, 6))
        if k == 15:
            break
    assert after.steps == list(range(17, 32))
    raw = second.counters()
    whole = np.sum(before.rows + after.rows, axis=0)
    for i, name in enumerate(mix.names):
        assert [raw[name][f] for f in DELIVERED] == whole[i].tolist()
    assert second.stats()["starved"] == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sample_unit_shares_errors_and_table_count_samples(three_sources, num_workers):
    # unit="samples": the selector tracks sample shares, so stats must too. Lengths differ ~20x
    # between the sources, so token shares are far from the sample shares: a token share against a
    # sample target would be off by much more than the 1e-12 checked here.
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
        schedule=STEP_CURRICULUM,
        unit="samples",
        # (at 40 batches the 0.05 below is near chance: seed 5 misses it by 0.005 on the reservoir refilled
        # per sample, seed 3 by 0.008 refilled in bursts)
        seed=4,
    )
    loader = mixer.make_loader(mix, num_workers=num_workers, stats_window=9)
    tally = Tally(mix)
    for k, batch in enumerate(loader, 1):
        tally.add(batch)
        tally.expect(loader.stats(), None)
        tally.expect(loader.stats(), min(k, 9))
        if k == 40:
            break
    stats = loader.stats()
    rows = np.sum(tally.rows, axis=0)
    sample_share, token_share = rows[:, 0] / rows[:, 0].sum(), rows[:, 1] / rows[:, 1].sum()
    assert np.abs(sample_share - token_share).max() > 0.1  # the two units really disagree here
    target = np.sum(tally.target, axis=0)
    target = target / target.sum()
    # The deficit selector keeps sample shares close to the targets; token shares are not.
    assert np.abs(sample_share - target).max() < 0.05
    assert np.abs(token_share - target).max() > 0.1
    rep = report(stats)
    assert rep["unit"] == "samples"
    lines = format_table(rep).splitlines()
    assert lines[0].split()[:6] == ["source", "target", "realized", "error", "token", "share"]
    assert "target, realized and error are sample shares (unit: samples)" in lines
    for i, name in enumerate(mix.names):
        s = rep["sources"][name]
        assert s["realized"] == pytest.approx(sample_share[i], abs=1e-12) and s["target"] == pytest.approx(
            target[i], abs=1e-9
        )
        assert s["token_share"] == pytest.approx(token_share[i], abs=1e-12)
        cells = lines[2 + i].split()
        assert cells[:5] == [
            name,
            f"{target[i]:.4f}",
            f"{sample_share[i]:.4f}",
            f"{sample_share[i] - target[i]:+.4f}",
            f"{token_share[i]:.4f}",
        ]
    assert stats["starved"] == []


def test_sample_unit_starvation_compares_sample_shares(tmp_path, caplog):
    # Two sources at equal sample targets; 'long' (one 4000-token sample per batch) has only 4
    # samples and stop="all_exhausted" drops it when they are gone. After 10 batches (4 long, 6 of
    # ~100 short samples) its token share is well above half its target, its sample share far below:
    # in unit="samples" it is starved (short by more than two of the largest batches), and the
    # warning says so in samples.
    short = write_token_shards(tmp_path, "short", [[40] * 1000, [40] * 1000])
    long = write_token_shards(tmp_path, "long", [[4000, 4000], [4000, 4000]])
    mix = mixer.Mixture(
        [mixer.Source("short", short), mixer.Source("long", long)],
        batching=mixer.TokenBudget(max_tokens=4096),
        unit="samples",
        stop="all_exhausted",
        shuffle_buffer=0,
        seed=0,
    )
    loader = mixer.make_loader(mix, stats_window=100)
    counts = np.zeros(2, dtype=np.int64)
    tokens = np.zeros(2, dtype=np.int64)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixer.observe.stats"):
        for k, batch in enumerate(mixer.log_every(loader, 5), 1):
            src = batch.source.numpy().astype(np.int64)
            counts += np.bincount(src, minlength=2)
            tokens += np.bincount(src, weights=batch.lengths.numpy(), minlength=2).astype(np.int64)
            if k == 10:
                break
    assert counts[1] == 4 and tokens[1] == 16000
    stats = loader.stats()
    s = stats["sources"]["long"]["window"]
    assert s["target"] == pytest.approx(0.5)
    assert s["realized"] == pytest.approx(counts[1] / counts.sum(), abs=1e-12) and s["realized"] < 0.01
    assert s["error"] == pytest.approx(counts[1] / counts.sum() - 0.5, abs=1e-12)
    assert s["token_share"] == pytest.approx(tokens[1] / tokens.sum(), abs=1e-12) and s["token_share"] > 0.35
    assert stats["starved"] == ["long"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"source 'long' is starved: realized sample share {s['realized']:.4f} over the last 10 batches, "
        "below half its target 0.5000 (exhausted, too few samples for its share, or too few shards for the readers?)"
    ]


def test_window_spans_source_epochs(tmp_path):
    # A source of 4 samples, each in its own batch (max_tokens = one sample): epochs complete every
    # 4 batches, and the window's epochs count only those completed inside it.
    pattern = write_token_shards(tmp_path, "s", [[50, 50], [50, 50]])
    mix = mixer.Mixture([mixer.Source("s", pattern)], batching=mixer.TokenBudget(max_tokens=50), shuffle_buffer=0)
    loader = mixer.make_loader(mix, stats_window=8)
    for k, _ in enumerate(loader, 1):
        if k == 21:
            break
    stats = loader.stats()["sources"]["s"]
    # After 21 batches the reader has read the first sample of epoch 5 (4 epochs done before the 21st).
    assert stats["total"]["epochs"] == 5 and stats["total"]["samples"] == 21
    # Window: batches 14..21; the stream reads ahead of delivery, so epochs ending inside it (at
    # reads 16 and 20) are counted when the batch after them is built.
    assert stats["window"]["samples"] == 8 and stats["window"]["epochs"] == 2


def test_stats_window_is_validated(three_sources):
    mix = mixer.Mixture(sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=16384))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(mixer.ConfigError, match="stats_window must be an int >= 1"):
            mixer.make_loader(mix, stats_window=bad)


def test_stats_before_any_batch_is_empty_and_valid(three_sources):
    mix = mixer.Mixture(sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=16384))
    stats = mixer.make_loader(mix).stats()
    assert stats["batches"] == 0 and stats["total"]["tokens"] == 0 and stats["starved"] == []
    assert json.loads(json.dumps(stats, allow_nan=False)) == stats


# ---- logging and starvation ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A source of 6 short samples in 2 shards: exhausted after a handful of batches."""
    folder = tmp_path_factory.mktemp("tiny")
    return write_token_shards(folder, "tiny", [[40, 60, 50], [30, 70, 45]])


def starving_mixture(three_sources, tiny, stop):
    srcs = sources_from(three_sources, {"web": 1.0, "code": 1.0}) + [mixer.Source("tiny", tiny, weight=1.0)]
    return mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=4096, max_length=4096), stop=stop, seed=1)


def run_logged(loader, n, batches, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixer.observe.stats"):
        for k, _ in enumerate(mixer.log_every(loader, n), 1):
            if k == batches:
                break
    return [r for r in caplog.records if r.name == "mixer.observe.stats"]


def test_starvation_warning_fires_for_an_exhausted_source(three_sources, tiny, caplog):
    # stop="all_exhausted": 'tiny' (6 samples, 1/3 of the target) runs dry within its first batches
    # and is dropped; the schedule still asks a third of the tokens from it. Over the window its
    # realized share is 0: starved, and only it.
    loader = mixer.make_loader(starving_mixture(three_sources, tiny, "all_exhausted"), stats_window=30)
    records = run_logged(loader, 10, 60, caplog)
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert warnings, [r.getMessage() for r in records]
    assert all("source 'tiny' is starved" in r.getMessage() for r in warnings)
    stats = loader.stats()
    assert stats["starved"] == ["tiny"] and stats["sources"]["tiny"]["starved"]
    tiny_window = stats["sources"]["tiny"]["window"]
    assert tiny_window["realized"] == 0 and tiny_window["target"] == pytest.approx(1 / 3)
    assert stats["sources"]["tiny"]["total"]["samples"] == 6  # all of it, exactly once
    # One INFO line per 10 batches.
    assert len([r for r in records if r.levelno == logging.INFO]) == 6


def test_no_starvation_warning_when_every_source_keeps_up(three_sources, tiny, caplog):
    # The same sources with stop="never" ('tiny' restarts its epochs), plus a small target (5%),
    # checked every 3 batches from the first: no warning, also in windows of a few batches, where a
    # source with a small target may not have had its first batch yet.
    srcs = sources_from(three_sources, {"web": 1.0, "code": 0.1}) + [mixer.Source("tiny", tiny, weight=1.0)]
    mix = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=4096, max_length=4096), seed=1)
    for num_workers in (0, 2):
        loader = mixer.make_loader(mix, num_workers=num_workers, stats_window=12)
        records = run_logged(loader, 3, 90, caplog)
        assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
        assert len(records) == 30
        assert loader.stats()["starved"] == []


def test_log_line_is_compact_and_complete(three_sources, caplog):
    mix = mixer.Mixture(sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=8192, max_length=8192))
    loader = mixer.make_loader(mix, stats_window=5)
    records = run_logged(loader, 4, 8, caplog)
    assert len(records) == 2
    line = records[-1].getMessage()
    assert "\n" not in line and line.startswith("step 7 | ") and "tok/s" in line and "over 5 batches" in line
    for name in WEIGHTS:
        assert f" {name} " in line
    assert line == format_line(loader.stats())


def test_log_every_validates(three_sources):
    mix = mixer.Mixture(sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=16384))
    with pytest.raises(mixer.ConfigError, match="n must be an int >= 1"):
        next(mixer.log_every(mixer.make_loader(mix), 0))
    with pytest.raises(mixer.ConfigError, match="needs a mixer.Loader"):
        next(mixer.log_every([1, 2], 1))


# ---- reports and plots ---------------------------------------------------------------------------


def test_report_and_table(three_sources):
    mix = mixer.Mixture(sources_from(three_sources), batching=mixer.TokenBudget(max_tokens=8192, max_length=8192))
    loader = mixer.make_loader(mix)
    tokens = np.zeros(3)
    for k, batch in enumerate(loader, 1):
        tokens += np.bincount(batch.source.numpy(), weights=batch.lengths.numpy(), minlength=3)
        if k == 30:
            break
    rep = report(loader.stats())
    assert json.loads(json.dumps(rep, allow_nan=False)) == rep
    assert list(rep["sources"]) == list(WEIGHTS)
    for i, (name, w) in enumerate(WEIGHTS.items()):
        s = rep["sources"][name]
        assert set(s) == {
            "target",
            "realized",
            "error",
            "token_share",
            "sample_share",
            "tokens",
            "samples",
            "read",
            "padding_efficiency",
            "epochs",
            "skipped_samples",
            "skipped_shards",
            "skipped_unknown",
            "skipped_bytes",
            "target_now",
        }
        assert s["tokens"] == tokens[i] and s["target"] == pytest.approx(w) and s["target_now"] == pytest.approx(w)
    table = format_table(rep)
    lines = table.splitlines()
    assert lines[0].split() == [
        "source",
        "target",
        "realized",
        "error",
        "sample",
        "share",
        "tokens",
        "samples",
        "read",
        "pad",
        "eff",
        "epochs",
        "skipped",
        "bad",
        "shards",
        "rest",
        "unknown",
        "bytes",
        "lost",
    ]
    assert "target, realized and error are token shares (unit: tokens)" in lines
    # read: samples taken from the shards (delivered or still in a buffer), per source
    counters = loader.counters()
    assert [line.split()[7] for line in lines[2:5]] == [f"{counters[n]['read']:,}" for n in WEIGHTS]
    assert all(counters[n]["read"] >= rep["sources"][n]["samples"] for n in WEIGHTS)
    assert [line.split()[0] for line in lines[2:5]] == list(WEIGHTS)
    assert f"{int(tokens[0]):,}" in lines[2] and "30 batches" in table


def _png_size(path):
    data = open(path, "rb").read()
    assert (
        data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
    )
    return struct.unpack(">II", data[16:24])


def _series(fig):
    (ax,) = fig.axes[:1]
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_plot_run_draws_target_and_realized_per_source(three_sources, tmp_path):
    mix = mixer.Mixture(
        sources_from(three_sources),
        batching=mixer.TokenBudget(max_tokens=8192, max_length=8192),
        schedule=STEP_CURRICULUM,
    )
    history = History(mix.names)
    for k, batch in enumerate(mixer.make_loader(mix), 1):
        history.update(batch)
        if k == 60:
            break
    path = tmp_path / "run.png"
    fig = plot_run(history, str(path), width=10)
    assert _series(fig) == [f"{n} {kind}" for n in WEIGHTS for kind in ("target", "realized")]
    w, h = _png_size(path)
    assert w > 300 and h > 200
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (h, w)
    # The dashed series are the workers' targets, step by step; the realized ones are token shares.
    target_web = fig.axes[0].get_lines()[0]
    np.testing.assert_allclose(target_web.get_ydata(), [mix.target_at(s, 0)[0] for s in range(60)])
    realized = np.array([line.get_ydata() for line in fig.axes[0].get_lines()[1::2]])
    np.testing.assert_allclose(realized.sum(axis=0), 1.0)


def test_plot_schedule_draws_one_series_per_source(tmp_path):
    steps = np.arange(0, 101)
    probs = np.stack([steps / 100, 1 - steps / 100], axis=1)
    path = tmp_path / "plan.png"
    fig = plot_schedule(["a", "b"], steps, probs, str(path), tokens_per_step=1000, boundaries=[50])
    assert _series(fig) == ["a", "b"]
    _png_size(path)


def test_plotting_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(mixer.ConfigError, match=r"needs matplotlib.*pip install 'wds-mixer\[plot\]'"):
        plot_schedule(["a"], np.arange(3), np.ones((3, 1)))


def test_stats_per_batch_cost_is_small():
    # Hot path: one update per batch handed out; a few small numpy operations, whatever the window.
    import time

    names = [f"s{i}" for i in range(8)]
    stats = Stats(names, window=1000, num_workers=4, max_tokens=4096)
    rows = [[1] * len(Counters.FIELDS) for _ in names]
    metas = [BatchMeta(step=k, worker=k % 4, tokens=100, counters=rows, target=[1 / 8] * 8) for k in range(3000)]
    start = time.perf_counter()
    for meta in metas:
        stats.update(meta)
    per_batch = (time.perf_counter() - start) / len(metas)
    assert per_batch < 200e-6, per_batch
