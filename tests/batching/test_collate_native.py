"""The compiled copies of the padded and packed collates (`mixer._native._rows`) against numpy's, their
oracle: the same buffers (tokens, pad, positions, lengths, sources, ...), keys and errors, batch by
batch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mixer
from mixer.batching import collate as collate_mod
from mixer.batching.batch import BatchMeta
from mixer.batching.batchers import PackedGroup, Packer
from mixer.batching.collate import PackedLayout, collate
from mixer.read import tario
from mixer.read.decode import Sample
from mixer.runtime.transport import SlotPool

needs_rows = pytest.mark.skipif(
    collate_mod._rows is None, reason="mixer._native._rows was not built (no C compiler at install)"
)

TOKEN_DTYPES = ["int32", "int64", "uint16", "int8", "uint8", "int16", "uint32", "uint64"]


def both_ways(make: Callable[..., Any], *args: Any, **kw: Any) -> tuple[Any, Any]:
    """(compiled, numpy): ``make(*args, native=..., **kw)`` each way, a batch or the exception it
    raised as (type, message)."""
    got = []
    for native in (True, False):
        try:
            got.append(make(*args, native=native, **kw))
        except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
            got.append((type(e), str(e)))
    return got[0], got[1]


def both(arrays: Any, lengths: Any, sources: Any, keys: list[str], **kw: Any) -> tuple[Any, Any]:
    return both_ways(collate, arrays, lengths, sources, keys, **kw)


def assert_same(a: Any, b: Any) -> None:
    if isinstance(b, tuple) or isinstance(a, tuple):
        assert a == b
        return
    assert a.buffer.dtype == b.buffer.dtype and torch.equal(a.buffer, b.buffer)
    assert (a.batch_size, a.seq_len, a.keys) == (b.batch_size, b.seq_len, b.keys)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths) and torch.equal(a.source, b.source)


def random_row(rng: np.random.Generator, k: int, dtype: str) -> np.ndarray:
    """``k`` tokens of ``dtype`` over its whole range (so casts wrap), sometimes a strided or
    reversed view, sometimes a read-only one."""
    info = np.iinfo(dtype)
    how = int(rng.integers(0, 5))
    if how == 0:  # every other element of a longer array
        base = rng.integers(info.min, info.max, 2 * k, dtype=dtype, endpoint=True)
        return base[::2]
    if how == 1:  # reversed
        return rng.integers(info.min, info.max, k, dtype=dtype, endpoint=True)[::-1]
    x = rng.integers(info.min, info.max, k, dtype=dtype, endpoint=True)
    if how == 2:
        x.flags.writeable = False
    return x


@needs_rows
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("out_dtype", ["int32", "int64"])
def test_compiled_and_numpy_rows_agree_on_random_batches(seed: int, out_dtype: str) -> None:
    rng = np.random.Generator(np.random.PCG64(seed))
    for _ in range(60):
        b = int(rng.integers(0, 40))
        lengths = np.clip(rng.lognormal(np.log(30), 0.8, b).astype(np.int64), 0, 400)
        mostly = rng.choice(TOKEN_DTYPES)
        arrays = [
            random_row(rng, k, mostly if rng.random() < 0.8 else rng.choice(TOKEN_DTYPES)) for k in lengths.tolist()
        ]
        pad_id = int(rng.choice([0, 0, 1, -1, 7, 2**31 - 1, -(2**31)]))
        sources = rng.integers(0, 5, b)
        keys = [f"k{i}" for i in range(b)]
        a, p = both(arrays, lengths, sources, keys, pad_id=pad_id, dtype=out_dtype)
        assert_same(a, p)


@needs_rows
@pytest.mark.parametrize("pad_id", [0, 3])
def test_compiled_rows_into_a_reused_out_buffer_agree_with_numpy(pad_id: int) -> None:
    """Into a buffer ``out=`` gives (a worker's slot), whose old contents must not show through."""
    rng = np.random.Generator(np.random.PCG64(11))
    stale = np.empty(8192, np.int32)
    for _ in range(40):
        b = int(rng.integers(1, 30))
        lengths = rng.integers(0, 100, b)
        arrays = [rng.integers(-5, 30000, k).astype(rng.choice(["int32", "int64", "uint16"])) for k in lengths.tolist()]
        got = []
        for native in (True, False):
            stale[:] = -99999  # an earlier, longer batch's tokens
            batch = collate(
                arrays, lengths, np.zeros(b, np.int64), ["x"] * b, pad_id=pad_id, out=lambda n: stale[:n], native=native
            )
            assert batch.buffer.data_ptr() == stale.ctypes.data  # it went into the buffer
            got.append(batch.buffer.clone())
        assert torch.equal(got[0], got[1]) and not (got[0] == -99999).any()


@needs_rows
def test_compiled_rows_into_a_worker_slot_read_back_as_numpys() -> None:
    """Through a real slot pool: written by a worker's collate, sealed, read back as a view."""
    rng = np.random.Generator(np.random.PCG64(12))
    pool = SlotPool(num_workers=1, slots=1, slot_elems=4096, dtype=np.dtype(np.int32))
    for _ in range(10):
        lengths = rng.integers(0, 100, 20)
        arrays = [rng.integers(0, 30000, k).astype(np.int32) for k in lengths.tolist()]
        got = []
        for native in (True, False):
            writer = pool.writer(0)
            batch = collate(
                arrays, lengths, np.ones(20, np.int64), ["x"] * 20, pad_id=-1, out=writer.out, native=native
            )
            sealed = writer.seal()
            assert sealed is not None
            _, worker, slot, stamp, _ = sealed
            n = batch.buffer.numel()
            del batch
            view = pool.view_out(worker, slot, stamp, n)
            got.append(view.copy())
            del view  # frees the slot for the next batch
        assert np.array_equal(got[0], got[1])


@needs_rows
def test_rows_numpy_must_copy_go_through_numpy_alongside_compiled_ones() -> None:
    """Rows the C code leaves to numpy, among ones it copies: other array types, non-native byte
    order, floats, bools, a subclass, a 2-D row, a length-1 row broadcast over its length."""

    class Sub(np.ndarray):
        pass

    odd: list[tuple[Any, int]] = [
        ([1, 2, 3], 3),
        ((4, 5), 2),
        (np.array([6, 7, 8], dtype=">i4"), 3),
        (np.array([1.9, -2.7, 3e4]), 3),
        (np.array([True, False]), 2),
        (np.arange(4, dtype=np.int32).view(Sub), 4),
        (np.arange(6, dtype=np.int32).reshape(2, 3)[:1], 3),
        (np.array([9], dtype=np.int32), 4),  # broadcast: numpy fills all 4
        (np.array(5, dtype=np.int64), 3),  # 0-d: broadcast too
        (torch.arange(3, dtype=torch.int32), 3),
        (memoryview(np.arange(3, dtype=np.int32)), 3),
    ]
    rng = np.random.Generator(np.random.PCG64(3))
    for out_dtype in ("int32", "int64"):
        for pad_id in (0, -7):
            arrays: list[Any] = []
            lengths = []
            for x, k in odd:
                arrays += [rng.integers(0, 100, 5, dtype=np.int32), x]
                lengths += [5, k]
            a, p = both(
                arrays,
                np.array(lengths),
                np.arange(len(arrays)),
                [str(i) for i in range(len(arrays))],
                pad_id=pad_id,
                dtype=out_dtype,
            )
            assert not isinstance(p, tuple)
            assert_same(a, p)


@needs_rows
@pytest.mark.parametrize(
    "case",
    [
        "short row",
        "long row",
        "row of wrong shape",
        "string row",
        "pad too large",
        "pad too large int64",
        "pad float",
        "pad numpy int",
        "lengths float",
        "tuple of arrays",
        "more lengths than arrays",
        "fewer lengths than arrays",
        "negative length",
        "none row",
    ],
)
def test_errors_and_odd_batches_are_numpys(case: str) -> None:
    """Whatever numpy raises (or does) for an odd batch, the compiled path raises (or does) too."""
    ok = [np.arange(1, 6, dtype=np.int32), np.arange(1, 4, dtype=np.int64)]
    lengths: Any = np.array([5, 3, 4])
    pad_id: Any = 0
    dtype = "int32"
    arrays: Any = [*ok, np.arange(4, dtype=np.int32)]
    if case == "short row":
        arrays[2] = np.arange(3, dtype=np.int32)
    elif case == "long row":
        arrays[2] = np.arange(6, dtype=np.int32)
    elif case == "row of wrong shape":
        arrays[2] = np.zeros((2, 4), dtype=np.int32)
    elif case == "string row":
        arrays[2] = "abcd"
    elif case == "none row":
        arrays[2] = None
    elif case == "pad too large":
        pad_id = 2**31
    elif case == "pad too large int64":
        pad_id, dtype = 2**63, "int64"
    elif case == "pad float":
        pad_id = 2.5
    elif case == "pad numpy int":
        pad_id = np.int64(-3)
    elif case == "lengths float":
        lengths = np.array([5.0, 3.0, 4.0])
    elif case == "tuple of arrays":
        arrays = tuple(arrays)
    elif case == "more lengths than arrays":
        lengths = np.array([5, 3, 4, 2])
    elif case == "fewer lengths than arrays":
        lengths = np.array([5, 3])
    elif case == "negative length":
        lengths = np.array([5, -1, 4])
        arrays[1] = np.arange(4, dtype=np.int64)  # flat[5:4] is empty: numpy takes a 0-length row only
        arrays[1] = arrays[1][:0]
    a, p = both(arrays, lengths, np.zeros(3, np.int64), ["a", "b", "c"], pad_id=pad_id, dtype=dtype)
    assert_same(a, p)
    if case in (
        "short row",
        "long row",
        "row of wrong shape",
        "pad too large",
        "more lengths than arrays",
        "fewer lengths than arrays",
    ):
        assert isinstance(p, tuple), f"{case}: numpy should raise here"


def test_empty_batch_is_the_same_both_ways() -> None:
    a, p = both([], np.zeros(0, np.int64), np.zeros(0, np.int64), [], pad_id=5)
    assert_same(a, p)
    assert a.tokens.shape == (0, 0)


def _c_calls(fn: Callable[[], Any]) -> list[str]:
    """The builtin (C) functions ``fn`` calls, by name, as the profiler hook sees them."""
    seen: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            seen.append(f"{getattr(arg, '__module__', None)}.{arg.__name__}")

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_the_compiled_rows_are_built_where_the_reader_core_is() -> None:
    """Both extensions come from the same setup.py and compiler: one built without the other is a
    build failure that `optional=True` would otherwise hide."""
    assert (collate_mod._rows is None) == (tario._tarwalk is None)


@needs_rows
def test_collate_uses_the_compiled_rows_by_default_and_not_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is not silently dead: by default every row of a common batch goes through one
    call of ``_rows.pad``, which takes them all; ``native=False`` and ``NATIVE = False`` do not
    call it."""
    assert collate_mod.NATIVE is True
    rng = np.random.Generator(np.random.PCG64(5))
    lengths = rng.integers(1, 300, 120)
    for dtype in ("int32", "int64", "uint16"):
        arrays = [rng.integers(0, 30000, k).astype(dtype) for k in lengths.tolist()]
        assert (
            collate_mod._rows.pad(np.empty(120 * 300, np.int32), arrays, lengths.tolist(), 300, 0, 0, np.ndarray) == 120
        )
    arrays = [rng.integers(0, 30000, k).astype(np.int32) for k in lengths.tolist()]
    args = (arrays, lengths, np.zeros(120, np.int64), ["k"] * 120)
    assert _c_calls(lambda: collate(*args)).count("mixer._native._rows.pad") == 1
    assert "mixer._native._rows.pad" not in _c_calls(lambda: collate(*args, native=False))
    monkeypatch.setattr(collate_mod, "NATIVE", False)
    assert "mixer._native._rows.pad" not in _c_calls(lambda: collate(*args))


# ---- the packed layout's copies -----------------------------------------------------------------


def both_packed(layout: PackedLayout, group: PackedGroup[Any], sources: np.ndarray, **kw: Any) -> tuple[Any, Any]:
    return both_ways(layout.collate, group, sources, meta=BatchMeta(step=0), **kw)


def assert_same_packed(a: Any, b: Any) -> None:
    if isinstance(b, tuple) or isinstance(a, tuple):
        assert a == b
        return
    # the views, not the whole buffer: the alignment gaps between them are never written
    assert a.buffer.dtype == b.buffer.dtype and a.spec == b.spec
    assert a.keys == b.keys and (a.seq_len, a.max_seqlen) == (b.seq_len, b.max_seqlen)
    for name in ("tokens", "position_ids", "cu_seqlens", "lengths", "source", "offsets"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


PACKINGS = [
    dict(max_tokens=2048, seq_len=256, split_documents=True),
    dict(max_tokens=2048, seq_len=512),
    dict(max_tokens=2048),
]


@needs_rows
@pytest.mark.parametrize("packing", range(len(PACKINGS)))
@pytest.mark.parametrize("out_dtype", ["int32", "int64"])
def test_compiled_and_numpy_packing_agree_on_random_batches(packing: int, out_dtype: str) -> None:
    """Batches as the real Packer places them (rows with splits, whole documents, flat runs), from
    documents of every integer dtype, strided and reversed among them; pad 0 and not."""
    rng = np.random.Generator(np.random.PCG64(100 + packing))
    packed = mixer.Packed(**PACKINGS[packing])  # type: ignore[arg-type]
    for pad_id in (0, -3):
        layout = PackedLayout(packed, dtype=out_dtype, pad_id=pad_id)
        packer: Packer[Sample] = Packer(packed, locate=lambda s: (0, 0))
        groups: list[PackedGroup[Sample]] = []
        for i in range(400):
            k = int(np.clip(rng.lognormal(np.log(60), 0.9), 0, 500))
            sample = Sample(f"d{i}", random_row(rng, k, rng.choice(TOKEN_DTYPES)), k, 0, i)
            if packer.add(sample, k):
                groups.extend(packer.ready)
                packer.ready.clear()
        groups.extend(packer.drain())  # type: ignore[arg-type]
        assert len(groups) > 5
        for group in groups:
            a, p = both_packed(layout, group, rng.integers(0, 3, len(group)))
            assert not isinstance(p, tuple)
            assert_same_packed(a, p)


@needs_rows
def test_compiled_packing_into_a_reused_out_buffer_agrees_with_numpy() -> None:
    rng = np.random.Generator(np.random.PCG64(7))
    packed = mixer.Packed(max_tokens=1024, seq_len=256, split_documents=True)
    layout = PackedLayout(packed, dtype="int32", pad_id=0)
    stale = np.empty(layout.max_elements([[256]]), np.int32)
    packer: Packer[Sample] = Packer(packed, locate=lambda s: (0, 0))
    for i in range(200):
        k = int(rng.integers(1, 300))
        packer.add(Sample(f"d{i}", rng.integers(0, 30000, k).astype(np.int32), k, 0, i), k)
    groups = [*packer.ready, *packer.drain()]
    for group in groups:
        got = []
        for native in (True, False):
            stale[:] = -99999
            batch = layout.collate(
                group, np.zeros(len(group), np.int64), meta=BatchMeta(step=0), out=lambda n: stale[:n], native=native
            )
            assert batch.buffer.data_ptr() == stale.ctypes.data
            assert not (batch.tokens == -99999).any() and not (batch.position_ids == -99999).any()
            got.append(batch.buffer.clone())
        assert torch.equal(got[0], got[1])


@needs_rows
@pytest.mark.parametrize(
    "case",
    [
        "short document",
        "start past the end",
        "negative start",
        "list tokens",
        "float tokens",
        "big-endian tokens",
        "2-D tokens",
        "pad too large",
        "pad too large flat",
        "count over the row",
        "gap in a row",
        "tuple counts",
    ],
)
def test_packing_errors_and_odd_batches_are_numpys(case: str) -> None:
    """Geometry or documents the C code does not vouch for: numpy's code does the batch, so the
    result or the error is numpy's."""
    docs: list[Any] = [
        np.arange(1, 6, dtype=np.int32),
        np.arange(10, 14, dtype=np.int64),
        np.arange(20, 23, dtype=np.uint16),
    ]
    rows, cols, starts, counts, row_len, flat, pad_id = [0, 0, 1], [0, 5, 0], [0, 0, 0], [5, 3, 3], 8, False, 0
    if case == "short document":
        docs[1] = docs[1][:2]
    elif case == "start past the end":
        starts = [0, 5, 0]
    elif case == "negative start":
        starts = [0, -2, 0]
        counts = [5, 2, 3]
    elif case == "list tokens":
        docs[2] = [20, 21, 22]
    elif case == "float tokens":
        docs[2] = np.array([1.5, 2.5, -3.5])
    elif case == "big-endian tokens":
        docs[2] = np.array([20, 21, 22], dtype=">i4")
    elif case == "2-D tokens":
        docs[2] = np.arange(6, dtype=np.int32).reshape(2, 3)
    elif case == "pad too large":
        pad_id = 2**40
    elif case == "pad too large flat":
        pad_id, flat, rows, cols, counts = 2**40, True, [0, 0, 0], [0, 5, 8], [5, 3, 3]
    elif case == "count over the row":
        counts = [5, 4, 3]
    elif case == "gap in a row":
        cols = [1, 5, 0]
    elif case == "tuple counts":
        counts = tuple(counts)  # type: ignore[assignment]
    samples = [Sample(k, d, len(d), 0, i) for i, (k, d) in enumerate(zip("abc", docs))]
    group = PackedGroup(samples, rows, cols, starts, counts, row_len, flat)
    layout = PackedLayout(mixer.Packed(max_tokens=16, seq_len=8), dtype="int32", pad_id=pad_id)
    a, p = both_packed(layout, group, np.zeros(3, np.int64))
    assert_same_packed(a, p)


@needs_rows
def test_packed_collate_uses_the_compiled_copies_by_default() -> None:
    packed = mixer.Packed(max_tokens=1024, seq_len=256, split_documents=True)
    packer: Packer[Sample] = Packer(packed, locate=lambda s: (0, 0))
    for i in range(20):
        packer.add(Sample(f"d{i}", np.arange(100, dtype=np.int32), 100, 0, i), 100)
    group = [*packer.ready, *packer.drain()][0]
    layout = PackedLayout(packed, dtype="int32", pad_id=0)
    sources = np.zeros(len(group), np.int64)
    assert (
        _c_calls(lambda: layout.collate(group, sources, meta=BatchMeta(step=0))).count("mixer._native._rows.pack") == 1
    )
    assert "mixer._native._rows.pack" not in _c_calls(
        lambda: layout.collate(group, sources, meta=BatchMeta(step=0), native=False)
    )


@needs_rows
@pytest.mark.parametrize("args", [["--quick"], ["--packed", "--samples", "3000", "--rounds", "1"]])
def test_the_collate_benchmark_runs_and_checks_both_ways(args: list[str]) -> None:
    """`python -m benchmarks.collate_speed` compares compiled and numpy outputs before it times them."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collate_speed", *args], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| compiled |" in proc.stdout or "| flat |" in proc.stdout, proc.stdout
