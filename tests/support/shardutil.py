"""Writing real WebDataset shards for tests, with tokens a test can recompute from the key.

Every writer here goes through `webdataset.ShardWriter` / `TarWriter` with an integer mtime (a float
one makes tarfile add a PAX header to every member, which is not what real shards look like).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import webdataset as wds

if TYPE_CHECKING:
    import mixer

MTIME = 1_700_000_000
TOKEN_LO, TOKEN_HI = 1, 30000  # 0 stays free as the pad id


def expected_tokens(key: str, length: int, *, seed: int = 0, dtype: Any = np.int32) -> np.ndarray:
    """The tokens `write_token_shards(..., seed=seed)` wrote for `key`: values in [1, 30000]."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
    return rng.integers(TOKEN_LO, TOKEN_HI + 1, size=length).astype(dtype)


def shard_pattern(folder: str | os.PathLike[str], name: str, num_shards: int, suffix: str = ".tar") -> str:
    """The brace pattern of `folder/name-000000.tar` .. `name-{num_shards-1:06d}.tar`."""
    if num_shards == 1:
        return os.path.join(folder, f"{name}-000000{suffix}")
    return os.path.join(folder, f"{name}-{{000000..{num_shards - 1:06d}}}{suffix}")


def write_samples(
    folder: str | os.PathLike[str],
    name: str,
    samples_per_shard: Sequence[Sequence[Mapping[str, Any]]],
    *,
    suffix: str = ".tar",
) -> str:
    """Write `samples_per_shard[i]` into `folder/name-{i:06d}.tar`; return the brace pattern.

    Samples are dicts as `webdataset.TarWriter` takes them (``__key__`` plus members, encoded by
    extension: ``.npy`` arrays, ``txt`` strings, raw ``bytes``); an empty list gives an empty shard.
    ``suffix=".tar.gz"`` (or ``".tgz"``) makes webdataset's writer gzip each shard.
    """
    if not samples_per_shard:
        raise ValueError("write_samples: need at least one shard")
    os.makedirs(folder, exist_ok=True)
    pattern = os.path.join(os.fspath(folder).replace("%", "%%"), f"{name}-%06d{suffix}")
    total = sum(len(samples) for samples in samples_per_shard)
    # maxcount never triggers: next_stream() draws the shard boundaries exactly where asked.
    with wds.ShardWriter(pattern, maxcount=total + 1, verbose=0, mtime=MTIME) as writer:
        for shard, samples in enumerate(samples_per_shard):
            if shard:
                writer.next_stream()
            for sample in samples:
                writer.write(dict(sample))
    return shard_pattern(folder, name, len(samples_per_shard), suffix)


def write_token_shards(
    folder: str | os.PathLike[str],
    name: str,
    lengths_per_shard: Sequence[Sequence[int]],
    *,
    dtype: Any = np.int32,
    member: str = "tokens.npy",
    seed: int = 0,
    suffix: str = ".tar",
) -> str:
    """One sample per length, key ``f"{name}-{shard:06d}-{i:06d}"``, tokens `expected_tokens(key, n)`."""
    samples_per_shard = []
    for shard, lengths in enumerate(lengths_per_shard):
        samples = []
        for i, length in enumerate(lengths):
            key = token_key(name, shard, i)
            samples.append({"__key__": key, member: expected_tokens(key, length, seed=seed, dtype=dtype)})
        samples_per_shard.append(samples)
    return write_samples(folder, name, samples_per_shard, suffix=suffix)


def token_key(name: str, shard: int, index: int) -> str:
    return f"{name}-{shard:06d}-{index:06d}"


def key_lengths(name: str, lengths_per_shard: Sequence[Sequence[int]]) -> dict[str, int]:
    """``{key: length}`` of what `write_token_shards(folder, name, lengths_per_shard)` writes."""
    return {
        token_key(name, shard, i): int(n)
        for shard, lengths in enumerate(lengths_per_shard)
        for i, n in enumerate(lengths)
    }


def lognormal_lengths(
    n: int, *, median: float, sigma: float, lo: int = 1, hi: int | None = None, seed: int
) -> list[int]:
    """`n` lengths from a log-normal with this median, rounded and clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    lengths = np.rint(median * np.exp(sigma * rng.standard_normal(n)))
    return [int(x) for x in np.clip(lengths, lo, hi if hi is not None else np.inf)]


def split_evenly(values: Sequence[int], num_shards: int) -> list[list[int]]:
    """`values` cut into `num_shards` consecutive runs whose sizes differ by at most one."""
    bounds = [len(values) * i // num_shards for i in range(num_shards + 1)]
    return [list(values[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def write_tar_members(path: str | os.PathLike[str], members: Sequence[tuple[str, bytes]]) -> str:
    """A tar with exactly these member names and bytes, in this order (for malformed-input tests:
    members without an extension, a key split across non-adjacent members, directories, ...)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member_name, data in members:
            info = tarfile.TarInfo(member_name)
            info.size, info.mtime, info.mode = len(data), MTIME, 0o444
            tar.addfile(info, io.BytesIO(data))
    return os.fspath(path)


def npy_bytes(array: np.ndarray) -> bytes:
    """The bytes of `array` as a ``.npy`` member (for `write_tar_members`)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """One source of token shards: `samples` log-normal lengths (this `median` and `sigma`, rounded,
    clipped to [`lo`, `hi`], drawn from `seed`) cut into `shards` shards whose sizes differ by at most
    one, or, when `shards` is a tuple, into consecutive shards of exactly those sizes (`samples` is
    then their sum). Frozen, so a spec is a cache key for the session-wide `make_sources` fixture."""

    shards: int | tuple[int, ...]
    median: float
    sigma: float
    seed: int
    samples: int | None = None
    lo: int = 1
    hi: int | None = None

    def per_shard(self) -> list[list[int]]:
        sizes = self.shards if isinstance(self.shards, tuple) else None
        n = sum(sizes) if sizes is not None else self.samples
        assert n is not None and (sizes is None or self.samples in (None, n)), self
        lengths = lognormal_lengths(n, median=self.median, sigma=self.sigma, lo=self.lo, hi=self.hi, seed=self.seed)
        if sizes is None:
            assert isinstance(self.shards, int)
            return split_evenly(lengths, self.shards)
        bounds = np.cumsum((0,) + sizes).tolist()
        return [lengths[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


Sources = dict[str, tuple[str, dict[str, int]]]


#: Three sources for resume tests: "tiny" turns over its epoch every few batches, so cuts land right
#: after epoch restarts.
RESUME_SOURCES = {
    "web": LogNormal(shards=6, samples=900, median=120, sigma=0.8, lo=2, hi=2048, seed=0),
    "code": LogNormal(shards=3, samples=300, median=400, sigma=1.0, lo=2, hi=2048, seed=1),
    "tiny": LogNormal(shards=2, samples=40, median=60, sigma=0.5, lo=2, hi=2048, seed=2),
}


def write_sources(folder: str | os.PathLike[str], spec: Mapping[str, LogNormal]) -> Sources:
    """``{name: (brace pattern, {key: length})}`` for each source of `spec`, written into `folder`;
    the tokens of each sample are `expected_tokens(key, length)`."""
    out = {}
    for name, source in spec.items():
        per_shard = source.per_shard()
        out[name] = (write_token_shards(folder, name, per_shard), key_lengths(name, per_shard))
    return out


def mixture(
    sources: Mapping[str, tuple[str, Any]],
    *,
    weights: Mapping[str, float | None],
    source_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> mixer.Mixture:
    """A `mixer.Mixture` over `sources` (``{name: (pattern, ...)}``, as `write_sources` returns), one
    `mixer.Source` per name of `weights` in that order (None: the default weight), each with
    `source_options`; `options` are the Mixture's keywords. Test files fix their defaults with
    ``functools.partial(mixture, weights=..., ...)``; a call's keywords override them."""
    import mixer  # here, so a broken `mixer` import fails tests, not collection

    srcs = []
    for name, weight in weights.items():
        kwargs = dict(source_options or {})
        if weight is not None:
            kwargs["weight"] = weight
        srcs.append(mixer.Source(name, sources[name][0], **kwargs))
    return mixer.Mixture(srcs, **options)
