"""The ``mixer`` command: ``run``, ``plan`` and ``demo`` in-process through ``mixer.cli.commands.main``, and the
installed console script once in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import mixer
from mixer.cli import commands as cli
from mixer.cli import demo
from mixer.observe import stats

REPO = Path(__file__).resolve().parents[2]
TABLE_KEYS = {
    "target",
    "realized",
    "error",
    "token_share",
    "sample_share",
    "tokens",
    "samples",
    "padding_efficiency",
    "epochs",
    "skipped_samples",
    "skipped_shards",
}


def write_config(path, config):
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def run_config(three_sources, **extra):
    config = {
        "seed": 3,
        "batching": {"max_tokens": 8192, "max_length": 8192},
        "sources": [{"name": name, "urls": three_sources[name][0]} for name in ("web", "code", "books")],
        "schedule": {
            "phases": [
                {"until_steps": 20, "weights": {"web": 0.6, "code": 0.3, "books": 0.1}},
                {"ramp_steps": 20, "weights": {"web": 0.2, "code": 0.3, "books": 0.5}},
            ]
        },
    }
    config.update(extra)
    return config


def strict_json(path):
    def no_constant(name):
        raise AssertionError(f"{path}: not valid JSON ({name})")

    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=no_constant)


def capture(monkeypatch, name):
    """Wrap ``mixer.cli.commands.<name>`` (a plot function) to keep the figures it returns."""
    figures = []
    real = getattr(cli, name)

    def wrapper(*args, **kwargs):
        figures.append(real(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(cli, name, wrapper)
    return figures


def series(fig):
    return [line.get_label() for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) > 10_000


# ---- mixer run -----------------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["tokens", "samples"])
def test_run_prints_table_and_writes_report_and_plot(three_sources, tmp_path, capsys, monkeypatch, unit):
    # Shares, errors and the plot's realized series are in the config's unit (NeMo ports use samples).
    cfg = write_config(tmp_path / "mix.yaml", run_config(three_sources, unit=unit))
    figures = capture(monkeypatch, "plot_run")
    report_path, plot_path = tmp_path / "report.json", tmp_path / "run.png"
    argv = [
        "run",
        cfg,
        "--steps",
        "60",
        "--workers",
        "0",
        "--window",
        "25",
        "--report",
        str(report_path),
        "--plot",
        str(plot_path),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out

    # The same mixture streamed here, counted from the batches (workers=0: the same batches).
    mix = mixer.load_config(cfg)
    tokens, samples = np.zeros(3), np.zeros(3)
    target = np.zeros(3)
    for k, batch in enumerate(mixer.make_loader(mix), 1):
        src, lengths = batch.source.numpy(), batch.lengths.numpy()
        tokens += np.bincount(src, weights=lengths, minlength=3)
        samples += np.bincount(src, minlength=3)
        target += mix.target_at(batch.meta.step, 0.0) * (lengths.sum() if unit == "tokens" else len(lengths))
        if k == 60:
            break
    counted = tokens if unit == "tokens" else samples

    rep = strict_json(report_path)
    assert rep["command"] == "run" and rep["batches"] == 60 and rep["tokens"] == tokens.sum() and rep["unit"] == unit
    assert list(rep["sources"]) == ["web", "code", "books"]
    for i, (name, s) in enumerate(rep["sources"].items()):
        assert TABLE_KEYS <= set(s)
        assert (s["tokens"], s["samples"]) == (tokens[i], samples[i])
        assert s["realized"] == pytest.approx(counted[i] / counted.sum())
        assert (s["token_share"], s["sample_share"]) == (
            pytest.approx(tokens[i] / tokens.sum()),
            pytest.approx(samples[i] / samples.sum()),
        )
        assert s["target"] == pytest.approx(target[i] / target.sum())
        assert s["error"] == pytest.approx(s["realized"] - s["target"])
        assert 0 < s["padding_efficiency"] <= 1
    # The full loader.stats() rides along, with the window asked for.
    assert rep["stats"]["window"]["batches"] == 25 and rep["stats"]["window_size"] == 25

    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["source", "target"])
    assert [lines[header + 2 + i].split()[0] for i in range(3)] == ["web", "code", "books"]
    assert f"{int(tokens[0]):,}" in lines[header + 2]
    assert "60 batches" in out and f"report written to {report_path}" in out

    assert_png(plot_path)
    (fig,) = figures
    assert series(fig) == [f"{n} {kind}" for n in ("web", "code", "books") for kind in ("target", "realized")]
    assert fig.axes[0].get_ylabel() == f"{unit[:-1]} share"


def test_run_with_workers_and_logging(three_sources, tmp_path, capsys, caplog):
    cfg = write_config(tmp_path / "mix.yaml", run_config(three_sources))
    report_path = tmp_path / "r.json"
    with caplog.at_level("INFO", logger="mixer.observe.stats"):
        assert (
            cli.main(["run", cfg, "--steps", "30", "--workers", "2", "--log-every", "10", "--report", str(report_path)])
            == 0
        )
    rep = strict_json(report_path)
    assert rep["batches"] == 30 and rep["workers"] == 2
    assert sum(s["tokens"] for s in rep["sources"].values()) == rep["tokens"]
    lines = [r.getMessage() for r in caplog.records if r.name == "mixer.observe.stats"]
    assert [line.split(" | ")[0] for line in lines] == ["step 9", "step 19", "step 29"]


def test_run_stops_early_when_the_mixture_ends(tmp_path, capsys):
    from shardutil import write_token_shards

    pattern = write_token_shards(tmp_path, "s", [[30, 40, 50]])
    cfg = write_config(
        tmp_path / "mix.yaml",
        {"batching": {"max_tokens": 64}, "stop": "all_exhausted", "sources": [{"name": "s", "urls": pattern}]},
    )
    assert cli.main(["run", cfg, "--steps", "100", "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "the mixture ended after 3 of 100 batches (stop='all_exhausted')" in out


def test_run_errors_are_clear(three_sources, tmp_path, capsys):
    bad = run_config(three_sources)
    bad["sources"][2]["weight"] = -1
    assert cli.main(["run", write_config(tmp_path / "bad.yaml", bad), "--steps", "5"]) == 2
    assert "sources[2].weight: must be >= 0, got -1" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", str(tmp_path / "missing.yaml"), "--steps", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


# ---- mixer plan ----------------------------------------------------------------------------------


def plan_table(out):
    """{step: [values...]} of the table ``mixer plan`` prints, and its header."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "tokens"])
    header = lines[start].split()
    rows = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if not cells or not cells[0].replace(",", "").isdigit():
            break
        rows[int(cells[0].replace(",", ""))] = cells[1:]
    return header, rows


def two_phase_config(unit="steps", scale=1):
    # p(a) = 1 until 100; then a ramp over 50 to p(a) = 0; hand-computed: at 125, halfway (0.5).
    return {
        "batching": {"max_tokens": 1000},
        "sources": [
            {"name": "a", "urls": "/nowhere/a-{0..9}.tar"},
            {"name": "b", "urls": "s3://no-bucket/b/{0..9}.tar"},
        ],
        "schedule": {
            "phases": [
                {f"until_{unit}": 100 * scale, "weights": {"a": 1, "b": 0}},
                {f"ramp_{unit}": 50 * scale, "weights": {"a": 0, "b": 1}},
            ]
        },
    }


def test_plan_prints_hand_computed_shares_without_reading_shards(tmp_path, capsys):
    # The shards do not exist: plan reads none.
    cfg = write_config(tmp_path / "plan.yaml", two_phase_config())
    assert cli.main(["plan", cfg, "--steps", "0,99,100,125,150,1000"]) == 0
    out = capsys.readouterr().out
    header, rows = plan_table(out)
    assert header == ["step", "tokens", "phase", "a", "b"]
    assert rows == {
        0: ["0", "0", "1.0000", "0.0000"],
        99: ["99K", "0", "1.0000", "0.0000"],
        100: ["100K", "1", "1.0000", "0.0000"],
        125: ["125K", "1", "0.5000", "0.5000"],
        150: ["150K", "1", "0.0000", "1.0000"],
        1000: ["1M", "1", "0.0000", "1.0000"],
    }
    assert "1,000 tokens per step (batching.max_tokens" in out
    assert "no size given for a, b (not needed" in out
    # Default steps: the start, the boundary, the ramp's end and the horizon (1.25 x 150).
    assert cli.main(["plan", cfg]) == 0
    assert sorted(plan_table(capsys.readouterr().out)[1]) == [0, 100, 150, 188]


def test_plan_converts_token_boundaries_with_tokens_per_step(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "plan.yaml", two_phase_config(unit="tokens", scale=10_000))
    figures = capture(monkeypatch, "plot_schedule")
    plot_path = tmp_path / "plan.png"
    assert cli.main(["plan", cfg, "--tokens-per-step", "1e4", "--plot", str(plot_path)]) == 0
    out = capsys.readouterr().out
    _, rows = plan_table(out)
    # 1M tokens at 10k tokens per step: the boundary is step 100, the ramp ends at step 150.
    assert rows == {
        0: ["0", "0", "1.0000", "0.0000"],
        100: ["1M", "1", "1.0000", "0.0000"],
        150: ["1.5M", "1", "0.0000", "1.0000"],
        188: ["1.88M", "1", "0.0000", "1.0000"],
    }
    assert_png(plot_path)
    (fig,) = figures
    assert series(fig) == ["a", "b"]
    a = fig.axes[0].get_lines()[0]
    x, y = np.asarray(a.get_xdata()), np.asarray(a.get_ydata())
    np.testing.assert_allclose(y, np.clip((150 - x) / 50, 0, 1))  # 1, then the ramp, then 0
    assert x[0] == 0 and x[-1] == 188
    # The top axis counts tokens.
    assert any("tokens seen" in ax.get_xlabel() for ax in fig.axes[0].child_axes)


def test_plan_of_the_pretraining_example_matches_the_schedule(capsys):
    path = str(REPO / "examples" / "pretrain.yaml")
    assert cli.main(["plan", path, "--steps", "0,40000,3100000,11000000"]) == 0
    header, rows = plan_table(capsys.readouterr().out)
    spec = mixer.parse_config(path)
    info = mixer.SourceInfo(
        names=tuple(s.name for s in spec.sources),
        weights=np.array([s.weight for s in spec.sources]),
        sizes=np.array([s.size for s in spec.sources]),
        groups=tuple(s.group for s in spec.sources),
    )
    assert header[3:] == list(info.names)
    for step, cells in rows.items():
        want = spec.schedule.probs(info, step, step * spec.batching.max_tokens)
        assert [float(c) for c in cells[2:]] == pytest.approx(want, abs=5e-5), step
    assert [cells[1] for cells in rows.values()] == ["0", "0", "1", "2"]


def test_plan_needs_sizes_only_when_the_schedule_uses_them(tmp_path, capsys):
    config = two_phase_config()
    config["schedule"] = {"temperature": {"start": 2.0}}  # temperature on sizes: needs them
    cfg = write_config(tmp_path / "t.yaml", config)
    assert cli.main(["plan", cfg]) == 2
    err = capsys.readouterr().err
    assert "depends on source sizes" in err and "give 'size' (tokens) in the config for 'a', 'b'" in err
    config["sources"][0]["size"] = 4e9
    config["sources"][1]["size"] = 1e9
    assert cli.main(["plan", write_config(tmp_path / "t.yaml", config), "--steps", "0"]) == 0
    # p ∝ size^(1/2): 2 : 1
    assert plan_table(capsys.readouterr().out)[1] == {0: ["0", "0.6667", "0.3333"]}


def test_plan_plot_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "plan.yaml", two_phase_config())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["plan", cfg, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'wds-mixer[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
    # The table needs no matplotlib.
    assert cli.main(["plan", cfg]) == 0


def test_plan_rejects_bad_options(tmp_path, capsys):
    cfg = write_config(tmp_path / "plan.yaml", two_phase_config())
    for argv in (["--steps", "0,x"], ["--steps", "-5"], ["--tokens-per-step", "0"], ["--until", "0"]):
        with pytest.raises(SystemExit):
            cli.main(["plan", cfg, *argv])
        assert "expected" in capsys.readouterr().err


# ---- mixer demo ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_cache(demo_shards):
    """The cache folder of the session's demo shards (generated once)."""
    pattern = Path(next(iter(demo_shards.values())))
    final = next(p for p in pattern.parents if p.name == f"v{demo.FORMAT_VERSION}")
    return str(final.parent)


def test_demo_in_process(demo_cache, tmp_path, capsys):
    report_path = tmp_path / "demo.json"
    assert (
        cli.main(["demo", "--steps", "25", "--workers", "0", "--cache-dir", demo_cache, "--report", str(report_path)])
        == 0
    )
    out = capsys.readouterr().out
    rep = strict_json(report_path)
    assert rep["command"] == "demo" and rep["batches"] == 25
    assert list(rep["sources"]) == list(cli.DEMO_WEIGHTS)
    for name, w in cli.DEMO_WEIGHTS.items():
        assert rep["sources"][name]["target"] == pytest.approx(w)
        assert abs(rep["sources"][name]["error"]) < 0.05
    assert stats.format_table(stats.report(rep["stats"])) in out


@pytest.mark.slow
def test_console_script(demo_cache):
    script = Path(sys.executable).with_name("mixer")
    assert script.exists(), f"{script}: the console script is not installed (pip install -e .)"
    proc = subprocess.run(
        [str(script), "demo", "--steps", "20", "--workers", "0", "--cache-dir", demo_cache],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "20 batches" in proc.stdout and proc.stdout.count("\n") >= 6
    for name in cli.DEMO_WEIGHTS:
        assert any(line.startswith(name + " ") for line in proc.stdout.splitlines())
    assert "20/20" in proc.stderr  # the progress bar


# ---- signals and pipes, in real subprocesses ----------------------------------------------------


def cli_command(*args):
    """``python -m mixer.cli.commands ...`` importing this checkout's mixer, with its environment."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return [sys.executable, "-m", "mixer.cli", *args], env


@pytest.mark.slow
@pytest.mark.parametrize("workers, whole_group", [(0, False), (2, True)])
def test_ctrl_c_during_run_prints_the_summary_writes_the_report_and_exits_130(
    three_sources, tmp_path, workers, whole_group
):
    # whole_group: SIGINT to the process group, as a terminal's Ctrl-C does (the DataLoader workers
    # get it too); otherwise to the main process alone (kill -INT).
    import signal
    import threading
    import time

    cfg = write_config(tmp_path / "mix.yaml", run_config(three_sources))
    report_path = tmp_path / "r.json"
    argv, env = cli_command(
        "run", cfg, "--steps", "1000000", "--workers", str(workers), "--log-every", "5", "--report", str(report_path)
    )
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=str(tmp_path), start_new_session=True
    )
    err = bytearray()

    def read_stderr():
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            err.extend(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while b"step 14 |" not in err:  # a log line: at least 15 batches streamed
            assert proc.poll() is None and time.monotonic() < deadline, err.decode(errors="replace")
            time.sleep(0.05)
        if whole_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    out, stderr = out.decode(), err.decode(errors="replace")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    rep = strict_json(report_path)
    n = rep["batches"]
    assert rep["interrupted"] is True and 15 <= n < 1_000_000 and rep["stats"]["batches"] == n
    assert sum(s["samples"] for s in rep["sources"].values()) == rep["samples"] > 0
    assert sum(s["tokens"] for s in rep["sources"].values()) == rep["tokens"]
    # The summary printed is the table of that report, then what happened.
    assert stats.format_table(stats.report(rep["stats"])) in out
    assert f"interrupted (Ctrl-C) after {n:,} of 1,000,000 batches" in out and f"report written to {report_path}" in out


@pytest.mark.slow
def test_plan_into_a_pipe_closed_early_exits_quietly(tmp_path):
    # `mixer plan x.yaml | head -n 3` with far more output than a pipe buffer holds: head exits after
    # three lines and the next write fails with EPIPE. No traceback, the status of a SIGPIPE death.
    cfg = write_config(
        tmp_path / "plan.yaml",
        {
            "batching": {"max_tokens": 1000},
            "sources": [
                {"name": "a", "urls": "/nowhere/a-{0..9}.tar", "weight": 1},
                {"name": "b", "urls": "/nowhere/b-{0..9}.tar", "weight": 3},
            ],
        },
    )
    steps = ",".join(str(s) for s in range(0, 20000))
    argv, env = cli_command("plan", cfg, "--steps", steps)
    plan = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    head = subprocess.Popen(["head", "-n", "3"], stdin=plan.stdout, stdout=subprocess.PIPE)
    plan.stdout.close()  # only head holds the reading end now
    shown, _ = head.communicate(timeout=120)
    _, stderr = plan.communicate(timeout=120)
    assert len(shown.decode().splitlines()) == 3
    assert stderr.decode() == "" and plan.returncode == cli.BROKEN_PIPE
