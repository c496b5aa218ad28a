"""Adaptive mixing made visible: the adaptive targets, the realized shares and the per-source loss in
`loader.stats()`, `log_every` lines, the report (and the CLI's `--report` JSON) and the plot."""

from __future__ import annotations

import functools
import json
import logging

import numpy as np
import pytest
import shardutil
import yaml
from shardutil import RESUME_SOURCES

import mixer
from mixer import Adaptive
from mixer.cli import commands as cli
from mixer.observe.stats import History, plot_run, report

WEIGHTS = {"web": 0.5, "code": 0.3, "tiny": 0.2}
U = 4
mixture = functools.partial(
    shardutil.mixture, weights=WEIGHTS, batching=mixer.TokenBudget(max_tokens=2048), state_every=8, shuffle_buffer=64
)


@pytest.fixture(scope="module")
def shards(make_sources):
    return make_sources(RESUME_SOURCES)


def fake_loss(batch):
    return (batch.source.double() + 1) * 0.5 + batch.lengths.double() / 4096


def test_stats_log_lines_report_and_plot_show_the_adaptive_targets_and_loss(shards, caplog):
    schedule = Adaptive(mixer.Weights(WEIGHTS), policy="exp3", lr=0.05, update_every=U, smoothing=0.2)
    # lag 1; seed 6: a seed whose window 5 holds no 'tiny' sample (the None case checked below)
    loader = mixer.make_loader(mixture(shards, schedule=schedule, seed=6))
    history = History(loader.mixture.names)
    batches = []
    with caplog.at_level(logging.INFO, logger="mixer.observe.stats"):
        for batch in mixer.log_every(loader, 2 * U):
            loader.feedback(batch, fake_loss(batch))
            history.update(batch)
            batches.append((batch.meta.step, batch.source.clone(), fake_loss(batch)))
            if len(batches) == 6 * U + 2:
                break
    stats = loader.stats()
    a = stats["adaptive"]
    assert a["updates"] == 6 and a["from_step"] == 6 * U + 1 and a["lag"] == 1

    def window_loss(j):  # window j (steps 4j to 4j + 3) as the test itself saw it
        sums, counts = np.zeros(3), np.zeros(3)
        for step, source, loss in batches[j * U : (j + 1) * U]:
            np.add.at(sums, source.numpy(), loss.numpy())
            np.add.at(counts, source.numpy(), 1)
        return {n: (float(s / c) if c else None) for n, s, c in zip(WEIGHTS, sums, counts)}

    expected = window_loss(5)
    assert a["loss"].keys() == expected.keys() and None in expected.values()  # 'tiny' had no sample in it
    for name, value in expected.items():
        assert (a["loss"][name] is None) if value is None else a["loss"][name] == pytest.approx(value, rel=1e-12)
    # The target the readers use now is the adaptive one (the last batch's step 25 >= from_step 25),
    # and it has moved away from the prior.
    assert [stats["sources"][n]["target_now"] for n in WEIGHTS] == list(a["target"].values())
    assert np.abs(np.array(list(a["target"].values())) - np.array(list(WEIGHTS.values()))).max() > 0.01
    # Each log line carries the updates so far and the last window's loss per source.
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 3
    # after step 23: windows 0-4 closed (window 5 closes when step 24 is handed out)
    assert "| adaptive: 5 update(s) (in effect from step 21), last window's mean loss: " in lines[-1]
    for name, value in window_loss(4).items():
        assert f"{name} {'-' if value is None else format(value, '.4g')}" in lines[-1]
    assert "| adaptive: 1 update(s) (in effect from step 5)" in lines[0]  # after step 7: window 0 closed at step 4
    # The report carries it too, as plain JSON.
    rep = json.loads(json.dumps(report(stats)))
    assert rep["adaptive"] == json.loads(json.dumps(a))
    # The plot: one dashed target line per source, the adaptive targets the batches carried, step by step.
    fig = plot_run(history)
    lines_by_label = {line.get_label(): line for line in fig.axes[0].get_lines()}
    targets = np.array(history.targets)
    for i, name in enumerate(WEIGHTS):
        line = lines_by_label[f"{name} target"]
        assert line.get_linestyle() == "--"
        np.testing.assert_array_equal(line.get_xdata(), np.arange(len(batches)))
        np.testing.assert_array_equal(line.get_ydata(), targets[:, i])
        assert len(set(targets[:, i])) > 1  # the line moves with the updates
    assert (targets[U + 1] != targets[U]).any() and (targets[: U + 1] == targets[0]).all()  # update 0 from step 5


def test_a_plain_schedule_has_no_adaptive_part(shards):
    loader = mixer.make_loader(mixture(shards))
    for _ in zip(range(3), loader):
        pass
    stats = loader.stats()
    assert stats["adaptive"] is None and report(stats)["adaptive"] is None
    assert "adaptive" not in mixer.observe.stats.format_line(stats)


def test_cli_report_of_an_adaptive_config(shards, tmp_path, capsys):
    config = {
        "seed": 1,
        "batching": {"max_tokens": 2048},
        "sources": [{"name": n, "urls": shards[n][0], "weight": w} for n, w in WEIGHTS.items()],
        "schedule": {"adaptive": {"policy": "exp_gradient", "lr": 2.0, "update_every": U}},
    }
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "report.json"
    assert cli.main(["run", str(path), "--steps", "20", "--report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "schedule adaptive (exp_gradient, an update every 4 steps) over static (the sources' weights); no training "
        "loop reports loss here" in printed
    )
    rep = json.loads(out.read_text())
    a = rep["adaptive"]
    # Windows close as steps are handed out (19 is the last: windows 0-3 closed); without loss, no
    # source was seen, so every update keeps the prior's shares.
    assert a["updates"] == 4 and a["lag"] == 2 * 2 + 1 and a["loss"] == {n: None for n in WEIGHTS}
    assert a["target"] == pytest.approx(WEIGHTS, abs=1e-12)
    assert rep["stats"]["adaptive"] == a
