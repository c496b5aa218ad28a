"""The device feed (`mixer.to_device`, `make_loader(device=...)`).

On a machine without CUDA: the CPU pass-through, the ConfigErrors, the synchronous path for other
devices (the `meta` device stands in), and the CUDA stream protocol driven through a recording
stand-in for the stream operations. Where CUDA exists, the `cuda` tests check the real thing: values
and order after the copy, that a batch is never read before its copy is done (the copy is held back
behind a sleeping kernel on the side stream, into memory pre-filled with -1), and that a handed-out
batch's memory is not reused while the consumer's stream may still read it (record_stream).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter, namedtuple

import numpy as np
import pytest
import torch

import mixer
from mixer.batching.batch import Batch, BatchMeta
from mixer.batching.collate import collate

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU machine)")


def make_batch(k: int, *, rows: int = 4, seq_len: int = 64) -> Batch:
    """Batch `k`: every row full, tokens k * 1_000_000 + position, so any mix-up shows."""
    toks = [np.arange(seq_len, dtype=np.int64) + k * 1_000_000 + r * seq_len for r in range(rows)]
    lengths = np.full(rows, seq_len)
    return collate(toks, lengths, np.full(rows, k % 3), [f"b{k}-{r}" for r in range(rows)], meta=BatchMeta(step=k))


def expected_tokens(k: int, *, rows: int = 4, seq_len: int = 64) -> torch.Tensor:
    return torch.arange(rows * seq_len, dtype=torch.int32).view(rows, seq_len) + k * 1_000_000


# --------------------------------------------------------------------------------------------------
# everywhere


def test_cpu_passes_the_same_objects_through_in_order():
    batches = [make_batch(k) for k in range(5)]
    got = list(mixer.to_device(batches, "cpu"))
    assert [id(b) for b in got] == [id(b) for b in batches]
    feed = mixer.to_device(batches, torch.device("cpu"))
    assert len(feed) == 5 and list(feed) == batches  # re-iterable, like the Loader it wraps


@pytest.mark.skipif(CUDA, reason="checks the behaviour without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_config_error(device):
    with pytest.raises(mixer.ConfigError, match="CUDA is not available"):
        mixer.to_device([make_batch(0)], device)


@pytest.mark.skipif(CUDA, reason="checks the behaviour without CUDA")
def test_make_loader_cuda_without_cuda_fails_at_construction(three_sources):
    mix = mixer.Mixture([mixer.Source("web", three_sources["web"][0])], batching=mixer.TokenBudget(max_tokens=4096))
    with pytest.raises(mixer.ConfigError, match="CUDA is not available"):
        mixer.make_loader(mix, device="cuda")


@pytest.mark.parametrize("prefetch", [0, -1, True, 1.5, "2"])
def test_prefetch_must_be_a_positive_int(prefetch):
    with pytest.raises(mixer.ConfigError, match="prefetch"):
        mixer.to_device([], "cpu", prefetch=prefetch)


def test_not_a_device_is_a_config_error():
    with pytest.raises(mixer.ConfigError, match="not a torch device"):
        mixer.to_device([], "gpu0")


Pair = namedtuple("Pair", "tokens lengths")


def test_other_devices_copy_synchronously_and_keep_the_structure():
    # `meta` stands in for a device without a stream API here: a plain .to() per batch.
    items = [
        make_batch(0),
        (torch.zeros(3, dtype=torch.int64), "label", {"x": torch.ones(2, 2)}),
        Pair(torch.arange(4), [torch.arange(2), 7]),
    ]
    feed = mixer.to_device(items, "meta")
    batch, tup, pair = list(feed)
    assert isinstance(batch, Batch) and batch.buffer.is_meta
    assert batch.tokens.shape == (4, 64) and batch.keys == items[0].keys and batch.meta == BatchMeta(step=0)
    assert tup[0].is_meta and tup[1] == "label" and tup[2]["x"].is_meta and tup[2]["x"].shape == (2, 2)
    assert isinstance(pair, Pair) and pair.tokens.is_meta and pair.lengths[0].is_meta and pair.lengths[1] == 7
    assert feed.copies == 3
    assert feed.bytes_copied == items[0].buffer.numel() * 4 + 3 * 8 + 4 * 4 + 4 * 8 + 2 * 8


def test_make_loader_device_cpu_gives_the_same_batches_and_counters(three_sources):
    def run(**kw):
        mix = mixer.Mixture(
            [mixer.Source(n, three_sources[n][0], weight=w) for n, w in (("web", 0.7), ("code", 0.3))],
            batching=mixer.TokenBudget(max_tokens=8192),
            seed=3,
        )
        loader = mixer.make_loader(mix, **kw)
        got = [(b.keys, b.tokens.clone()) for b, _ in zip(loader, range(25))]
        return got, loader.counters()

    plain, counters = run()
    fed, fed_counters = run(device="cpu", device_prefetch=3)
    assert [k for k, _ in fed] == [k for k, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fed, plain))
    assert fed_counters == counters


# --------------------------------------------------------------------------------------------------
# the CUDA protocol, with the stream operations replaced by a recorder


class RecordingOps:
    """Stands in for `mixer.runtime.device._CudaOps`: performs no copy, logs every stream operation."""

    def __init__(self, pinned: bool = True) -> None:
        self.log: list[tuple] = []
        self.pinned = pinned
        self.in_side = False
        self.events = 0

    def new_stream(self):
        self.log.append(("stream",))
        return "side"

    @contextlib.contextmanager
    def use(self, stream):
        assert stream == "side" and not self.in_side
        self.in_side = True
        try:
            yield
        finally:
            self.in_side = False

    def event(self, stream, timing):
        self.events += 1
        self.log.append(("event", stream, self.events, self.in_side))
        return self.events

    def is_pinned(self, item):
        return self.pinned

    def pin(self, item):
        self.log.append(("pin", item.meta.step))
        return item

    def move(self, item):
        assert self.in_side, "copies must be queued on the side stream"
        moved = item._with_buffer(item.buffer.clone())
        self.log.append(("copy", item.meta.step, id(moved.buffer)))
        return moved, [moved.buffer]

    def current_stream(self):
        return "consumer"

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def record_stream(self, tensor, stream):
        self.log.append(("record", id(tensor), stream))


def drive(n: int, prefetch: int, ops: RecordingOps, take: int | None = None) -> tuple[list[Batch], int]:
    pulled = 0

    def source():
        nonlocal pulled
        for k in range(n):
            pulled += 1
            yield make_batch(k)

    # The CUDA stream protocol driven on the CPU: the stand-in records every stream operation.
    feed = mixer.to_device(source(), "cpu", prefetch=prefetch)
    gen = feed._side_stream_feed(ops)
    got = []
    for batch in gen:
        ops.log.append(("handed", batch.meta.step))
        got.append(batch)
        if take is not None and len(got) == take:
            gen.close()
            break
    return got, pulled


@pytest.mark.parametrize("prefetch", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 3, 10])
def test_stream_protocol(prefetch, n):
    ops = RecordingOps()
    got, _ = drive(n, prefetch, ops)
    assert [b.meta.step for b in got] == list(range(n))
    for b, k in zip(got, range(n)):
        assert torch.equal(b.tokens, expected_tokens(k))
    log = ops.log
    assert log[0] == ("stream",) and sum(e == ("stream",) for e in log) == 1
    pos = {e[:2]: i for i, e in enumerate(log) if e[0] in ("copy", "handed")}
    for k in range(n):
        copy_at, handed_at = pos[("copy", k)], pos[("handed", k)]
        # right after its copy, still on the side stream: the event that marks the copy done
        _, stream, event, in_side = log[copy_at + 1]
        assert log[copy_at + 1][0] == "event" and stream == "side" and in_side
        buffer_id = log[copy_at][2]
        # just before hand-out: the consumer's stream waits on exactly that event, and the device
        # buffer is recorded as used by the consumer's stream
        assert log[handed_at - 2] == ("wait", "consumer", event)
        assert log[handed_at - 1] == ("record", buffer_id, "consumer")
        # at least `prefetch` batches ahead (as many as exist), and never more
        ahead = [j for j in range(n) if pos[("copy", j)] < handed_at]
        assert ahead == list(range(min(n, k + prefetch + 1)))
    assert sum(e[0] == "wait" for e in log) == n and sum(e[0] == "record" for e in log) == n


def test_stops_pulling_when_the_consumer_stops():
    ops = RecordingOps()
    got, pulled = drive(100, 3, ops, take=5)
    assert len(got) == 5 and pulled == 5 + 3


def test_unpinned_batches_are_pinned_with_one_warning():
    ops = RecordingOps(pinned=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drive(4, 1, ops)
    assert [e for e in ops.log if e[0] == "pin"] == [("pin", k) for k in range(4)]
    assert sum("pinned memory" in str(w.message) for w in caught) == 1
    order = [e[:2] for e in ops.log if e[0] in ("pin", "copy")]
    assert order == [x for k in range(4) for x in (("pin", k), ("copy", k))]


# --------------------------------------------------------------------------------------------------
# CUDA (skipped without it)


def spin(ms: float) -> None:
    """Queue a kernel that keeps the current stream busy for about `ms` milliseconds."""
    torch.cuda._sleep(int(ms * 1e-3 * _clock_hz()))


_CLOCK: list[float] = []


def _clock_hz() -> float:
    if not _CLOCK:  # measure the _sleep rate once: cycles per second
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CLOCK.append(10_000_000 / (start.elapsed_time(end) / 1e3))
    return _CLOCK[0]


@needs_cuda
def test_cuda_values_and_order_match_a_synchronous_copy():
    host = [make_batch(k).pin_memory() for k in range(12)]
    feed = mixer.to_device(host, "cuda", prefetch=2, timing=True)
    got = list(feed)
    assert [b.meta.step for b in got] == list(range(12))
    for b, h in zip(got, host):
        assert b.buffer.is_cuda and b.tokens.is_cuda and b.keys == h.keys
        assert torch.equal(b.buffer, h.to("cuda").buffer)  # the plain synchronous copy
        assert torch.equal(b.tokens.cpu(), expected_tokens(b.meta.step))
    assert feed.copies == 12 and feed.bytes_copied == sum(h.buffer.numel() * 4 for h in host)
    assert feed.copy_seconds > 0


@needs_cuda
def test_cuda_bad_index_is_a_config_error():
    with pytest.raises(mixer.ConfigError, match="no such CUDA device"):
        mixer.to_device([], f"cuda:{torch.cuda.device_count()}")


@needs_cuda
def test_cuda_batch_is_not_read_before_its_copy_is_done():
    n, numel = 6, make_batch(0).buffer.numel()
    feed = mixer.to_device([], "cuda", prefetch=2)

    def held_back():
        for k in range(n):
            with torch.cuda.stream(feed.stream):
                # the block the copy will get from the side stream's pool now holds -1 ...
                junk = torch.full((numel,), -1, dtype=torch.int32, device="cuda")
                del junk
                # ... and the copy waits ~50 ms behind this kernel
                spin(50)
            yield make_batch(k).pin_memory()

    feed.batches = held_back()
    reads = []
    for b in feed:
        # queued on the consumer's stream at once: without the event wait it runs before the copy
        reads.append(b.tokens.clone())
    torch.cuda.synchronize()
    for k, r in enumerate(reads):
        assert torch.equal(r.cpu(), expected_tokens(k)), f"batch {k} was read before its copy finished"


@needs_cuda
def test_cuda_memory_is_not_reused_while_the_consumer_may_read_it():
    n = 8
    host = [make_batch(k).pin_memory() for k in range(n)]  # all the same size: blocks get reused
    outs = []
    for b in mixer.to_device(host, "cuda", prefetch=1):
        spin(30)  # the consumer's stream is busy; the read below runs ~30 ms from now ...
        outs.append(b.tokens * 1)
        del b  # ... and the next copies (side stream, idle) would land in this block at once
    torch.cuda.synchronize()
    for k, out in enumerate(outs):
        assert torch.equal(out.cpu(), expected_tokens(k)), f"batch {k}'s memory was reused under the consumer"


@needs_cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_make_loader_matches_the_cpu_loader(three_sources, num_workers):
    def run(**kw):
        mix = mixer.Mixture(
            [mixer.Source(n, three_sources[n][0], weight=w) for n, w in (("web", 0.6), ("code", 0.3), ("books", 0.1))],
            batching=mixer.TokenBudget(max_tokens=16384),
            seed=5,
        )
        loader = mixer.make_loader(mix, num_workers=num_workers, **kw)
        return [b for b, _ in zip(loader, range(30))], loader.counters()

    cpu, cpu_counters = run()
    gpu, gpu_counters = run(device="cuda")
    assert all(b.buffer.is_cuda for b in gpu)
    assert [b.keys for b in gpu] == [b.keys for b in cpu]
    assert all(torch.equal(g.buffer.cpu(), c.buffer) for g, c in zip(gpu, cpu))
    assert gpu_counters == cpu_counters
    assert Counter(int(s) for b in gpu for s in b.source.cpu()) == Counter(int(s) for b in cpu for s in b.source)


@needs_cuda
def test_cuda_batches_sent_to_cpu_come_back_to_the_host():
    on_gpu = [make_batch(k).to("cuda") for k in range(3)]
    got = list(mixer.to_device(on_gpu, "cpu"))
    assert all(b.buffer.device.type == "cpu" for b in got)
    assert [torch.equal(b.tokens, expected_tokens(k)) for k, b in enumerate(got)] == [True] * 3
