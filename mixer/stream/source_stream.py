"""``SourceStream``: one reader's samples of one source (shuffle buffer, cursor, source-epoch) and its
:class:`Counters`; the per-sample decode and length policy is `mixer.read.sample`."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from mixer import storage
from mixer._warn import warn
from mixer.errors import ShardError
from mixer.plan.shard_index import open_slice, range_loss
from mixer.plan.shards import ShardSlice, plan, slice_of, slice_row
from mixer.plan.world import Draws, World
from mixer.read import decode
from mixer.read.counters import Counters  # noqa: F401 (kept by every stream; imported from here too)
from mixer.read.decode import Sample
from mixer.read.sample import _decode, _decoded, _fit, _length_of, _skip_or_raise, make_sample  # noqa: F401 (imported from here too)
from mixer.read.tario import _tarwalk, read_chunks
from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import ListedSource
from mixer.state.checkpoint import expect_keys, locate_sample
from mixer.storage import codec_of
from mixer.storage.windows import growing_reads

log = logging.getLogger(__name__)

REFILL_BURST = 64
"""The most samples a shuffle buffer reads per refill (half its size when smaller): see `SourceStream.__next__`."""
NO_LIMIT = 1 << 62  # a shuffle buffer without a limit in tokens
TOKEN_REFILL = 4
"""A shuffle buffer held to a number of tokens refills once it is down by this fraction of them (a
quarter): `REFILL_BURST` in tokens, for buffers of a few samples (a rarely read source's, at a
small budget share) as for large ones, so that a cold stream reopens its shard once per few samples."""
READ_CHUNK = 1 << 20  # the most a stream's reads of a shard ask for (mixer.read.tario.read_chunks)...
SMALL_CHUNK = (
    64 << 10
)  # ... the least, and what they ask for while the open-shards cap binds (see SourceStream._open_next),
FIRST_READ = 8 << 10  # the first of them smaller still, doubling (mixer.storage.windows.GrowingReads)
READ_AHEAD = 4 << 20
"""What one read of each of a reader's streams asks for together, split by share (`SourceStream.set_limits`):
a stream at a quarter share or more reads `READ_CHUNK` at a time, one at 1% `SMALL_CHUNK`. The bytes read and
not yet taken (about two reads per open shard) are what a reader of many sources holds beside its buffers."""


class SourceStream:
    """One reader's samples of one source: its shard slices, epoch after epoch (or one epoch when
    ``finite``), through a shuffle buffer. Over one source-epoch the readers of all ranks and workers
    together yield every sample exactly once (barring skips, which are counted).

    The stream is an explicit state machine so that :meth:`state_dict` can capture it at any sample
    boundary as a few integers plus the locations (shard, byte offset) of the buffered samples;
    :meth:`load_state_dict` seeks back there instead of replaying the epoch. Its open shard counts
    in the reader's ``open_shards`` (shared by its streams), which may :meth:`suspend` it.
    """

    def __init__(
        self,
        source: ListedSource,
        world: World,
        *,
        seed: int,
        budget: TokenBudget | Packed,
        shuffle_buffer: int,
        finite: bool,
        counters: Counters,
        open_shards: storage.OpenShards | None = None,
    ) -> None:
        self.listed = source  # the shards; self.source: the configuration
        self.source = source.source
        self.world = world
        self.seed = seed
        self.budget = budget
        self.shuffle_buffer = shuffle_buffer
        self.finite = finite
        self.counters = counters
        # Where reading stands: the epoch, the slice of this epoch's plan, and inside that slice's
        # shard the index and byte offset of the next tar sample.
        self.epoch = 0
        self.slice_pos = 0
        self.next_index = 0
        self.next_offset = 0
        self.got_in_epoch = 0
        self.exhausted = False
        self.buffer: list[Sample] = []
        # The shuffle buffer's size. (It never mixes two epochs: without ``finite``, the next
        # source-epoch is read only once the buffer has handed out all of this one, see _open_next.)
        self.buffer_size = shuffle_buffer
        # Called when the stream passes into its next source-epoch, before the new epoch's first
        # sample is handed out (the mixing loop closes the source's buckets then: mixer.mixing.loops).
        self.on_epoch: Callable[[], object] | None = None
        # Hold the next source-epoch back even with the buffer empty (TextStream, while it tokenizes
        # a run of this epoch's documents).
        self._hold_epoch = False
        # Caps the mixture sets from the source's share and the reader's buffer budget (see
        # Reader._hold_ahead, set_limits): a rarely read source keeps a smaller buffer, so it does
        # not read ahead (and hold) a full buffer for a trickle; in samples and in tokens.
        self.limit = shuffle_buffer
        self.token_limit = NO_LIMIT
        self._refill_below = NO_LIMIT
        self.held = 0  # tokens (sample lengths) in the buffer
        self.read_chunk = READ_CHUNK
        # A private generator (never the global one): cheap per-sample draws for the shuffle buffer.
        self.rng = Draws(seed, "shuffle", source.name, world.reader)
        # Shards given up under on_error="skip": (epoch, slice position) -> (samples read before,
        # then what was counted as lost: skipped_samples, skipped_shards, skipped_unknown,
        # skipped_bytes), so that a resumed run makes the same decision whatever the network does
        # then, and counts the same.
        self.skips: dict[tuple[int, int], tuple[int, ...]] = {}
        self.new_skips: list[tuple[int, ...]] = []
        self._restoring: list[tuple[int, int]] = []  # buffer locations a restore waits for
        # [elastic] epoch inherit_epoch (-1: none) is the slices inherited from a run of another shape
        self.inherited: list[ShardSlice] = []
        self.inherit_epoch = -1
        self._plans: dict[int, list[ShardSlice]] = {}
        self._chunks: Iterator[list[dict[str, Any]]] | None = None  # the open shard's samples, in runs
        self._raws: list[dict[str, Any]] = []  # the run being taken, from _raw_pos on
        self._raw_pos = 0
        self._handle: Any = None
        self._retries_counted = 0  # of the open shard's retries, those already in counters.retries
        io = storage.IOOptions.of(self.source.io_options)
        self._ahead = storage.ReadAhead(
            options=io, storage_options=dict(self.source.storage_options or {}), allow_pipe=self.source.allow_pipe
        )
        self._shards = open_shards if open_shards is not None else storage.OpenShards(io.max_open_shards)
        self._suspended = False  # closed by the cap mid-shard: the next open is a reopen
        self._cold = False  # suspended since its last fresh shard: read too rarely to read ahead for
        self._new = True  # no shard opened yet (in this process): see _open_next
        # bytes taken before the last suspension: a cold stream asks for that much first (then
        # doubling), so a visit like the last one reads about what it takes
        self._visit = 0
        self._opened_at = 0
        self._warned_shards: set[int] = set()

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Sample]:
        return self

    def set_limits(self, limit: int, tokens: int = NO_LIMIT, share: float = 1.0) -> None:
        """Hold at most ``limit`` samples (and the buffer's size) and, past ``tokens`` tokens, no more;
        read shards ``share`` of `READ_AHEAD` at a time (from the next shard opened)."""
        self.limit = limit
        self.token_limit = tokens
        self._refill_below = tokens - tokens // TOKEN_REFILL if tokens < NO_LIMIT else NO_LIMIT
        self.read_chunk = max(SMALL_CHUNK, min(READ_CHUNK, int(READ_AHEAD * share)))

    def __next__(self) -> Sample:
        buf = self.buffer
        size = self.buffer_size if self.buffer_size < self.limit else self.limit
        # Refill in bursts: once the buffer is down by `burst` (half its size, at most
        # REFILL_BURST) and by 1 / TOKEN_REFILL of its token limit, read it full in one go, then
        # hand out one at random. A rarely read source whose shard the open-shards cap closed
        # between visits then reopens it once per burst, not once per sample. A function of the
        # buffer's samples and size only (both in the checkpoint), never of whether the shard
        # happens to be open, so a resumed run refills at the same points. When a cap went down,
        # the excess is handed out first; when the pass is over, what the buffer holds. (This
        # runs once per sample: no calls it can avoid.)
        if (
            len(buf) <= size - (REFILL_BURST if size >= 2 * REFILL_BURST else size >> 1 or 1)
            and self.held <= self._refill_below
        ) or not buf:
            if size <= 1 and not buf:  # no buffer: straight from the shard
                one: list[Sample] = []
                if not self._read_into(one, 1):
                    raise StopIteration
                return one[0]
            self._refill(buf)
            if not buf:
                raise StopIteration
        sample = self.rng.take(buf)
        self.held -= sample.length
        return sample

    def _refill(self, buf: list[Sample]) -> None:
        """Read the buffer full: to its size in samples, and under a token limit only until it holds
        that many tokens (the run of samples that reaches the limit is the last). Under a token limit it
        reads a number of samples fixed by the buffer's contents at a time (`_fits`: half the
        tokens left to the limit over the mean length held), never "until the limit" counted
        after each read, whose reads end where shards happen to open: so where a
        refill stops depends on the samples only, as a resumed run needs."""
        tokens = self.token_limit
        while self.held < tokens:
            n = len(buf)
            step = tokens if tokens == NO_LIMIT else _fits(tokens - self.held, n, self.held)
            # (asked again after each shard opened: the limits may have moved)
            while (want := min(self.buffer_size, self.limit, n + step) - len(buf)) > 0 and self._read_into(buf, want):
                pass
            if len(buf) == n:
                return
            self.held += sum(map(_LENGTH, buf[n:]))
            if tokens == NO_LIMIT:
                return

    def _plan(self, epoch: int) -> list[ShardSlice]:
        if epoch == self.inherit_epoch:
            return self.inherited
        if epoch not in self._plans:
            self._plans = {
                epoch: plan(
                    len(self.listed.shards),
                    self.world,
                    seed=self.seed,
                    source=self.source.name,
                    epoch=epoch,
                    sizes=self.listed.shard_bytes,
                    index=self.listed.index,
                )
            }
        return self._plans[epoch]

    def _read_into(self, out: list[Sample], want: int) -> int:
        """Append the next ``want`` samples of this reader's part (in shard order) to ``out``, fewer
        when there are no more, and fewer still when a shard is opened: then the one sample read
        from it is the last (the caller may ask for more; a shuffle buffer asks its size again).
        Returns how many were appended. Runs of samples in the default format go through
        ``_tarwalk.samples`` in one call (chunked); every other sample through `make_sample`."""
        got = 0
        while got < want and not self.exhausted:
            if self._chunks is None:
                if not self._open_next():
                    return got
                want = got + 1
            sl = self._plan(self.epoch)[self.slice_pos]
            skip = self.skips.get((self.epoch, self.slice_pos))
            limit = None if skip is None else skip[0]
            fast = (
                sl.parts == 1
                and limit is None
                and self.source.decode is None
                and self.source.length is None
                and decode.NATIVE
            )
            convert = _convert if fast else None
            self._shards.used(self)
            try:
                while got < want:
                    raws, pos = self._raws, self._raw_pos
                    if pos == len(raws):
                        raws = next(self._chunks, None)  # type: ignore[arg-type]
                        self._count_retries()  # made while reading that chunk: counted now, not at the shard's close
                        if raws is None:
                            break
                        self._raws, self._raw_pos, pos = raws, 0, 0
                    if convert is not None:
                        done, end = convert(
                            raws, pos, min(len(raws), pos + want - got), sl.shard, self.budget.longest, Sample, out
                        )
                        if done > pos:
                            if not decode.TXT_WARNED:
                                decode.warn_bytes_as_tokens(raws[pos])
                            n = done - pos
                            self._raw_pos = done
                            self.next_index += n
                            self.next_offset = end
                            self.counters.read += n
                            self.got_in_epoch += n
                            got += n
                            continue
                    raw = raws[pos]  # one sample, as make_sample judges it
                    self._raw_pos = pos + 1
                    i = self.next_index
                    if limit is not None and i >= limit:
                        raise _SkipAgain
                    self.next_index = i + 1
                    self.next_offset = raw["__end__"]
                    if sl.parts > 1 and i % sl.parts != sl.part:
                        continue
                    sample = self._sample(raw, sl.shard)
                    if sample is not None:
                        self.counters.read += 1
                        self.got_in_epoch += 1
                        out.append(sample)
                        got += 1
                else:
                    return got  # (mid-shard)
            except _SkipAgain:
                # A decision taken before (in the run this one resumes): the same point, the same counts.
                self._close()
                assert skip is not None
                self._add_loss(skip[1:])
            except ShardError as exc:
                if self.source.on_error == "raise":
                    self._close()
                    raise ShardError(f"source {self.source.name!r}: {exc}") from exc
                loss, words = self._loss(exc, sl)
                self._close()
                self._add_loss(loss)
                decision = (self.next_index, *loss)
                self.skips[(self.epoch, self.slice_pos)] = decision
                self.new_skips.append((self.epoch, self.slice_pos, *decision))
                self._warn_once(
                    sl.shard,
                    f"source {self.source.name!r}: skipping the rest of shard "
                    f"{storage.redact(self.listed.shards[sl.shard])} ({words}): {exc}",
                )
            else:
                self._close()
                self.counters.shards_finished += 1
            self.slice_pos += 1
            self.next_index = 0
            self.next_offset = 0
        return got

    def _sample(self, raw: dict[str, Any], shard: int) -> Sample | None:
        """One tar sample as this stream buffers it (`make_sample`: decoded, the length policy
        applied; None when dropped or skipped)."""
        return make_sample(self.source, self.budget, self.counters, raw, shard, warn_once=self._warn_once)

    def _loss(self, exc: ShardError, sl: ShardSlice) -> tuple[tuple[int, int, int, int], str]:
        """What giving up the current shard at `exc` loses, as counter increments (skipped_samples,
        skipped_shards, skipped_unknown, skipped_bytes: see `Counters`), and in words."""
        cut: list[str] = getattr(exc, "lost", [])  # samples the damage cut, in shard order from next_index
        mine = sum(1 for j in range(len(cut)) if (self.next_index + j) % sl.parts == sl.part)
        words = f"{mine} sample(s) cut by the damage"
        if sl.stop is not None:  # [index] the slice's samples are known: what is lost is exact
            return range_loss(sl, self.next_index, self.next_offset, self.listed.index)
        if sl.part != 0:  # the shard itself is counted by the reader of its first part
            return (mine, 0, 0, 0), words
        start = self.next_offset  # the first byte not delivered as a sample
        stop = getattr(exc, "stop", None)  # how far the tar reader got (the shard's end if truncated)
        if getattr(exc, "truncated", False) and stop is not None:
            skipped = max(stop - start, 0)
            return (mine, 1, 0, skipped), f"{words}; the shard ends there, {skipped} bytes undelivered"
        size = storage.stream_size(self._handle)
        if size is None and codec_of(self.listed.shards[sl.shard]) is None:
            size = self.listed.shard_bytes[sl.shard]
        end = size if size is not None and size >= start else stop
        skipped = max(end - start, 0) if end is not None else 0
        return (mine, 1, 1, skipped), f"{words}; rest of shard unknown: {skipped} bytes from offset {start} skipped"

    def _add_loss(self, loss: Sequence[int]) -> None:
        c = self.counters
        samples, shards, unknown, nbytes = (*loss, 0, 0, 0, 0)[:4]  # (older states saved no counts)
        c.skipped_samples += samples
        c.skipped_shards += shards
        c.skipped_unknown += unknown
        c.skipped_bytes += nbytes

    def _open_next(self) -> bool:
        """Open the shard of the current slice, moving to the next epoch at the end of one: once the
        buffer has handed out every sample of this one (without ``finite``), so that the samples of a
        source-epoch all leave the stream before any of the next (False until then)."""
        while self.slice_pos >= len(self._plan(self.epoch)):
            if not self.finite and (self.buffer or self._hold_epoch):
                return False
            self.counters.epochs += 1
            inherited = self.epoch == self.inherit_epoch  # an empty inheritance is no empty part
            if self.finite or (self.got_in_epoch == 0 and not inherited):
                if not self.finite:
                    # This reader's part of an epoch was empty (e.g. fewer samples in a shared
                    # shard than readers sharing it): stop rather than spin reopening shards; the
                    # mixture drops the source for this reader and says so.
                    log.warning(
                        "source %r: reader %d got no samples in epoch %d",
                        self.source.name,
                        self.world.reader,
                        self.epoch,
                    )
                self.exhausted = True
                return False
            if inherited:
                self.inherited, self.inherit_epoch = [], -1
            self.epoch += 1
            self.slice_pos = 0
            self.next_index = 0
            self.next_offset = 0
            self.got_in_epoch = 0
            self.skips = {k: v for k, v in self.skips.items() if k[0] >= self.epoch}
            if self.on_epoch is not None:
                self.on_epoch()
        sl = self._plan(self.epoch)[self.slice_pos]
        url = self.listed.shards[sl.shard]
        fresh = self.next_offset == 0  # (a reopen after a suspension, or a resume, is not)
        self.counters.shards_opened += fresh
        self.counters.reopened += not fresh and self._suspended
        # Read ahead only for a source read steadily (not suspended since its last fresh shard). A
        # stream whose first shard opens while the cap is full (its reader reads more sources than the
        # cap holds; this one has no record yet) starts cold, as if suspended at once: each stream
        # starting steady began read_ahead shards that the cap mostly closed unread.
        joins_full, self._new = self._new and self._shards.full, False
        ahead = not self._cold and not joins_full
        self._cold, self._suspended = (self._cold and not fresh) or joins_full, False
        if self.next_index < sl.start:  # [index] a sample range: from its first sample's byte
            self.next_index, self.next_offset = sl.start, sl.begin
        self._opened_at = self.next_offset
        try:
            upcoming = (
                self.listed.shards[s.shard]
                for s in self._plan(self.epoch)[self.slice_pos + 1 :]
                if s.end is None and ahead
            )
            self._handle = open_slice(
                self._ahead, url, sl, self.next_offset, upcoming, None if ahead else self._visit
            )  # [index] ranges end at sl.end
        except ShardError as exc:
            self.counters.retries += getattr(exc, "retries", 0)
            # Raised from inside the sample loop, where the on_error policy applies.
            self._handle = None
            self._chunks = _raising(exc)
        else:
            # While the cap binds (this stream was closed by it, or opening it closes another), what
            # is read and not taken before the shard is closed is dropped and read again: read in
            # small chunks, the first ones smaller still (mixer.storage.windows.GrowingReads).
            small = not ahead or self._shards.full
            chunk = SMALL_CHUNK if small else self.read_chunk
            reads = growing_reads(self._handle, FIRST_READ) if small else self._handle
            self._chunks = read_chunks(reads, url=storage.redact(url), start_offset=self.next_offset, chunk_size=chunk)
            self._retries_counted = 0
            self._count_retries()  # those of the open itself
            self._shards.opened(self)  # may suspend the least recently read other stream
        return True

    def _count_retries(self) -> None:
        """Add the open shard's retries made since the last count to ``counters.retries``: retries
        are counted as they happen (after each chunk read), so the counters a batch carries, and the
        statistics and reports made of them, include those of shards still being read."""
        made = int(getattr(self._handle, "retries", 0) or 0)
        if made != self._retries_counted:
            self.counters.retries += made - self._retries_counted
            self._retries_counted = made

    def _close(self) -> None:
        if self._handle is not None:
            self._count_retries()
            self._retries_counted = 0
            self.counters.bytes += self.next_offset - self._opened_at
            self._handle.close()
            self._shards.closed(self)
        self._handle = None
        self._chunks = None
        self._raws, self._raw_pos = [], 0

    def suspend(self) -> None:
        """Close the shard and its read-ahead, keeping the position (reopened at ``next_offset``)."""
        if self._handle is not None:
            self._visit = self.next_offset - self._opened_at
            self._close()
            self._ahead.close()
            self._suspended = self._cold = True

    def close(self) -> None:
        self._close()
        self._ahead.close()

    def _warn_once(self, shard: int, message: str) -> None:
        if shard not in self._warned_shards:
            self._warned_shards.add(shard)
            warn(message)

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where reading stands and where each buffered sample lives, in ints (columns: mixer.state.columns)."""
        return {
            "epoch": self.epoch,
            "slice_pos": self.slice_pos,
            "next_index": self.next_index,
            "next_offset": self.next_offset,
            "got_in_epoch": self.got_in_epoch,
            "exhausted": int(self.exhausted),
            "buffer_size": self.buffer_size,
            "draws": self.rng.taken,
            "buffer": list(map(locate_sample, self.buffer)),
            "skips": [[e, p, *d] for (e, p), d in sorted(self.skips.items())],
            "inherit": list(map(slice_row, self.inherited)),
            "inherit_epoch": self.inherit_epoch,
        }

    @staticmethod
    def inheriting_state(
        *, epoch: int, buffer_size: int, buffer: Sequence[Sequence[int]] | np.ndarray, inherit: list[list[int]]
    ) -> dict[str, Any]:
        """The state of a stream that an elastic resume gives inherited slices and buffered samples
        (by location; a ``(samples, 2)`` array stays one, for :func:`mixer.state.columns.pack`) in
        place of epoch ``epoch``'s plan (:mod:`mixer.mixing.elastic`): the same fields as
        :meth:`state_dict`, declared here once."""
        return {
            "epoch": epoch,
            "slice_pos": 0,
            "next_index": 0,
            "next_offset": 0,
            "got_in_epoch": 0,
            "exhausted": 0,
            "buffer_size": buffer_size,
            "draws": 0,
            "buffer": buffer if isinstance(buffer, np.ndarray) else [list(loc) for loc in buffer],
            "skips": [],
            "inherit": inherit,
            "inherit_epoch": epoch,
        }

    # The fields that list samples by location, (shard, byte offset) each.
    LOCATED: ClassVar[tuple[str, ...]] = ("buffer",)

    # How deep each field's lists go (0: an int), as mixer.state.columns packs them.
    STATE_DEPTHS: ClassVar[dict[str, int]] = {
        **dict.fromkeys(
            (
                "epoch",
                "slice_pos",
                "next_index",
                "next_offset",
                "got_in_epoch",
                "exhausted",
                "buffer_size",
                "draws",
                "inherit_epoch",
            ),
            0,
        ),
        "buffer": 2,
        "skips": 2,
        "inherit": 2,
    }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the buffer is back once :meth:`attach` got its samples."""
        expect_keys(f"stream {self.source.name!r}", state, tuple(self.STATE_DEPTHS))
        self._close()
        self.epoch = int(state["epoch"])
        self.slice_pos = int(state["slice_pos"])
        self.next_index = int(state["next_index"])
        self.next_offset = int(state["next_offset"])
        self.got_in_epoch = int(state["got_in_epoch"])
        self.exhausted = bool(state["exhausted"])
        self.buffer_size = int(state["buffer_size"])
        self.rng.seek(int(state["draws"]))
        self._restoring = [(int(a), int(b)) for a, b in state["buffer"]]
        self.skips = {(int(e), int(p)): tuple(map(int, d)) for e, p, *d in state["skips"]}
        self.inherited = [slice_of(row, f"stream {self.source.name!r}") for row in state["inherit"]]
        self.inherit_epoch = int(state["inherit_epoch"])

    def locations(self) -> list[tuple[int, int]]:
        return self._restoring

    def attach(self, lookup: Callable[[tuple[int, ...]], Sample]) -> None:
        self.buffer, self._restoring = [lookup(loc) for loc in self._restoring], []
        self.held = sum(map(_LENGTH, self.buffer))


_LENGTH = operator.attrgetter("length")


def _fits(room: int, n: int, held: int) -> int:
    """How many samples to read next into ``room`` tokens, from the ``n`` samples of ``held`` tokens
    in the buffer: those that fill about half the room at their mean length (so a run rarely
    overshoots; the last runs are of one sample), at least 1, at most ``n`` (the buffer at most
    doubles at a time)."""
    if n == 0 or held <= 0:
        return 1
    return max(1, min(n, room * n // (2 * held)))


# make_sample's default case for runs of samples, in C (mixer/_native/_tarwalk.c); None without the compiled core
_convert = _tarwalk.samples if _tarwalk is not None else None


class _SkipAgain(Exception):
    """Reading reached a point where the run being resumed gave the shard up."""


def _raising(exc: BaseException) -> Iterator[list[dict[str, Any]]]:
    raise exc
    yield  # a generator that raises when first advanced
