"""``TextStream``: the :class:`~mixer.stream.source_stream.SourceStream` of a source decoded by
:class:`~mixer.TextDecode`, and :func:`make_stream`, which picks the stream class for a source.

Tokenizing is most of what reading text costs, so a text stream tokenizes only what leaves its
shuffle buffer: the buffer holds documents as text (their locations are plain byte offsets), and
when the stream needs a sample it takes the next :data:`RUN` documents (fewer when they are long:
:data:`RUN_CHARS`) from the buffer (the same draws as any shuffle buffer), tokenizes them in one
``encode_batch`` call, cuts each into chunks of at most the chunk length
(:meth:`~mixer.TextDecode.chunk_length`) and hands the chunks out at random from that small pool
(in order when there is no shuffle buffer). Each DataLoader worker then tokenizes about what it
delivers, not a full shuffle buffer per source besides (its length buckets it fills as any reader).

State: the same fields as every stream; ``buffer`` lists the documents of the shuffle buffer (byte
offsets) and then the chunks of the pool (chunk locations, :func:`mixer.read.text.chunk_offset`),
so a restore tells them apart by location and resumes mid-document exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mixer.errors import SampleError
from mixer.plan.world import World
from mixer.read.decode import Sample
from mixer.read.sample import _skip_or_raise
from mixer.read.text import TextDecode, chunk_samples, split_location
from mixer.spec.source import ListedSource
from mixer.state.checkpoint import locate_sample
from mixer.stream.source_stream import SourceStream

RUN = 32
"""The most documents a text stream takes from its shuffle buffer and tokenizes together..."""
RUN_CHARS = 1 << 16
"""... and the characters after which it takes no more (long documents: a run of a few, not a
few hundred thousand tokens tokenized ahead of their turn)."""


def make_stream(source: ListedSource, world: World, **options: Any) -> SourceStream:
    """The stream that reads ``source``: a :class:`TextStream` for a :class:`~mixer.TextDecode`
    source, else a :class:`SourceStream` (``options``: their keywords)."""
    if isinstance(source.source.decode, TextDecode):
        return TextStream(source, world, **options)
    return SourceStream(source, world, **options)


class TextStream(SourceStream):
    """A source's stream when its ``decode`` is a :class:`~mixer.TextDecode` (see the module docstring)."""

    def __init__(self, source: ListedSource, world: World, **options: Any) -> None:
        super().__init__(source, world, **options)
        decode = self.source.decode
        assert isinstance(decode, TextDecode) and self.source.length is None  # (checked by the Mixture)
        self.text = decode
        self.chunk = decode.chunk_length(self.budget.longest)
        self.pool: list[Sample] = []  # chunks tokenized, not yet handed out (in order: reversed)
        self._in_order = self.shuffle_buffer <= 1

    def _sample(self, raw: dict[str, Any], shard: int) -> Sample | None:
        """A document as text, with its length in characters (tokenized when it leaves the buffer)."""
        try:
            text = self.text.text(raw)
        except SampleError as exc:
            _skip_or_raise(self.source, self.counters, raw, shard, exc, self._warn_once)
            return None
        return Sample(raw["__key__"], text, len(text), shard, raw["__offset__"])

    def __next__(self) -> Sample:
        pool = self.pool
        while not pool:  # (a run of documents of no tokens leaves it empty)
            if not self._tokenize_run():
                raise StopIteration
        return pool.pop() if self._in_order else self.rng.take(pool)

    def _tokenize_run(self) -> bool:
        """Fill the pool from the next run of documents; False when there are none."""
        docs: list[Sample] = []
        chars = 0
        try:
            while len(docs) < RUN and chars < RUN_CHARS:
                # A run is of one source-epoch: the next is read once this run's chunks are handed out.
                self._hold_epoch = bool(docs)
                try:
                    doc = SourceStream.__next__(self)
                except StopIteration:
                    break
                docs.append(doc)
                chars += doc.length
        finally:
            self._hold_epoch = False
        pieces = document_chunks(self.text, docs, self.chunk)
        for doc, chunks in zip(docs, pieces):
            if not chunks:
                self.counters.dropped += 1  # a document of no tokens
            elif len(chunks) > 1:
                self.counters.split += 1
            self.pool.extend(chunks)
        if self._in_order:
            self.pool.reverse()
        return bool(docs)

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["buffer"] += list(map(locate_sample, self.pool))
        return state

    def attach(self, lookup: Callable[[tuple[int, ...]], Sample]) -> None:
        items = [lookup(loc) for loc in self._restoring]
        self._restoring = []
        self.buffer = [s for s in items if split_location(s.offset)[1] < 0]
        self.pool = [s for s in items if split_location(s.offset)[1] >= 0]


def document_chunks(decode: TextDecode, docs: list[Sample], length: int) -> list[list[Sample]]:
    """The chunks of each text document of ``docs``, tokenized in one call."""
    return [chunk_samples(d, t, length) for d, t in zip(docs, decode.encode([d.tokens for d in docs]))]
