"""Reading samples again by location (shard, byte offset): how a resumed stream refills its
shuffle and bucket buffers without replaying the epoch."""

from __future__ import annotations

from collections.abc import Sequence

from mixer import storage
from mixer.errors import StateError
from mixer.read.counters import Counters
from mixer.read.decode import Sample
from mixer.read.sample import make_sample
from mixer.read.tario import read_samples
from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import ListedSource
from mixer.storage import codec_of

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
    by_shard: dict[int, set[int]] = {}
    for shard, offset in wanted:
        by_shard.setdefault(int(shard), set()).add(int(offset))
    out: dict[tuple[int, ...], Sample] = {}
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
                        sample = make_sample(source, budget, scratch, raw, shard)
                        if sample is None:
                            raise StateError(
                                f"source {source.name!r}: the sample at byte {off} of {storage.redact(url)} no longer decodes as it did"
                            )
                        out[(shard, off)] = sample
                    if off >= last:
                        break
        missing = offsets - {off for sh, off in out if sh == shard}
        if missing:
            raise StateError(
                f"source {source.name!r}: no sample starts at byte(s) {sorted(missing)[:5]} of {storage.redact(url)}: the shard changed since the state was saved"
            )
    return out


def _runs(offsets: list[int], gap: int) -> list[list[int]]:
    """Sorted offsets cut wherever two neighbours are more than ``gap`` bytes apart."""
    runs: list[list[int]] = [[offsets[0]]]
    for off in offsets[1:]:
        if off - runs[-1][-1] > gap:
            runs.append([off])
        else:
            runs[-1].append(off)
    return runs
