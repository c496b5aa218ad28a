"""Reading samples again by location (shard, byte offset): how a resumed stream refills its
shuffle and bucket buffers without replaying the epoch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mixer import storage
from mixer.errors import SampleError, StateError
from mixer.read.counters import Counters
from mixer.read.decode import Sample
from mixer.read.sample import make_sample
from mixer.read.tario import read_samples
from mixer.read.text import TextDecode, split_location
from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import ListedSource
from mixer.storage import codec_of
from mixer.stream.text_stream import document_chunks

# Wanted samples closer than this are read through; farther apart, the shard is opened again at the
# next one (a seek locally, a new ranged GET remotely), so a restore reads about what it needs.
_REREAD_GAP = 1 << 20


def reread(
    listed: ListedSource, budget: TokenBudget | Packed, wanted: Sequence[tuple[int, int]]
) -> dict[tuple[int, ...], Sample]:
    """Read the samples at (shard, byte offset) locations again, for a resumed stream: per shard, runs
    of nearby offsets are read through in one ranged read, far-apart ones each from their own offset,
    so the bytes read follow the buffered samples, not the distance between the oldest and newest."""
    source = listed.source
    text = source.decode if isinstance(source.decode, TextDecode) else None
    by_shard: dict[int, set[int]] = {}
    chunks: dict[tuple[int, int], set[int]] = {}  # [text] (shard, document offset) -> the chunks wanted
    for shard, offset in wanted:
        if text is not None:
            offset, k = split_location(int(offset))
            chunks.setdefault((int(shard), offset), set()).add(k)
        by_shard.setdefault(int(shard), set()).add(int(offset))
    out: dict[tuple[int, ...], Sample] = {}
    docs: list[Sample] = []  # [text] documents some of whose chunks are wanted
    scratch = Counters()
    for shard, offsets in sorted(by_shard.items()):
        url = listed.shards[shard]
        # A compressed shard cannot seek (each open decompresses from its start): one pass reads them all.
        gap = _REREAD_GAP if codec_of(url) is None else 1 << 62
        for run in _runs(sorted(offsets), gap):
            start, last = run[0], run[-1]
            with storage.open_shard(
                url,
                start_offset=start,
                storage_options=dict(source.storage_options or {}),
                allow_pipe=source.allow_pipe,
                **storage.IOOptions.of(source.io_options).open_kwargs(),
            ) as stream:
                for raw in read_samples(stream, url=storage.redact(url), start_offset=start, chunk_size=1 << 16):
                    off = raw["__offset__"]
                    if off in offsets:
                        sample = (
                            _text_record(text, raw, shard)
                            if text is not None
                            else make_sample(source, budget, scratch, raw, shard)
                        )
                        if sample is None:
                            raise StateError(
                                f"source {source.name!r}: the sample at byte {off} of {storage.redact(url)} no longer "
                                "decodes as it did"
                            )
                        out[(shard, off)] = sample
                        if text is not None and max(chunks[shard, off]) >= 0:
                            docs.append(sample)
                    if off >= last:
                        break
        missing = offsets - {off for sh, off in out if sh == shard}
        if missing:
            raise StateError(
                f"source {source.name!r}: no sample starts at byte(s) {sorted(missing)[:5]} of {storage.redact(url)}: "
                "the shard changed since the state was saved"
            )
    if text is not None:
        _add_chunks(out, text, docs, chunks, text.chunk_length(budget.longest), source.name)
    return out


def _text_record(text: TextDecode, raw: dict[str, Any], shard: int) -> Sample | None:
    """[text] A document as a text stream buffers it (see mixer.stream.text_stream), None when its text is gone."""
    try:
        return Sample(raw["__key__"], s := text.text(raw), len(s), shard, raw["__offset__"])
    except SampleError:
        return None


def _add_chunks(
    out: dict[tuple[int, ...], Sample],
    text: TextDecode,
    docs: list[Sample],
    wanted: dict[tuple[int, int], set[int]],
    length: int,
    name: str,
) -> None:
    """[text] The chunks wanted of ``docs`` (tokenized together) into ``out``, by chunk location;
    text records that only stood for their chunks are taken out again."""
    for doc, pieces in zip(docs, document_chunks(text, docs, length)):
        ks = wanted[doc.shard, doc.offset]
        for k in ks:
            if k < 0:
                continue
            if k >= len(pieces):
                raise StateError(
                    f"source {name!r}: the document at byte {doc.offset} of shard {doc.shard} no longer has a chunk "
                    f"{k} (it makes {len(pieces)}): the shard or the tokenizer changed since the state was saved"
                )
            out[(doc.shard, pieces[k].offset)] = pieces[k]
        if -1 not in ks:
            del out[(doc.shard, doc.offset)]


def _runs(offsets: list[int], gap: int) -> list[list[int]]:
    """Sorted offsets cut wherever two neighbours are more than ``gap`` bytes apart."""
    runs: list[list[int]] = [[offsets[0]]]
    for off in offsets[1:]:
        if off - runs[-1][-1] > gap:
            runs.append([off])
        else:
            runs[-1].append(off)
    return runs
