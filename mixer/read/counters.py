"""The per-source counters every reader keeps: what was read, delivered and lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(slots=True)
class Counters:
    """Per-source counters kept by every reader (cumulative, plain ints). ``samples``, ``tokens``
    (real), ``padded`` (slots) and ``batches`` count what was delivered in batches; ``read`` counts
    samples taken from shards, some of which may still wait in shuffle or bucket buffers.

    What ``on_error="skip"`` loses: ``skipped_samples`` counts samples known to be lost, exactly (a
    sample that fails to decode; a sample a damaged shard cut: some of its members read, not all);
    ``skipped_shards`` counts shards given up (unreadable, or damaged part-way); ``skipped_unknown``
    those of them whose rest could not be counted in samples (a corrupt header or a failed read with
    more of the shard after it; a shard that could not be opened at all), while a shard that simply
    ends early (truncated) loses exactly its cut samples; ``skipped_bytes`` counts the bytes of given-up
    shards that delivered nothing: from the end of the last sample read to the shard's end, where
    its size is known (listing, server, file), else to the damage. Bytes are tar bytes (uncompressed)
    except that the unread rest of a compressed shard is not counted. A shard shared by several
    readers (fewer shards than readers) is counted once, by the reader of its first part; the samples
    each by the reader they belonged to.
    """

    samples: int = 0
    tokens: int = 0
    padded: int = 0
    batches: int = 0
    read: int = 0
    bytes: int = 0
    shards_opened: int = 0
    shards_finished: int = 0
    epochs: int = 0
    truncated: int = 0
    dropped: int = 0
    skipped_samples: int = 0
    skipped_shards: int = 0
    retries: int = 0
    split: int = 0  # documents cut into pieces by a packed layout (mixer.Packed(split_documents=True))
    skipped_bytes: int = 0
    skipped_unknown: int = 0
    reopened: int = 0  # shards closed by the open-shards cap and reopened at their byte (mixer.storage.open_shards)

    FIELDS: ClassVar[tuple[str, ...]] = (
        "samples",
        "tokens",
        "padded",
        "batches",
        "read",
        "bytes",
        "shards_opened",
        "shards_finished",
        "epochs",
        "truncated",
        "dropped",
        "skipped_samples",
        "skipped_shards",
        "retries",
        "split",
        "skipped_bytes",
        "skipped_unknown",
        "reopened",
    )

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in self.FIELDS]
