"""Does mixing that listens to the model help? A tiny byte-level language model trained on the CPU
over four sources of clearly different difficulty and size, with the same token budget and seeds,
under static, temperature and adaptive mixing (issue 16).

    python -m benchmarks adaptive [--quick]          # in the suite (one Markdown table)
    python -m benchmarks.adaptive [--quick] [--steps N] [--seeds K] [--png FILE]
        # default: 600 steps, 3 seeds (~25 min here)

Data (written once under ``<bench-dir>/adaptive/``): the built-in demo text (:mod:`mixer.cli.demo`:
``prose`` paragraphs, ``code`` functions, ``books`` long documents), every document cut into chunks
of at most 512 bytes, plus ``dup``: a small, easy source of near-duplicates (8 prose chunks, each
copy with 1% of its bytes replaced at random, 400 copies). The last 5% of each source's documents
are held out; ``dup``'s held-out chunks are fresh near-duplicates of the same 8 chunks.

Model: a byte-level n-gram MLP (12 bytes of context, 24-dim embeddings, one hidden layer of 256),
Adam (lr 1e-2), trained on every real token of each batch (``TokenBudget(max_tokens=4096)``,
``num_workers=0``), in one process. Every method trains on the same real-token budget (``steps``
batches' slots x 0.85, to within one batch) from the same initial weights and the same mixture
seed, for each of ``--seeds`` seeds (model init and mixture seed both).

Methods: ``static`` (size-proportional shares: what concatenating the corpora gives), ``temperature``
(``Temperature(3)`` on the sizes, NeMo's default family), and :class:`mixer.Adaptive` over the
static prior with per-sample mean loss reported through ``loader.feedback`` every step:
``exp_gradient`` (online DoReMi, excess over each source's running minimum, lr 2), ``exp3`` (Online
Data Mixing's bandit, lr 0.002) and ``exp_gradient_ref`` (excess over a reference loss per source:
the same seed's static run's final held-out loss, standing in for DoReMi's reference model; so it
costs one more run), all with smoothing 0.1 and an update every 5 steps (``--quick``) or 20.
Reported: per-source held-out loss (nats/byte) at the end, the worst source and the unweighted mean
over sources (means over seeds; the checks are medians over seeds of the ratio to static), the
realized token shares, and a PNG of the targets over the steps, one line per source (first seed;
needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import common

NAME = "adaptive"
CHUNK, MIN_CHUNK, HELD_OUT = 512, 32, 0.05
MAX_TOKENS, CONTEXT, EMBED, HIDDEN, LR = 4096, 12, 24, 256, 1e-2
STEPS = {"quick": 250, "full": 600}  # the token budget: this many batches' slots x FILL real tokens
FILL = 0.85  # about what TokenBudget fills with real tokens here
SEEDS = {"quick": 1, "full": 3}
METHODS = ("static", "temperature", "exp_gradient", "exp3", "exp_gradient_ref")
EVAL_CHUNKS = {"quick": 48, "full": 256}
UPDATE_EVERY = {"quick": 5, "full": 20}
DUP_TEMPLATES, DUP_SAMPLES, DUP_NOISE = 8, 400, 0.01
FORMAT = 2  # bump when the written data change


# ---- data -------------------------------------------------------------------------------------


def _documents(pattern_root: Path, files: list[str]) -> list[bytes]:
    docs = []
    for name in files:
        with tarfile.open(pattern_root / name) as tar:
            for member in tar:
                if member.name.endswith(".txt"):
                    f = tar.extractfile(member)
                    assert f is not None
                    docs.append(f.read())
    return docs


def _chunks(docs: list[bytes]) -> list[bytes]:
    out = [d[i : i + CHUNK] for d in docs for i in range(0, len(d), CHUNK)]
    return [c for c in out if len(c) >= MIN_CHUNK]


def _write(folder: Path, name: str, chunks: list[bytes], shards: int) -> str:
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(chunks) // shards)
    with wds.ShardWriter(str(folder / f"{name}-%04d.tar"), maxcount=per, verbose=0, mtime=common.MTIME) as w:
        for k, c in enumerate(chunks):
            w.write(
                {
                    "__key__": f"{name}-{k:07d}",
                    "txt": c,
                    "tokens.npy": np.frombuffer(c, dtype=np.uint8).astype(np.int32),
                }
            )
    return str(folder / f"{name}-{{0000..{shards - 1:04d}}}.tar")


def _near_duplicates(templates: list[bytes], n: int, rng: np.random.Generator) -> list[bytes]:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    out = []
    for k in range(n):
        b = np.frombuffer(templates[k % len(templates)], dtype=np.uint8).copy()
        hit = rng.random(len(b)) < DUP_NOISE
        b[hit] = rng.choice(letters, int(hit.sum()))
        out.append(b.tobytes())
    return out


def ensure_data(bench_dir: Path, log: Callable[[str], None], demo_cache: Path | None = None) -> dict[str, Any]:
    """``{"train": {source: pattern}, "held_out": {source: [chunk bytes]}}``, written once (from the
    demo shards in ``demo_cache``, default: the user cache ``mixer demo`` uses)."""
    root = bench_dir / "adaptive" / f"v{FORMAT}"
    manifest = root / "manifest.json"
    if not manifest.exists():
        from mixer.cli.demo import ensure_demo_shards

        t0 = time.perf_counter()
        demo = ensure_demo_shards(demo_cache)
        demo_root = Path(demo["prose"]).parent.parent
        listing = json.loads((demo_root / "manifest.json").read_text())["sources"]
        train, held = {}, {}
        for name in ("prose", "code", "books"):
            docs = _documents(demo_root, listing[name]["files"])
            cut = int(len(docs) * (1 - HELD_OUT))
            chunks = _chunks(docs[:cut])
            train[name] = _write(root / name, name, chunks, 4)
            held[name] = _chunks(docs[cut:])
        rng = np.random.default_rng(16)
        templates = _chunks(_documents(demo_root, listing["prose"]["files"][:1]))[:DUP_TEMPLATES]
        train["dup"] = _write(root / "dup", "dup", _near_duplicates(templates, DUP_SAMPLES, rng), 2)
        held["dup"] = _near_duplicates(templates, 256, rng)
        held_path = root / "held_out.npz"
        np.savez(
            held_path,
            **{f"{n}_{k}": np.frombuffer(c, dtype=np.uint8) for n, cs in held.items() for k, c in enumerate(cs)},
        )
        manifest.write_text(json.dumps({"train": train, "held_out": {n: len(cs) for n, cs in held.items()}}))
        log(f"adaptive: data written to {root} in {time.perf_counter() - t0:.1f} s")
    meta = json.loads(manifest.read_text())
    with np.load(root / "held_out.npz") as z:
        held = {n: [z[f"{n}_{k}"].tobytes() for k in range(count)] for n, count in meta["held_out"].items()}
    return {"train": meta["train"], "held_out": held}


# ---- model ------------------------------------------------------------------------------------


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(257, EMBED), nn.Flatten(), nn.Linear(CONTEXT * EMBED, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 256)
    )


def _per_sample_loss(model: Any, tokens: Any, lengths: Any) -> Any:
    """Mean next-byte loss (nats) per row of ``tokens [B, L]`` over its first ``lengths`` bytes."""
    import torch
    import torch.nn.functional as F

    b, n = tokens.shape
    padded = F.pad(tokens.long(), (CONTEXT, 0), value=256)  # 256: before the start
    contexts = padded.unfold(1, CONTEXT, 1)[:, :n]  # [B, L, C]: the bytes before each position
    mask = torch.arange(n)[None, :] < lengths[:, None]
    logits = model(contexts[mask])
    ce = F.cross_entropy(logits, tokens.long()[mask], reduction="none")
    row = torch.arange(b)[:, None].expand(b, n)[mask]
    return torch.zeros(b, dtype=ce.dtype).index_add_(0, row, ce) / lengths.clamp(min=1).to(ce.dtype), ce


def _evaluate(model: Any, held: dict[str, list[bytes]], limit: int) -> dict[str, float]:
    import torch

    out = {}
    with torch.no_grad():
        for name, chunks in held.items():
            chunks = chunks[:limit]
            lengths = torch.tensor([len(c) for c in chunks])
            tokens = torch.zeros(len(chunks), int(lengths.max()), dtype=torch.int64)
            for i, c in enumerate(chunks):
                tokens[i, : len(c)] = torch.from_numpy(np.frombuffer(c, dtype=np.uint8).astype(np.int64))
            _, ce = _per_sample_loss(model, tokens, lengths)
            out[name] = float(ce.mean())  # per byte, over all held-out bytes
    return out


# ---- methods ----------------------------------------------------------------------------------


def _schedules(profile: str, reference: dict[str, float] | None) -> dict[str, Any]:
    import mixer

    prior = mixer.Temperature(1.0, base="sizes")
    u = UPDATE_EVERY[profile]
    methods = {
        "static": prior,
        "temperature": mixer.Temperature(3.0, base="sizes"),
        "exp_gradient": mixer.Adaptive(prior, policy="exp_gradient", lr=2.0, update_every=u, smoothing=0.1),
        "exp3": mixer.Adaptive(prior, policy="exp3", lr=0.002, update_every=u, smoothing=0.1),
    }
    if reference is not None:
        methods["exp_gradient_ref"] = mixer.Adaptive(
            prior, policy="exp_gradient", lr=2.0, update_every=u, smoothing=0.1, reference=reference
        )
    return methods


def train(data: dict[str, Any], schedule: Any, *, budget: int, seed: int, eval_chunks: int) -> dict[str, Any]:
    """One run: batches until ``budget`` real tokens were trained on, then the held-out loss."""
    import torch

    import mixer

    names = list(data["train"])
    sources = [mixer.Source(n, data["train"][n]) for n in names]
    mix = mixer.Mixture(
        sources,
        batching=mixer.TokenBudget(max_tokens=MAX_TOKENS, max_length=CHUNK),
        schedule=schedule,
        seed=seed,
        shuffle_buffer=256,
    )
    loader = mixer.make_loader(mix)
    adaptive = isinstance(schedule, mixer.Adaptive)
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    tokens = np.zeros(len(names))
    targets, train_loss = [], []
    t0 = time.perf_counter()
    for batch in loader:
        per_sample, ce = _per_sample_loss(model, batch.tokens, batch.lengths)
        loss = ce.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if adaptive:
            loader.feedback(batch, per_sample.detach())
        tokens += np.bincount(batch.source.numpy(), weights=batch.lengths.numpy(), minlength=len(names))
        targets.append(list(batch.meta.target))
        train_loss.append(float(loss.detach()))
        if tokens.sum() >= budget:
            break
    seconds = time.perf_counter() - t0
    held = _evaluate(model, data["held_out"], eval_chunks)
    return {
        "held_out": held,
        "worst": max(held.values()),
        "worst_source": max(held, key=held.__getitem__),
        "mean": float(np.mean(list(held.values()))),
        "tokens": int(tokens.sum()),
        "steps": len(targets),
        "realized": dict(zip(names, (tokens / tokens.sum()).tolist())),
        "targets": targets,
        "train_loss": train_loss,
        "final_target": dict(zip(names, targets[-1])),
        "seconds": seconds,
        "sizes": dict(mix.sizes),
        "adaptive": loader.stats()["adaptive"],
    }


def _average(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Over seeds: the mean held-out loss per source, worst and mean (each the mean of the per-seed
    values), realized shares and final targets; trajectories of the first seed."""
    out = dict(runs[0])
    out["held_out"] = {n: float(np.mean([r["held_out"][n] for r in runs])) for n in names}
    for key in ("worst", "mean", "tokens", "steps", "seconds"):
        out[key] = float(np.mean([r[key] for r in runs]))
    out["worst_source"] = "/".join(sorted({r["worst_source"] for r in runs}))
    out["realized"] = {n: float(np.mean([r["realized"][n] for r in runs])) for n in names}
    out["final_target"] = {n: float(np.mean([r["final_target"][n] for r in runs])) for n in names}
    out["per_seed"] = [{k: r[k] for k in ("held_out", "worst", "mean", "tokens", "steps")} for r in runs]
    return out


def plot(results: dict[str, dict[str, Any]], names: list[str], path: Path) -> None:
    """One panel per method: the target share of every source over the steps (first seed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.6 * len(results), 3.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(results), sharey=True))
    for ax, (method, r) in zip(axes, results.items()):
        t = np.asarray(r["targets"])
        for i, name in enumerate(names):
            ax.plot(np.arange(len(t)), t[:, i], label=name)
        ax.set_title(f"{method}\nworst {r['worst']:.3f}, mean {r['mean']:.3f} nats/byte", fontsize="small")
        ax.set_xlabel("step")
    axes[0].set_ylabel("target token share")
    axes[0].legend(fontsize="small")
    fig.savefig(path, format="png", dpi=90)


def table(results: dict[str, dict[str, Any]], names: list[str]) -> str:
    header = [
        "method",
        *(f"{n} held-out" for n in names),
        "worst (source)",
        "mean",
        "realized token shares " + "/".join(names),
        "final target",
        "steps",
        "s",
    ]
    body = []
    for method, r in results.items():
        body.append(
            [
                method,
                *(f"{r['held_out'][n]:.3f}" for n in names),
                f"{r['worst']:.3f} ({r['worst_source']})",
                f"{r['mean']:.3f}",
                "/".join(f"{r['realized'][n]:.3f}" for n in names),
                "/".join(f"{r['final_target'][n]:.3f}" for n in names),
                f"{r['steps']:.0f}",
                f"{r['seconds']:.1f}",
            ]
        )
    return common.markdown_table(header, body)


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    import torch

    torch.set_num_threads(max(1, getattr(opts, "torch_threads", 1)))
    data = ensure_data(opts.bench_dir, log, getattr(opts, "demo_cache", None))
    names = list(data["train"])
    steps = getattr(opts, "steps", None) or STEPS[opts.profile]
    seeds = list(range(getattr(opts, "seeds", None) or SEEDS[opts.profile]))
    budget = int(steps * MAX_TOKENS * FILL)
    evals = EVAL_CHUNKS[opts.profile]
    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in seeds:
        static = None
        for method in METHODS:
            reference = static["held_out"] if static is not None and method == "exp_gradient_ref" else None
            r = train(data, _schedules(opts.profile, reference)[method], budget=budget, seed=seed, eval_chunks=evals)
            static = r if method == "static" else static
            runs.setdefault(method, []).append(r)
            log(
                f"seed {seed} {method}: held-out {json.dumps({k: round(v, 3) for k, v in r['held_out'].items()})}, "
                f"worst {r['worst']:.3f}, mean {r['mean']:.3f}, {r['steps']} steps [{r['seconds']:.1f} s]"
            )
    results = {m: _average(rs, names) for m, rs in runs.items()}
    png = getattr(opts, "png", None) or opts.bench_dir / f"{NAME}{'.quick' if opts.profile == 'quick' else ''}.png"
    try:
        plot(results, names, Path(png))
        log(f"share trajectories: {png}")
    except ImportError:
        png = None
        log("matplotlib is not installed: no PNG")
    base = results["static"]
    rows, checks = [], []
    for method, r in results.items():
        losses = "/".join(format(r["held_out"][n], ".3f") for n in names)
        note = (
            f"held-out {losses} ({'/'.join(names)}); worst {r['worst']:.3f} ({r['worst_source']}), mean "
            f"{r['mean']:.3f}; vs static: worst {r['worst'] - base['worst']:+.3f}, mean "
            f"{r['mean'] - base['mean']:+.3f}"
        )
        rows.append(
            {
                "bench": NAME,
                "method": method,
                "label": method,
                "kind": "quality",
                "status": "ok",
                "note": note,
                "share": [r["realized"][n] for n in names],
                "wall_s": r["seconds"],
                **{k: v for k, v in r.items() if k not in ("targets", "train_loss")},
            }
        )
        if method != "static":
            for key, what in (("worst", "worst-source"), ("mean", "mean")):
                per = [a[key] / b[key] for a, b in zip(r["per_seed"], base["per_seed"])]
                checks.append(
                    common.value_check(
                        NAME, f"{method}: {what} held-out loss / static's", float(np.median(per)), None, "<="
                    )
                    | {"per_round": per}
                )
    config = {
        "profile": opts.profile,
        "steps": steps,
        "budget_tokens": budget,
        "seeds": seeds,
        "max_tokens": MAX_TOKENS,
        "chunk": CHUNK,
        "eval_chunks": evals,
        "update_every": UPDATE_EVERY[opts.profile],
        "sources": names,
        "sizes": base["sizes"],
        "png": png,
        "targets": None,
        "table": table(results, names),
        "trajectories": {m: r["targets"] for m, r in results.items()},
    }
    return common.BenchResult(NAME, rows, checks, config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help=f"{STEPS['quick']} steps per method (about 1-2 minutes on 2 cores)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps per method (default {STEPS['full']}; {STEPS['quick']} with --quick)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help=f"seeds per method (default {SEEDS['full']}; {SEEDS['quick']} with --quick)",
    )
    p.add_argument(
        "--png",
        type=Path,
        default=None,
        help="where to draw the target shares over steps (default <bench-dir>/adaptive[.quick].png)",
    )
    p.add_argument("--bench-dir", type=Path, default=common.DEFAULT_BENCH_DIR)
    p.add_argument(
        "--demo-cache",
        type=Path,
        default=None,
        help="where the demo shards are (made on first use; default: mixer demo's cache)",
    )
    return common.standalone(NAME, p, run, argv, tables=("table",))


if __name__ == "__main__":
    sys.exit(main())
