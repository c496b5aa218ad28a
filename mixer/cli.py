"""The ``mixer`` command: ``mixer demo`` streams the built-in demo mixture and reports the mix."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from tqdm import tqdm

from .bucket import TokenBudget
from .loader import make_loader
from .mixture import Mixture
from .source import Source
from .stats import RunStats, format_table

DEMO_WEIGHTS = {"prose": 0.5, "code": 0.3, "books": 0.2}


def _stream(mixture: Mixture, *, steps: int, workers: int) -> RunStats:
    loader = make_loader(mixture, num_workers=workers)
    stats = RunStats(mixture)
    with tqdm(total=steps, unit="batch", dynamic_ncols=True) as bar:
        for batch in loader:
            stats.update(batch)
            bar.update(1)
            if stats.num_batches % 20 == 0:
                bar.set_postfix(tok_s=f"{stats.tokens.sum() / bar.format_dict['elapsed']:,.0f}" if bar.format_dict["elapsed"] else "-")
            if stats.num_batches >= steps:
                break
    return stats


def _demo(args: argparse.Namespace) -> int:
    from .demo import ensure_demo_shards

    patterns = ensure_demo_shards(args.cache_dir)
    sources = [Source(name, patterns[name], weight=DEMO_WEIGHTS[name]) for name in DEMO_WEIGHTS]
    mixture = Mixture(sources, batching=TokenBudget(max_tokens=args.max_tokens, max_length=args.max_tokens), seed=args.seed)
    print(f"demo sources: {', '.join(f'{s.name} ({len(s.shards)} shards)' for s in sources)}")
    print("source sizes (tokens, estimated up front): " + ", ".join(f"{k}={v:,.0f}" for k, v in mixture.sizes.items()))
    stats = _stream(mixture, steps=args.steps, workers=args.workers)
    summary = stats.summary()
    print(format_table(summary))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream the built-in demo mixture (prose/code/books) and report the mix")
    demo.add_argument("--steps", type=int, default=300, help="batches to stream (default 300)")
    demo.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    demo.add_argument("--max-tokens", type=int, default=32768, help="token budget per batch (default 32768)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cache-dir", default=None, help="where demo shards are generated (default ~/.cache/mixer/demo)")
    demo.add_argument("--report", default=None, help="write the final report as JSON to this file")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
