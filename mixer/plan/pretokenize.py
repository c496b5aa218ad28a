"""Tokenizing a text corpus once, offline (``mixer pretokenize``, :func:`pretokenize`): raw text shards
in, ``tokens.npy`` shards and their shard index out, so that training reads token arrays through the
default decode's compiled fast lane and starts with nothing to look at (``Source(index=True)``).

Each input shard becomes one output shard of the same name (``web-000003.tar.gz`` →
``web-000003.tar``) in the output directory, holding one sample per document (its key, its tokens
as :class:`~mixer.TextDecode` makes them) or, with ``max_length``, one per chunk (``key#k``, as a
text stream cuts them). Shards are converted by ``workers`` processes at once with a progress bar.

Resumable: every shard is written to a temporary file and renamed into place when complete, so an
interrupted run leaves complete shards and temporary files; run again, it deletes the temporary
files, skips the complete shards and converts the rest. The output directory records what it was
made with (``pretokenize.json``: the decode, including a digest of the tokenizer, the chunk length
and the dtype) and refuses to be continued with anything else. The index
(:func:`mixer.build_index`, ``mixer-index.json.gz`` in the output directory) is built last.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mixer import _check, storage
from mixer.errors import ConfigError, MixerError, SampleError
from mixer.plan.index import build_index
from mixer.read.decode import Sample
from mixer.read.tario import read_samples
from mixer.read.text import TextDecode, chunk_samples
from mixer.spec.source import Source
from mixer.storage.compressed import SHARD_SUFFIXES

__all__ = ["Pretokenized", "pretokenize"]

log = logging.getLogger(__name__)

MANIFEST = "pretokenize.json"
RUN = 64  # documents tokenized in one encode_batch call
MTIME = 0  # every member's modification time: the same corpus and tokenizer give the same bytes
DTYPES = ("int32", "uint16")


@dataclass(frozen=True)
class Pretokenized:
    """What :func:`pretokenize` made: the output ``shards`` (in input order), those it ``written``
    this time (the others were complete already), the samples it ``skipped`` as bad this time
    (``on_error="skip"``), and from the ``index`` file, the ``samples`` and ``tokens`` of all shards."""

    shards: tuple[str, ...]
    written: tuple[str, ...]
    skipped: int
    index: str
    samples: int
    tokens: int


def pretokenize(
    source: Source | str | Sequence[str],
    output: str | os.PathLike[str],
    *,
    decode: TextDecode | None = None,
    max_length: int | None = None,
    dtype: Literal["int32", "uint16"] = "int32",
    workers: int | None = None,
    progress: bool = True,
) -> Pretokenized:
    """Tokenize ``source``'s shards (a :class:`~mixer.Source` whose ``decode`` is a
    :class:`~mixer.TextDecode`, or shard patterns with ``decode=``) into ``tokens.npy`` shards and
    their index in the local directory ``output`` (see the module docstring). ``max_length``: cut
    documents into chunks of at most this many tokens (None: whole documents); ``dtype``: of the
    token arrays (``uint16`` for vocabularies of at most 65,536 tokens); ``workers``: processes
    converting shards at once (None: the CPUs this process may use); ``progress``: a bar on stderr
    (tqdm, else a line per shard). A bad sample follows the source's ``on_error``."""
    src = _as_source(source, decode)
    text = src.decode
    assert isinstance(text, TextDecode)
    max_length = _check.optional(max_length, _check.count, "pretokenize.max_length")
    _check.choice(dtype, "pretokenize.dtype", DTYPES)
    if dtype == "uint16" and text.tokenizer.get_vocab_size(with_added_tokens=True) > 1 << 16:
        _check.fail("pretokenize.dtype", "uint16 holds token ids below 65,536; this tokenizer has more")
    workers = _check.count(workers, "pretokenize.workers") if workers is not None else _cpus()
    try:
        inputs = [
            url for url, _ in storage.expand_urls(list(src.urls), storage_options=dict(src.storage_options or {}))
        ]
    except MixerError as exc:
        raise type(exc)(f"source {src.name!r}: {exc}") from exc
    out = Path(output)
    if "://" in os.fspath(output):
        raise ConfigError(f"pretokenize: output must be a local directory, got {os.fspath(output)!r}")
    targets = _targets(src.name, inputs, out)
    out.mkdir(parents=True, exist_ok=True)
    _claim(out, {"decode": repr(text), "max_length": max_length, "dtype": dtype})
    for stale in out.glob(".*.tmp-*"):  # what an interrupted run was writing
        stale.unlink()
    todo = [(u, t) for u, t in zip(inputs, targets) if not t.exists()]
    skipped = _convert_all(src, todo, max_length, dtype, workers, progress, len(inputs))
    idx = build_index(Source(src.name, [str(t) for t in targets]), progress=progress)
    return Pretokenized(
        shards=tuple(str(t) for t in targets),
        written=tuple(str(t) for _, t in todo),
        skipped=skipped,
        index=idx.locations[0],
        samples=int(idx.counts.sum()),
        tokens=int(idx.tokens.sum()),
    )


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 1


def _as_source(source: Source | str | Sequence[str], decode: TextDecode | None) -> Source:
    if decode is not None and not isinstance(decode, TextDecode):
        raise ConfigError(f"pretokenize: decode must be a mixer.TextDecode, got {type(decode).__name__}")
    if isinstance(source, Source):
        decode = decode or (source.decode if isinstance(source.decode, TextDecode) else None)
        if decode is None:
            raise ConfigError(
                f"pretokenize: source {source.name!r} has no TextDecode; pass decode=mixer.TextDecode(tokenizer)"
            )
        return Source(
            source.name,
            source.urls,
            decode=decode,
            on_error=source.on_error,
            storage_options=source.storage_options,
            io_options=source.io_options,
            allow_pipe=source.allow_pipe,
        )
    if decode is None:
        raise ConfigError("pretokenize: shard patterns need decode=mixer.TextDecode(tokenizer)")
    first = source if isinstance(source, (str, os.PathLike)) else source[0]
    return Source(storage.redact(os.fspath(first)), source, decode=decode)  # type: ignore[arg-type]


def _targets(name: str, inputs: list[str], out: Path) -> list[Path]:
    """The output shard of each input: its file name with a plain ``.tar`` ending, in ``out``."""
    suffixes = sorted(SHARD_SUFFIXES, key=len, reverse=True)
    seen: dict[str, str] = {}
    targets = []
    for url in inputs:
        base = url.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
        stem = next((base[: -len(s)] for s in suffixes if base.endswith(s)), base)
        target = stem + ".tar"
        if target in seen:
            raise ConfigError(
                f"source {name!r}: shards {storage.redact(seen[target])} and {storage.redact(url)} would both be "
                f"written to {target}; pretokenize them into separate output directories"
            )
        seen[target] = url
        targets.append(out / target)
    return targets


def _claim(out: Path, made_with: dict[str, Any]) -> None:
    """Record what ``out`` is made with, or refuse when it was made with something else."""
    path = out / MANIFEST
    if path.exists():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"pretokenize: cannot read {path}: {exc}; delete it to start the directory afresh"
            ) from exc
        if before != made_with:
            changed = sorted(k for k in made_with if before.get(k) != made_with[k])
            raise ConfigError(
                f"pretokenize: {out} was pretokenized with other {', '.join(changed)} ({before}); to continue it, use "
                "the same; or write to another directory"
            )
        return
    _atomic_write(path, json.dumps(made_with, indent=1).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---- converting shards ------------------------------------------------------------------------


def _convert_all(
    source: Source,
    todo: list[tuple[str, Path]],
    max_length: int | None,
    dtype: str,
    workers: int,
    progress: bool,
    total: int,
) -> int:
    """Convert every ``(input, output)`` of ``todo``, ``workers`` at once; returns the samples skipped."""
    bar = _progress(total, total - len(todo), f"pretokenizing {source.name}", progress)
    skipped = 0
    try:
        if workers == 1 or len(todo) <= 1:
            for url, target in todo:
                n, s = convert_shard(source, url, target, max_length, dtype)
                skipped += s
                bar(target.name, n)
            return skipped
        # The source (its tokenizer as JSON) goes to each process once, not with every shard.
        with ProcessPoolExecutor(
            max_workers=min(workers, len(todo)), initializer=_adopt, initargs=(source, max_length, dtype)
        ) as pool:
            pending: dict[Future[tuple[int, int]], Path] = {}
            jobs = iter(todo)
            for url, target in _take(jobs, 2 * workers):  # a few queued each: not the whole list at once
                pending[pool.submit(_convert_adopted, url, target)] = target
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        target = pending.pop(future)
                        n, s = future.result()
                        skipped += s
                        bar(target.name, n)
                        for url, nxt in _take(jobs, 1):
                            pending[pool.submit(_convert_adopted, url, nxt)] = nxt
            finally:
                for future in pending:
                    future.cancel()
        return skipped
    finally:
        bar(None, 0)


def _take(jobs: Iterator[tuple[str, Path]], n: int) -> list[tuple[str, Path]]:
    return [job for _, job in zip(range(n), jobs)]


_adopted: tuple[Source, int | None, str] | None = None  # (in a converting process) what it converts with


def _adopt(source: Source, max_length: int | None, dtype: str) -> None:
    global _adopted
    _adopted = (source, max_length, dtype)


def _convert_adopted(url: str, target: Path) -> tuple[int, int]:
    assert _adopted is not None
    source, max_length, dtype = _adopted
    return convert_shard(source, url, target, max_length, dtype)


def convert_shard(source: Source, url: str, target: Path, max_length: int | None, dtype: str) -> tuple[int, int]:
    """Write ``target`` (atomically) from the text shard ``url``; returns (tokens written, samples skipped)."""
    import webdataset as wds

    text = source.decode
    assert isinstance(text, TextDecode)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    tokens = skipped = 0
    try:
        with os.fdopen(fd, "wb") as f:
            with wds.TarWriter(f, mtime=MTIME) as sink:
                for sample in _samples(source, text, url, max_length):
                    if sample is None:
                        skipped += 1
                        continue
                    sink.write({"__key__": sample.key, "tokens.npy": np.asarray(sample.tokens, dtype=dtype)})
                    tokens += sample.length
            f.flush()
            os.fsync(f.fileno())  # complete on disk before it takes its name
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return tokens, skipped


def _samples(source: Source, text: TextDecode, url: str, max_length: int | None) -> Iterator[Sample | None]:
    """The samples of shard ``url`` in order (None for a bad one skipped), tokenized ``RUN`` documents at a time."""
    kwargs = {
        "storage_options": dict(source.storage_options or {}),
        "allow_pipe": source.allow_pipe,
        **storage.IOOptions.of(source.io_options).open_kwargs(),
    }
    docs: list[Sample] = []
    limit = max_length or (1 << 62)
    with storage.open_shard(url, **kwargs) as stream:
        for raw in read_samples(stream, url=storage.redact(url)):
            try:
                body = text.text(raw)
            except SampleError as exc:
                if source.on_error == "raise":
                    raise SampleError(f"source {source.name!r}: {exc}") from exc
                log.warning("source %r: skipping a bad sample: %s", source.name, exc)
                yield None
                continue
            docs.append(Sample(raw["__key__"], body, len(body), 0, raw["__offset__"]))
            if len(docs) == RUN:
                yield from _chunked(text, docs, limit)
                docs = []
    yield from _chunked(text, docs, limit)


def _chunked(text: TextDecode, docs: list[Sample], limit: int) -> Iterator[Sample]:
    for doc, tokens in zip(docs, text.encode([d.tokens for d in docs])):
        yield from chunk_samples(doc, tokens, limit)


def _progress(total: int, done: int, desc: str, show: bool) -> Callable[[str | None, int], None]:
    """``update(shard name, tokens)`` after each shard, ``update(None, 0)`` at the end: a tqdm bar, or
    a line per shard on stderr where tqdm is not installed; nothing when ``show`` is false."""
    if not show:
        return lambda name, tokens: None
    try:
        from tqdm import tqdm
    except ImportError:
        start, count = time.perf_counter(), [done, 0]

        def line(name: str | None, tokens: int) -> None:
            if name is None:
                return
            count[0] += 1
            count[1] += tokens
            rate = count[1] / max(time.perf_counter() - start, 1e-9)
            print(f"{desc}: {count[0]}/{total} shards ({name}), {rate:,.0f} tokens/s", file=sys.stderr, flush=True)

        return line
    bar = tqdm(total=total, initial=done, unit="shard", desc=desc, file=sys.stderr, dynamic_ncols=True)
    written = [0]
    start = time.perf_counter()

    def update(name: str | None, tokens: int) -> None:
        if name is None:
            bar.close()
            return
        written[0] += tokens
        bar.set_postfix_str(f"{written[0] / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
        bar.update(1)

    return update
