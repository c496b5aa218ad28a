"""The ``mixer`` command.

- ``mixer demo``: stream the built-in demo mixture (generated on first use) and report the mix;
- ``mixer run CONFIG --steps N``: stream a config's mixture and report target vs realized shares;
- ``mixer plan CONFIG``: print the schedule's target shares at chosen steps, reading no shard;
- ``mixer index SOURCES...``: build or refresh the shard index of shard patterns or of a config's
  sources (only new or changed shards are read), so that mixtures read nothing up front and split
  shards between readers by sample ranges (``Source(index=True)``);
- ``mixer pretokenize SOURCES... -o DIR --tokenizer FILE``: tokenize raw text shards once into
  ``tokens.npy`` shards and their index, in parallel, resumable.
- ``mixer info`` (and ``mixer --version``): the version, which compiled cores are active, the extras found.

``run`` and ``demo`` show a progress bar (batches, tokens/s) and end with a per-source table;
``--report FILE.json`` writes it as JSON and ``--plot FILE.png`` draws it (needs matplotlib:
``pip install 'wds-mixer[plot]'``). Ctrl-C ends the stream early: the table, report and plot then
cover the batches streamed so far, and the exit status is 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mixer.batching.batch import Batch
from mixer.cli.info import add_info_command
from mixer.cli.progress import Progress
from mixer.config.mixture_config import MixtureConfig, build_mixture, parse_config
from mixer.errors import ConfigError, MixerError
from mixer.mixing.adaptive import Adaptive
from mixer.mixing.mixture import Mixture
from mixer.mixing.schedule import Curriculum, Floored, Schedule, SourceInfo, Static, Temperature, check_schedule
from mixer.observe.stats import (
    DEFAULT_WINDOW,
    History,
    check_plotting,
    format_table,
    human,
    log_every,
    plot_run,
    plot_schedule,
    report,
)
from mixer.runtime.loader import Loader, make_loader
from mixer.spec.budget import TokenBudget
from mixer.spec.source import Source

DEMO_WEIGHTS = {"prose": 0.5, "code": 0.3, "books": 0.2}
INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C (128 + SIGINT), as shells report it
BROKEN_PIPE = 141  # 128 + SIGPIPE: what `cmd | head` reports for a command whose reader went away
PLAN_POINTS = 600  # evaluation points of the plan plot over the whole horizon


# ----------------------------------------------------------------------------------- run / demo


def _stream(loader: Loader, *, steps: int, every: int, history: History | None) -> tuple[dict[str, Any], bool]:
    """Stream ``steps`` batches (fewer if the mixture ends) with a progress bar; returns
    ``loader.stats()`` and whether Ctrl-C (KeyboardInterrupt) ended the stream early."""
    batches: Iterator[Batch] = iter(log_every(loader, every) if every else loader)
    tokens = 0
    interrupted = False
    progress = Progress(steps)
    try:
        with progress as bar:
            start = time.perf_counter()
            for k, batch in enumerate(batches, 1):
                tokens += batch.meta.tokens
                if history is not None:
                    history.update(batch)
                bar.update(1)
                if k % 10 == 0 or k == steps:
                    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
                if k >= steps:
                    break
    except KeyboardInterrupt:
        interrupted = True
    except Exception:
        if not progress.ctrl_c:  # a Ctrl-C that a finalizer swallowed, then the workers it stopped gone
            raise
        interrupted = True
    finally:
        # Ends the loader's iteration now (its DataLoader workers shut down before the summary).
        close = getattr(batches, "close", None)
        if callable(close):
            close()
    return loader.stats(), interrupted


def _run_mixture(mixture: Mixture, args: argparse.Namespace, command: str) -> int:
    if args.plot:
        check_plotting()  # now, not after a long run
    loader = make_loader(mixture, num_workers=args.workers, stats_window=args.window)
    history = History(mixture.names, unit=mixture.unit) if args.plot else None
    stats, interrupted = _stream(loader, steps=args.steps, every=args.log_every, history=history)
    rep = report(stats)
    print(format_table(rep))
    if interrupted:
        print(f"interrupted (Ctrl-C) after {stats['batches']:,} of {args.steps:,} batches; the table covers them")
    elif stats["batches"] < args.steps:
        print(f"the mixture ended after {stats['batches']:,} of {args.steps:,} batches (stop={mixture.stop!r})")
    if args.report:
        out = {
            "command": command,
            "steps": args.steps,
            "workers": args.workers,
            "interrupted": interrupted,
            **rep,
            "stats": stats,
        }
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, allow_nan=False)
        print(f"report written to {args.report}")
    if args.plot:
        assert history is not None
        plot_run(history, args.plot)
        print(f"plot written to {args.plot}")
    return INTERRUPTED if interrupted else 0


def _demo(args: argparse.Namespace) -> int:
    from mixer.cli.demo import ensure_demo_shards

    patterns = ensure_demo_shards(args.cache_dir)
    sources = [Source(name, patterns[name], weight=DEMO_WEIGHTS[name]) for name in DEMO_WEIGHTS]
    mixture = Mixture(
        sources, batching=TokenBudget(max_tokens=args.max_tokens, max_length=args.max_tokens), seed=args.seed
    )
    print(f"demo sources: {', '.join(f'{s.name} ({len(s.shards)} shards)' for s in mixture.listed)}")
    print("source sizes (tokens, estimated up front): " + ", ".join(f"{k}={v:,.0f}" for k, v in mixture.sizes.items()))
    return _run_mixture(mixture, args, "demo")


def _run(args: argparse.Namespace) -> int:
    spec = _parse(args.config)
    mixture = build_mixture(spec)
    given = {s.name for s in spec.sources if s.size is not None}
    print(f"{args.config}: {len(mixture.sources)} sources, schedule {_describe(spec.schedule)}")
    print(
        "source sizes (tokens): "
        + ", ".join(f"{k}={v:,.0f}{'' if k in given else ' (estimated)'}" for k, v in mixture.sizes.items())
    )
    return _run_mixture(mixture, args, "run")


# ------------------------------------------------------------------------------------------ plan


def _parse(path: str) -> MixtureConfig:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    return parse_config(path)


def _describe(schedule: Schedule | None) -> str:
    if schedule is None or isinstance(schedule, Static):
        return "static (the sources' weights)"
    if isinstance(schedule, Floored):
        return f"{_describe(schedule.schedule)}, min_prob {schedule.min_prob:g}"
    if isinstance(
        schedule, Adaptive
    ):  # the targets move only with loss from a training loop, which `mixer run` has not
        return (
            f"adaptive ({schedule.policy}, an update every {schedule.update_every} steps) over "
            f"{_describe(schedule.schedule)}; no training loop reports loss here, so its targets stay the prior's"
        )
    if isinstance(schedule, Curriculum):
        t = f" with temperature {schedule.temperature.start:g}" if schedule.temperature is not None else ""
        return f"curriculum of {len(schedule.phases)} phases over {schedule.unit}{t}"
    return type(schedule).__name__


def _landmarks(schedule: Schedule, tokens_per_step: float) -> list[float]:
    """Steps where the schedule changes behaviour: phase boundaries, ramp ends, temperature ends."""

    def steps(x: float, unit: str | None) -> float:
        return x / tokens_per_step if unit == "tokens" else x

    if isinstance(schedule, Floored):
        return _landmarks(schedule.schedule, tokens_per_step)
    if isinstance(schedule, Temperature):
        return [steps(float(schedule.steps or schedule.tokens or 0), schedule.unit)] if schedule.unit else []
    if isinstance(schedule, Curriculum):
        out = []
        for k, phase in enumerate(schedule.phases):
            start = schedule.start(k)
            if k:
                out += [steps(start, schedule.unit), steps(start + float(phase.ramp), schedule.unit)]
            t = phase.temperature
            if t is not None and t.unit is not None:
                out.append(steps(start + float(t.steps or t.tokens or 0), schedule.unit))
        if schedule.temperature is not None:
            out += _landmarks(schedule.temperature, tokens_per_step)
        return out
    return []


def _phase_of(schedule: Schedule, step: float, tokens: float) -> int | None:
    if isinstance(schedule, Floored):
        return _phase_of(schedule.schedule, step, tokens)
    if isinstance(schedule, Curriculum):
        return schedule.phase_at(tokens if schedule.unit == "tokens" else step)
    return None


def _evaluate(schedule: Schedule, info: SourceInfo, steps: np.ndarray, tokens_per_step: float) -> np.ndarray:
    return np.array([schedule.probs(info, int(s), float(s) * tokens_per_step) for s in steps], dtype=np.float64)


def _plan_info(
    spec: MixtureConfig, schedule: Schedule, steps: np.ndarray, tokens_per_step: float
) -> tuple[SourceInfo, list[str]]:
    """The schedule's view of the sources, from the config alone. A source without ``size`` gets a
    stand-in size; if the plan depends on the stand-in (the schedule uses sizes), that is an error."""
    names = tuple(s.name for s in spec.sources)
    missing = [s.name for s in spec.sources if s.size is None]

    def info(fill: np.ndarray) -> SourceInfo:
        sizes = np.array(
            [s.size if s.size is not None else fill[i] for i, s in enumerate(spec.sources)], dtype=np.float64
        )
        return SourceInfo(
            names=names,
            weights=np.array([s.weight for s in spec.sources], dtype=np.float64),
            sizes=sizes,
            groups=tuple(s.group for s in spec.sources),
        )

    one = info(np.ones(len(names)))
    if missing:
        other = info(np.geomspace(3.0, 3.0 ** len(names), len(names)))
        check_schedule(schedule, other)
        if not np.allclose(
            _evaluate(schedule, one, steps, tokens_per_step),
            _evaluate(schedule, other, steps, tokens_per_step),
            rtol=0,
            atol=1e-12,
        ):
            raise ConfigError(
                f"this schedule depends on source sizes (temperature or hierarchical weights on sizes), and "
                f"mixer plan reads no shard: give 'size' (tokens) in the config for {', '.join(map(repr, missing))}, "
                f"or use `mixer run`, which estimates sizes from the shards"
            )
    check_schedule(schedule, one)
    return one, missing


def _step_list(text: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated steps such as 0,1000,5000 (got {text!r})") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated steps >= 0 (got {text!r})")
    return sorted(set(values))


def _plan(args: argparse.Namespace) -> int:
    spec = _parse(args.config)
    if args.plot:
        check_plotting()
    schedule: Schedule = spec.schedule if spec.schedule is not None else Static()
    tps = float(args.tokens_per_step) if args.tokens_per_step else float(spec.batching.max_tokens)
    landmarks = sorted({math.ceil(x - 1e-9) for x in _landmarks(schedule, tps) if x > 0})
    horizon = args.until or (math.ceil(1.25 * landmarks[-1]) if landmarks else 1000)
    if args.steps:
        horizon = max(horizon, args.steps[-1])
        table_steps = np.array(args.steps)
    else:
        table_steps = np.array(sorted({0, *[x for x in landmarks if x <= horizon], horizon}))
    marks = [0.0, *[float(x) for x in landmarks if x < horizon], float(horizon)]
    grid = np.unique(
        np.concatenate(
            [
                np.linspace(0, horizon, PLAN_POINTS),
                *[np.linspace(a, b, 60) for a, b in zip(marks[:-1], marks[1:])],
                table_steps,
            ]
        ).round()
    )
    info, missing = _plan_info(spec, schedule, np.unique(np.concatenate([grid, table_steps])), tps)
    names = list(info.names)

    print(f"{args.config}: {len(names)} sources, schedule {_describe(spec.schedule)}")
    source = (
        "from --tokens-per-step"
        if args.tokens_per_step
        else "batching.max_tokens: an upper bound for one rank; pass --tokens-per-step with the real tokens per step "
        "over all ranks"
    )
    print(f"tokens seen = step x {tps:,.0f} tokens per step ({source})")
    if missing:
        print(f"no size given for {', '.join(missing)} (not needed: this schedule does not use sizes)")
    probs = _evaluate(schedule, info, table_steps, tps)
    phases = [_phase_of(schedule, s, s * tps) for s in table_steps]
    header = ["step", "tokens"] + (["phase"] if phases[0] is not None else []) + names
    rows = [header]
    for s, p, k in zip(table_steps, probs, phases):
        rows.append([f"{int(s):,}", human(s * tps)] + ([str(k)] if k is not None else []) + [f"{v:.4f}" for v in p])
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    print("\n".join(lines))
    if args.plot:
        plot_schedule(
            names,
            grid,
            _evaluate(schedule, info, grid, tps),
            args.plot,
            tokens_per_step=tps,
            boundaries=[x for x in landmarks if x < horizon],
            title=f"{os.path.basename(args.config)}: target share per source",
        )
        print(f"plot written to {args.plot}")
    return 0


# ----------------------------------------------------------------------------------------- index


def _index(args: argparse.Namespace) -> int:
    from mixer.plan.index import build_index

    sources: list[Source | str] = []
    for item in args.sources:
        if os.path.isfile(item) and item.endswith((".yaml", ".yml", ".json")):
            sources += _parse(item).sources  # a config: its sources, with their decode and length
        else:
            sources.append(item)  # a shard pattern, read with the default decode
    for src in sources:
        name = src.name if isinstance(src, Source) else src
        idx = build_index(src, location=args.location, workers=args.workers, progress=not args.quiet)
        where = ", ".join(idx.locations)
        print(
            f"{name}: {len(idx.shards):,} shards, {int(idx.counts.sum()):,} samples, {int(idx.tokens.sum()):,} tokens; "
            f"{len(idx.reindexed):,} shard(s) read, {len(idx.shards) - len(idx.reindexed):,} up to date -> {where}"
        )
    return 0


# ----------------------------------------------------------------------------------- pretokenize


def _token(text: str | None) -> int | str | None:
    """A token given on the command line: an id (digits) or the token itself."""
    return int(text) if text is not None and text.isdigit() else text


def _pretokenize(args: argparse.Namespace) -> int:
    from mixer.plan.pretokenize import pretokenize
    from mixer.read.text import TextDecode

    decode = TextDecode(args.tokenizer, field=args.field, eos=_token(args.eos), bos=_token(args.bos))
    done = pretokenize(
        list(args.sources),
        args.output,
        decode=decode,
        max_length=args.max_length,
        dtype=args.dtype,
        workers=args.workers,
        progress=not args.quiet,
    )
    skipped = f", {done.skipped:,} bad sample(s) skipped" if done.skipped else ""
    print(
        f"{len(done.shards):,} shards ({len(done.written):,} written now, {len(done.shards) - len(done.written):,} "
        f"complete before), {done.samples:,} samples, {done.tokens:,} tokens{skipped} -> {args.output} (index "
        f"{done.index})"
    )
    return 0


# ---------------------------------------------------------------------------------------- parser


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer (got {text!r})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum} (got {value})")
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _stream_options(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--steps", type=_positive, default=steps, metavar="N", help=f"batches to stream (default {steps})")
    p.add_argument(
        "--workers",
        type=_non_negative,
        default=2,
        metavar="N",
        help="DataLoader workers (default 2; 0 reads in this process)",
    )
    p.add_argument(
        "--window",
        type=_positive,
        default=DEFAULT_WINDOW,
        metavar="N",
        help=f"batches in the stats window (default {DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--log-every",
        type=_non_negative,
        default=0,
        metavar="N",
        help="log a line of window stats every N batches, and warn about starved sources (default: off)",
    )
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the final report as JSON to this file")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw target and realized share per source over steps (needs matplotlib)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="stream the built-in demo mixture (prose/code/books) and report the mix")
    _stream_options(demo, 300)
    demo.add_argument(
        "--max-tokens", type=_positive, default=32768, metavar="N", help="token budget per batch (default 32768)"
    )
    demo.add_argument("--seed", type=int, default=0, metavar="N", help="the mixture's seed (default 0)")
    demo.add_argument(
        "--cache-dir", default=None, metavar="DIR", help="where demo shards are generated (default ~/.cache/mixer/demo)"
    )
    demo.set_defaults(func=_demo)

    run = sub.add_parser("run", help="stream a config's mixture and report target vs realized shares")
    run.add_argument("config", help="a YAML config (see examples/)")
    _stream_options(run, 1000)
    run.set_defaults(func=_run)

    plan = sub.add_parser(
        "plan", help="print (and plot) the target share of every source over training, reading no shard"
    )
    plan.add_argument("config", help="a YAML config (see examples/)")
    plan.add_argument(
        "--steps",
        type=_step_list,
        default=None,
        metavar="S0,S1,...",
        help="global steps for the table (default: 0, every phase boundary and ramp end, and the horizon)",
    )
    plan.add_argument(
        "--until",
        type=_positive,
        default=None,
        metavar="STEP",
        help="last step of the plot (default: 1.25 x the last boundary, or 1000)",
    )
    plan.add_argument(
        "--tokens-per-step",
        type=float,
        default=None,
        metavar="T",
        help="tokens seen per global step, over all ranks (default: batching.max_tokens)",
    )
    plan.add_argument(
        "--plot", default=None, metavar="FILE.png", help="draw the schedule over training (needs matplotlib)"
    )
    plan.set_defaults(func=_plan)

    index = sub.add_parser(
        "index",
        help="build or refresh shard indexes (sample offsets and token lengths), reading only new or changed shards",
        description="Index shards: per shard its size, validator, sample count, and each sample's byte range and "
        "token length. Written next to the shards (<dir>/mixer-index.json.gz) or to --location. Use it with "
        "Source(index=True) (config: 'index: true'): nothing is read up front, and readers split shards by sample "
        "ranges.",
    )
    index.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a shard pattern (brace pattern, folder, glob or remote prefix; default decode) or a config file (its "
        "sources)",
    )
    index.add_argument(
        "--location",
        default=None,
        metavar="PATH_OR_URL",
        help="the index file (local or fsspec URL; sources decoded alike may share one; default: mixer-index.json.gz "
        "in each shard directory)",
    )
    index.add_argument("--workers", type=_positive, default=8, metavar="N", help="shards read at once (default 8)")
    index.add_argument("--quiet", action="store_true", help="no progress bar")
    index.set_defaults(func=_index)

    pre = sub.add_parser(
        "pretokenize",
        help="tokenize raw text shards once into tokens.npy shards and their index (resumable, in parallel)",
        description="Tokenize text shards (a txt member, or a key of a json member) with a Hugging Face tokenizer "
        "into tokens.npy shards of the same names in OUTPUT, and index them (OUTPUT/mixer-index.json.gz): train on "
        "them with Source(name, 'OUTPUT/', index=True). Run again after an interruption, it converts only the shards "
        "not yet complete.",
    )
    pre.add_argument(
        "sources", nargs="+", metavar="SOURCE", help="shard patterns (brace pattern, folder, glob or remote prefix)"
    )
    pre.add_argument("--output", "-o", required=True, metavar="DIR", help="the local directory the token shards go to")
    pre.add_argument("--tokenizer", required=True, metavar="FILE", help="a tokenizer.json (Hugging Face tokenizers)")
    pre.add_argument(
        "--field",
        default="txt",
        metavar="FIELD",
        help="where the text is: a member ('txt'), or 'json:KEY' (default txt)",
    )
    pre.add_argument("--eos", default=None, metavar="TOKEN", help="a token (or id) added at the end of every document")
    pre.add_argument(
        "--bos", default=None, metavar="TOKEN", help="a token (or id) added at the start of every document"
    )
    pre.add_argument(
        "--max-length", type=_positive, default=None, metavar="N", help="cut documents into chunks of at most N tokens"
    )
    pre.add_argument(
        "--dtype", choices=["int32", "uint16"], default="int32", help="of the token arrays (default int32)"
    )
    pre.add_argument("--workers", type=_positive, default=None, metavar="N", help="processes (default: one per CPU)")
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    pre.set_defaults(func=_pretokenize)
    add_info_command(parser, sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tokens_per_step", None) is not None and not (
        math.isfinite(args.tokens_per_step) and args.tokens_per_step > 0
    ):
        build_parser().error(f"--tokens-per-step: expected a number > 0 (got {args.tokens_per_step!r})")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if getattr(args, "log_every", 0):
        logging.getLogger("mixer.observe.stats").setLevel(logging.INFO)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is seen below and not at interpreter exit
        return status
    except MixerError as exc:
        print(f"mixer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before or after streaming (while streaming, _stream handles it)
        print(f"mixer {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (`mixer plan x.yaml | head`): stop quietly. Python's
        # documented recipe: point stdout at devnull, or the flush at exit fails again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
