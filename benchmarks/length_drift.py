"""Length drift inside a small source under ``stop="never"``: is what it delivers in a window an
unbiased sample of its own lengths?

A small source (``SMALL`` samples: half short documents, half long ones, in 4 shards; ``--quick``:
fewer) mixed with a big one (log-normal lengths) at a quarter of the tokens, ``TokenBudget(16384)``,
one reader in this process, until the small source has delivered ``EPOCHS`` epochs' worth of its
tokens. For the small source, for each ``mix``:

* TV ½ / 1 / 2: total variation between the length histogram of its samples delivered within the
  first ½, 1 and 2 epochs' worth of its tokens and the histogram of the source itself (16 bins);
* double: the fraction of its samples delivered twice before all were delivered once (and, over
  every source-epoch of the run, the most delivered ``k + 1`` times before all ``k`` times; when a
  run ends before all were delivered once, those delivered twice by then), and the fraction never
  delivered in the run;
* padding efficiency (real tokens / padded slots) and batch fill (real tokens / ``max_tokens``) of
  its batches (``mix="sample"``: of all batches, the buckets being shared).

Variants: the library as it is (``default``); the same without a small source's wait bound (each
bucket waits while twice its number of buckets of batches leave, as for a large source: ``old
wait``, the epoch close alone); and with
``--baseline DIR`` the code checked out at ``DIR`` (e.g. a worktree of an older commit), run in a
subprocess with ``DIR`` first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import common

NAME = "length_drift"
SMALL = {"full": 1536, "quick": 384}
BIG = {"full": 24_000, "quick": 1_500}
SHORT = (48, 160)
LONG = (640, 1024)
MAX_TOKENS = 16384
EPOCHS = 2
FRACTIONS = (0.5, 1.0, 2.0)
BINS = np.linspace(0, LONG[1], 17)
MIXES = ("batch", "sample")


def write_shards(root: Path, small: int, big: int) -> tuple[dict[str, str], list[int]]:
    """The two sources' shards (``webdataset.ShardWriter``): ``{name: brace pattern}`` and the small
    source's lengths."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    half = small // 2
    lengths = {
        "small": rng.permutation(np.concatenate([rng.integers(*SHORT, half), rng.integers(*LONG, small - half)])),
        "big": np.clip(np.round(rng.lognormal(np.log(300), 0.8, big)), 16, 2048).astype(int),
    }
    patterns = {}
    for name, lens in lengths.items():
        shards = 4 if name == "small" else 8
        per = -(-len(lens) // shards)
        with wds.ShardWriter(str(root / f"{name}-%06d.tar"), maxcount=per, verbose=0) as writer:
            for i, n in enumerate(lens.tolist()):
                writer.write({"__key__": f"{name}-{i:06d}", "tokens.npy": np.full(n, i % 50_000, dtype=np.int32)})
        patterns[name] = str(root / f"{name}-{{000000..{shards - 1:06d}}}.tar")
    return patterns, lengths["small"].tolist()


def measure(patterns: dict[str, str], small: list[int], mix: str, variant: str) -> dict[str, Any]:
    """Run the mixture until the small source (of these lengths) delivered ``EPOCHS`` epochs' worth
    of its tokens; its figures."""
    import mixer
    from mixer.plan.world import World

    sources = [mixer.Source("small", patterns["small"], weight=0.25), mixer.Source("big", patterns["big"], weight=0.75)]
    m = mixer.Mixture(sources, batching=mixer.TokenBudget(MAX_TOKENS), mix=mix, stop="never", seed=0)  # type: ignore[arg-type]
    reader = m.reader(World())
    if variant == "old wait":
        for b in reader.batchers:
            b.epoch_wait = None  # type: ignore[attr-defined]
    total = sum(small)
    own: list[int] = []
    keys: list[str] = []
    real = padded = batches = delivered = 0
    for batch in reader:
        mine = (batch.source == 0).numpy()
        lengths = batch.lengths.numpy()
        if mix == "sample" or mine.all():
            real += int(lengths.sum())
            padded += int(batch.tokens.numel())
            batches += 1
        if mine.any():
            own += lengths[mine].tolist()
            keys += [k for k, s in zip(batch.keys, mine) if s]
            delivered += int(lengths[mine].sum())
            if delivered >= EPOCHS * total:
                break
    ref = np.histogram(small, BINS)[0] / len(small)
    cum = np.cumsum(own)
    tv, hists = {}, {}
    for f in FRACTIONS:
        upto = int(np.searchsorted(cum, f * total)) + 1
        hist = np.histogram(own[:upto], BINS)[0] / upto
        tv[f], hists[f] = 0.5 * float(np.abs(hist - ref).sum()), hist.tolist()
    first, worst, never = doubles(keys, len(small))
    return {
        "mix": mix,
        "variant": variant,
        **{f"tv_{f:g}": v for f, v in tv.items()},
        **{f"hist_{f:g}": h for f, h in hists.items()},
        "hist_source": ref.tolist(),
        "double_first": first,
        "double_worst": worst,
        "never_delivered": never,
        "padding_efficiency": real / padded,
        "batch_fill": real / (batches * MAX_TOKENS),
        "batches": batches,
        "small_samples": len(keys),
    }


def doubles(keys: list[str], n: int) -> tuple[float, float, float]:
    """From the ``n`` samples' deliveries in order (``keys``): the fraction delivered twice before
    all were delivered once (when not all were by the end of the run: those delivered twice by
    then, a lower bound); the most, over the source-epochs of the run, delivered ``k + 1`` times
    before all were delivered ``k`` times (the same lower bound for the last); the fraction never
    delivered in the run."""
    counts: Counter[str] = Counter()
    k, at_k, worst, first = 1, 0, 0.0, None
    for key in keys:
        counts[key] += 1
        if counts[key] == k:
            at_k += 1
        if at_k == n:
            over = sum(1 for c in counts.values() if c > k) / n
            first = over if k == 1 else first
            worst = max(worst, over)
            k += 1
            at_k = sum(1 for c in counts.values() if c >= k)
    over = sum(1 for c in counts.values() if c > k) / n
    return (over if first is None else first), max(worst, over), 1 - len(counts) / n


def _baseline(code: Path, patterns: dict[str, str], small: list[int], mix: str) -> dict[str, Any]:
    """`measure` with the mixer of ``code`` (imported from there first), in a subprocess."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import mixer.mixing.mixture; sys.path[0] = sys.argv[2]; "
        "from benchmarks.length_drift import measure; "
        "a = json.loads(sys.stdin.read()); print(json.dumps(measure(a['patterns'], a['small'], a['mix'], 'baseline')))"
    )
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-c", script, str(code), str(common.REPO)],
            input=json.dumps({"patterns": patterns, "small": small, "mix": mix}),
            capture_output=True,
            text=True,
            cwd=cwd,
            check=True,
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    header = ["mix", "code", "TV ½ epoch", "TV 1 epoch", "TV 2 epochs", "delivered twice before all once"]
    header += ["never delivered", "padding eff.", "batch fill"]
    body = [
        [
            r["mix"],
            r["variant"],
            *(f"{r[f'tv_{f:g}']:.3f}" for f in FRACTIONS),
            f"{r['double_first']:.3f} (worst epoch {r['double_worst']:.3f})",
            f"{r['never_delivered']:.3f}",
            f"{r['padding_efficiency']:.3f}",
            f"{r['batch_fill']:.3f}",
        ]
        for r in rows
    ]
    return common.markdown_table(header, body)


def histograms(rows: list[dict[str, Any]]) -> str:
    """The small source's length histogram (fraction of its samples per bin) beside those of what each
    row delivered within ½ and 1 epoch's worth of its tokens; bins that no column fills are left out."""
    header = ["length", "source"] + [f"{r['mix']} {r['variant']} {f:g}" for r in rows for f in FRACTIONS[:2]]
    columns = [rows[0]["hist_source"]] + [r[f"hist_{f:g}"] for r in rows for f in FRACTIONS[:2]]
    body = [
        [f"{BINS[i]:.0f}-{BINS[i + 1]:.0f}", *(f"{c[i]:.3f}" for c in columns)]
        for i in range(len(BINS) - 1)
        if any(c[i] for c in columns)
    ]
    return common.markdown_table(header, body)


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    small_n, big_n = getattr(opts, "small", None) or SMALL[opts.profile], BIG[opts.profile]
    baseline = getattr(opts, "baseline", None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="length_drift-") as tmp:
        patterns, small = write_shards(Path(tmp), small_n, big_n)
        for mix in MIXES:
            variants = [("default", None), ("old wait", None)] + ([("baseline", baseline)] if baseline else [])
            for variant, code in variants:
                r = _baseline(Path(code), patterns, small, mix) if code else measure(patterns, small, mix, variant)
                log(f"mix={mix} {variant}: {r}")
                rows.append(r)
    text = table(rows)
    log("\n" + text + "\n\nLength histograms of the small source (epochs' worth of its tokens):\n" + histograms(rows))
    ours = [r for r in rows if r["variant"] == "default"]
    checks = [
        *(common.value_check(NAME, f"padding efficiency, mix={r['mix']}", r["padding_efficiency"], 0.96) for r in ours),
        *(common.value_check(NAME, f"delivered twice, mix={r['mix']}", r["double_worst"], 0.0, "<=") for r in ours),
    ]
    result_rows = [
        {
            "bench": NAME,
            "method": f"{r['mix']}/{r['variant']}",
            "label": f"mix={r['mix']} {r['variant']}",
            "kind": "quality",
            "status": "ok",
            "note": "",
            **r,
        }
        for r in rows
    ]
    config = {"profile": opts.profile, "small": small_n, "big": big_n, "max_tokens": MAX_TOKENS, "table": text}
    return common.BenchResult(NAME, result_rows, checks, config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.length_drift", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--small", type=int, default=None, help="samples of the small source (default 1536; quick 384)")
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of other code to measure alongside")
    p.add_argument("--bench-dir", type=Path, default=common.DEFAULT_BENCH_DIR)
    return common.standalone(NAME, p, run, argv, tables=("table",))


if __name__ == "__main__":
    sys.exit(main())
