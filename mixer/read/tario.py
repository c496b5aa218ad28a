"""Generator stages that turn a tar byte stream into members and then into WebDataset samples.

Why not `tarfile` (and so `webdataset`): in stream mode `tarfile` ends *silently* when it meets a
corrupt header after the first one (CPython issue 120740), so a damaged shard quietly loses its
tail; and it costs ~40 µs per small sample. Here every header checksum is verified and the
per-member work is a handful of slices on one large buffer. Like `tarfile`, an archive that stops
right after a complete member (streaming writers leave out the end-of-archive blocks) ends there,
its last sample delivered; a stream that stops inside a header or a member's data is damage.

Pipeline: ``iter_members(stream) -> group_samples(members) -> samples``; `read_samples` chains them,
through the compiled core (`mixer._native._tarwalk`) where it was built, which defers to this code.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable, Iterator
from itertools import chain
from typing import Any, BinaryIO, cast
from zlib import adler32

from mixer import _native
from mixer.errors import ConfigError, SampleError, ShardError
from mixer.read.tarheader import (
    BLOCK,
    EXTENSIONS,
    NO_DATA,
    REGULAR,
    SPARSE,
    ZERO_BLOCK,
    TarDamage,
    apply_extensions,
    checksum_ok,
    corrupt,
    extension,
    header_number,
    nts,
    signed_mismatch,
    sparse_member,
)
from mixer.storage.compressed import compression_hint

__all__ = ["NATIVE", "TarDamage", "group_samples", "iter_members", "read_samples"]

Member = tuple[str, int, bytes]

# webdataset.tariterators, verbatim, so that key/extension splitting and metadata skipping agree
# exactly (our fast paths below fall back to these whenever they are not provably equivalent).
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_RESERVED = frozenset(("__key__", "__url__", "__offset__", "__end__"))


def iter_members(
    stream: BinaryIO, *, url: str, start_offset: int = 0, chunk_size: int = 1 << 20
) -> Generator[Member, None, int]:
    """Yield ``(name, offset, data)`` for each regular-file member of a tar stream.

    ``offset`` is the shard byte offset of the member's first header block (its GNU long-name or
    PAX header when it has one), so re-opening the shard there with ``start_offset=offset`` resumes
    at this member. The stream must start at a member boundary; ``start_offset`` only labels it.

    Names follow `tarfile`: ustar prefix, GNU ``L`` long names and PAX ``path`` records (local and
    global) are applied; directories, links, devices and other non-regular members are skipped.
    Every header checksum is verified (unsigned or signed sum). The archive ends with a zero block,
    or with the end of the stream right after a complete member (or after zero bytes there); running
    out of bytes mid-header or mid-data is a `ShardError` ("truncated"), and no member with
    incomplete data is ever yielded. GNU sparse members are refused by name. A bad checksum is a `ShardError`
    ("corrupt header"). Both are a `TarDamage` saying where. A shard that is empty, or whose first
    block is no tar header, says so ("empty file", "not a tar file (starts with ...)"). The
    generator's return value is the offset of the end-of-archive block (`group_samples` uses it as
    the last sample's ``__end__``).
    """
    return _walk(stream, None, start_offset, url, chunk_size)  # one generator frame per member, not two


def _opening(stream: BinaryIO, url: str, start_offset: int, chunk_size: int) -> bytes:
    """The arguments checked, and the shard's first bytes when it is read from its start."""
    if start_offset < 0 or start_offset % BLOCK:
        raise ConfigError(f"{url}: start_offset must be a non-negative multiple of 512 (got {start_offset})")
    if chunk_size < BLOCK:
        raise ConfigError(f"{url}: chunk_size must be >= 512 (got {chunk_size})")
    if start_offset == 0:  # once per shard: a clear word for files that are no tar at all
        return _first_block(stream, chunk_size, url)
    return b""


def _walk(stream: BinaryIO, buf: bytes | None, base: int, url: str, chunk_size: int) -> Generator[Member, None, int]:
    """`iter_members` from a member boundary: `buf` holds the stream's bytes from shard offset `base`
    on (the compiled reader hands over here with what it had read); None: open the shard here."""
    if buf is None:
        buf = _opening(stream, url, base, chunk_size)
    blen = len(buf)
    pos = 0
    first = -1  # shard offset of the first extension header of the member being assembled
    exts: list[tuple[int, Any]] = []  # (typeflag, payload) of pending extension headers, in order
    global_pax: dict[str, str] = {}
    while True:
        if pos + BLOCK > blen:
            buf, base = _refill(
                stream,
                buf,
                pos,
                base,
                BLOCK,
                chunk_size,
                url,
                "a tar header or end block",
                first if exts else -1,
                end_ok=not exts and base + pos > 0,  # not at a shard's first byte: "empty"/"truncated" there
            )
            if not buf:
                # The stream ends right after a complete member, with no end-of-archive block (as
                # streaming writers leave it): the end, as tarfile and webdataset read it.
                return base
            pos, blen = 0, len(buf)
        typeflag = buf[pos + 156]
        field = buf[pos + 148 : pos + 156]
        try:
            stored = int(field.rstrip(b"\0 "), 8)
        except ValueError:  # not the common "%06o\0 " spelling: parse exactly as tarfile does
            stored = header_number(buf, pos, 148, url, base)
        # adler32 is the only C-speed byte sum at hand. A 512-byte sum can exceed its modulus but a
        # 256-byte one cannot (256 * 255 < 65521), so adler32's low half is exactly 1 + the byte sum
        # of each half. The checksum field counts as 8 spaces (+256) instead of its own bytes.
        unsigned = (
            (adler32(buf[pos : pos + 256]) & 0xFFFF)
            + (adler32(buf[pos + 256 : pos + 512]) & 0xFFFF)
            - (adler32(field) & 0xFFFF)
            + 255
        )
        if stored != unsigned and signed_mismatch(buf, pos, stored, unsigned):
            if buf[pos : pos + BLOCK] == ZERO_BLOCK:
                if exts:
                    raise corrupt(url, first, "an extension header is followed by the end-of-archive block")
                return base + pos
            raise corrupt(url, base + pos, f"bad checksum (stored {stored}, computed {unsigned})")
        try:
            size = int(buf[pos + 124 : pos + 136].rstrip(b"\0 "), 8)
        except ValueError:
            size = header_number(buf, pos, 124, url, base)
        if size < 0:  # int() takes a sign; tarfile would too, and then misread the shard
            raise corrupt(url, base + pos, f"negative size {size}")

        if typeflag in REGULAR:
            end = buf.find(b"\0", pos, pos + 100)
            name = buf[pos : end if end >= 0 else pos + 100].decode("utf-8", "surrogateescape")
            if typeflag != 0 or not name.endswith("/"):  # "name/" of type NUL: a V7 directory
                if buf[pos + 345]:  # ustar prefix (tarfile applies it whatever the magic says)
                    name = nts(buf[pos + 345 : pos + 500]) + "/" + name
                if exts or global_pax:
                    name, size = apply_extensions(name, size, exts, global_pax, url, first)
                need = BLOCK + ((size + 511) & -512)
                if pos + need > blen:
                    buf, base = _refill(
                        stream, buf, pos, base, need, chunk_size, url, f"member {name!r}", first if exts else -1, name
                    )
                    pos, blen = 0, len(buf)
                offset = first if exts else base + pos
                data = buf[pos + BLOCK : pos + BLOCK + size]
                pos += need
                if exts:
                    exts.clear()
                yield name, offset, data
                continue
            has_data = False
        elif typeflag in EXTENSIONS:
            need = BLOCK + ((size + 511) & -512)
            if pos + need > blen:
                buf, base = _refill(
                    stream, buf, pos, base, need, chunk_size, url, "an extension header", first if exts else -1
                )
                pos, blen = 0, len(buf)
            if not exts:
                first = base + pos
            payload = buf[pos + BLOCK : pos + BLOCK + size]
            exts.append((typeflag, extension(typeflag, payload, global_pax, url, base + pos)))
            pos += need
            continue
        elif typeflag == SPARSE:
            end = buf.find(b"\0", pos, pos + 100)
            name = buf[pos : end if end >= 0 else pos + 100].decode("utf-8", "surrogateescape")
            raise sparse_member(url, first if exts else base + pos, name)
        else:
            has_data = typeflag not in NO_DATA
        # A non-regular member: consume its extension headers and skip it (and its data, where
        # tarfile would: unknown types yes, links/devices/directories no).
        if exts or global_pax:
            _, size = apply_extensions("", size, exts, global_pax, url, first)
            exts.clear()
        skip = BLOCK + ((size + 511) & -512) if has_data else BLOCK
        if pos + skip > blen:
            buf, base = _refill(
                stream, buf, pos, base, skip, chunk_size, url, "a non-regular member", first if exts else -1
            )
            pos, blen = 0, len(buf)
        pos += skip


def _refill(
    stream: BinaryIO,
    buf: bytes,
    pos: int,
    base: int,
    need: int,
    chunk_size: int,
    url: str,
    what: str,
    first: int = -1,
    member: str | None = None,
    end_ok: bool = False,
) -> tuple[bytes, int]:
    """``(buf[pos:] + more of the stream, its shard offset)``, at least `need` bytes long, or a
    `TarDamage` if the stream ends (or fails) first: every header and every data block must be there.
    `first` is the offset of the pending extension headers (-1: none), `member` the name of the member
    whose data is wanted (None while a header is). `end_ok`: a stream that ends exactly at ``pos`` (at a
    member boundary), or after only zero bytes there, gives ``(b"", offset)`` instead of an error."""
    parts = [buf[pos:]]
    have = len(parts[0])
    offset = base + pos
    damaged = first if first >= 0 else offset
    while have < need:
        try:
            block = stream.read(max(chunk_size, need - have))
        except ShardError as exc:  # the byte stream failed (network, decompression): same message
            truncated = getattr(exc, "truncated", False)  # e.g. a compressed stream cut short
            raise TarDamage(str(exc), offset=damaged, stop=offset + have, member=member, truncated=truncated) from exc
        if not block:  # b"" is EOF; a short read is not
            if end_ok and not any(b"".join(parts)):  # nothing, or the start of an end block cut short
                return b"", offset
            raise TarDamage(
                f"{url}: shard is truncated at byte {offset + have}: expected {what} ({need} bytes) at "
                f"offset {offset}, and no end-of-archive block",
                offset=damaged,
                stop=offset + have,
                member=member,
                truncated=True,
            )
        parts.append(block)
        have += len(block)
    return b"".join(parts), offset


def _first_block(stream: BinaryIO, chunk_size: int, url: str) -> bytes:
    """The first bytes of a shard (at least one block when there are that many), checked to look
    like a tar: an empty file, or a first block that is neither a header with a valid checksum, nor
    ustar-tagged (a corrupt header), nor zeros (an empty archive), is named for what it is."""
    buf = b""
    try:
        buf = stream.read(chunk_size)
        while buf and len(buf) < BLOCK:
            more = stream.read(chunk_size)
            if not more:
                break
            buf += more
    except ShardError as exc:
        raise TarDamage(str(exc), offset=0, stop=len(buf), truncated=getattr(exc, "truncated", False)) from exc
    if not buf:
        raise TarDamage(f"{url}: empty file (0 bytes), not a tar shard", offset=0, stop=0, truncated=True)
    block = buf[:BLOCK]
    if len(block) == BLOCK and (block == ZERO_BLOCK or block[257:262] == b"ustar" or checksum_ok(block)):
        return buf
    if len(block) < BLOCK and (block[257:262] == b"ustar" or not block.strip(b"\0")):
        return buf  # a header or end block cut short: reported as truncated by the caller
    hint = compression_hint(block)
    raise TarDamage(
        f"{url}: not a tar file (starts with {block[:16]!r}, {len(buf)}{'+' if len(buf) >= chunk_size else ''} "
        f"bytes){hint}",
        offset=0,
    )


# ---------------------------------------------------------------------------------------------
# stage 2: members -> samples


def group_samples(members: Iterable[Member], *, url: str) -> Iterator[dict[str, Any]]:
    """Group consecutive members into samples by webdataset's rules (`tar_file_iterator` +
    `group_by_keys` with `base_plus_ext`).

    A member named ``__x__`` (no slash), or matching ``__…__`` / ``__…__/…`` at the start, is
    skipped; the key is everything up to the first dot of the last path component, the extension
    (lower-cased) everything after it (odd names such as ``dir/.x.y`` go through webdataset's own
    regex); a member whose name has no such dot is skipped; a new sample starts whenever the key
    changes (so a key that comes back later starts a second sample, as in webdataset). A repeated extension within a
    sample is a `SampleError` (an
    extension spelled like one of the four ``__…__`` keys below counts as repeated).

    Each sample holds ``__key__``, ``__url__`` (= `url`), ``__offset__`` (its first member's
    offset), ``__end__`` (where the next sample's first member starts, or the end-of-archive block
    after the last one: re-reading from ``__end__`` yields exactly the samples that follow) and one
    ``bytes`` entry per extension. ``__end__`` of the last sample is exact when `members` is an
    `iter_members` generator (its return value); for other iterables it assumes the last member had
    no extension headers.

    When `members` breaks off with a `TarDamage` (see `iter_members`), the sample being assembled is
    still yielded if it is known to be complete: the damaged member's header was read and belongs to
    another key (its ``__end__`` is then that member's offset). Otherwise (the damage is in one of its
    own members, or in a header, so that more of its members may have followed) it is held back. The
    keys of the samples the damage cut (held back, or the damaged member's own) go into the error's
    ``lost`` before it is re-raised, after the samples before it.
    """
    return _group(members, url, {}, None)


def _group(members: Iterable[Member], url: str, sample: dict[str, Any], key: str | None) -> Iterator[dict[str, Any]]:
    """`group_samples` with a sample already pending (`sample`, empty for none, and its `key`)."""
    it = iter(members)
    split = _BASE_PLUS_EXT.match
    while True:
        try:
            name, offset, data = next(it)
        except StopIteration as stop:
            last_end = stop.value  # iter_members returns the end-of-archive offset
            break
        except TarDamage as damage:
            yield from _after_damage(damage, sample, key, url)
            raise
        if name[:2] == "__" and _is_meta(name):
            continue
        # Fast path for base_plus_ext: with no newline and a dot after the last slash that is not
        # the component's first character, the regex's first match splits at that dot.
        slash = name.rfind("/")
        dot = name.find(".", slash + 1)
        if dot > slash + 1 and "\n" not in name:
            prefix = name[:dot]
            suffix = name[dot + 1 :].lower()
        else:
            match = split(name)
            if match is None:
                continue
            prefix = match.group(1)
            suffix = match.group(2).lower()
        if prefix != key:
            if sample:
                sample["__end__"] = offset
                yield sample
            key = prefix
            sample = {"__key__": prefix, "__url__": url, "__offset__": offset, "__end__": None}
        if suffix in sample:
            raise _duplicate(url, prefix, name, suffix, offset)
        sample[suffix] = data
    if sample:
        if not isinstance(last_end, int):
            last_end = offset + BLOCK + ((len(data) + 511) & -512)
        sample["__end__"] = last_end
        yield sample


def _after_damage(damage: TarDamage, sample: dict[str, Any], key: str | None, url: str) -> Iterator[dict[str, Any]]:
    """The pending sample if the damage proves it complete; records the samples the damage cut."""
    name = damage.member
    cut = None  # the key of the damaged member's sample, when it is a sample's member
    if name is not None and not (name[:2] == "__" and _is_meta(name)):
        match = _BASE_PLUS_EXT.match(name)
        cut = match.group(1) if match is not None else None
    if sample and cut is not None and cut != key:
        sample["__end__"] = damage.offset
        yield sample
        damage.lost = [cut]
    elif sample:
        # Held back: the damage is in one of its members, or where its next member might have been.
        damage.lost = [sample["__key__"]] if cut is None or cut == key else [sample["__key__"], cut]
    elif cut is not None:
        damage.lost = [cut]


def _duplicate(url: str, key: str, name: str, suffix: str, offset: int) -> SampleError:
    # webdataset raises ValueError here too; "__key__"/"__url__" clash there as well, "__offset__" and
    # "__end__" only here.
    what = "reserved" if suffix in _RESERVED else "duplicate"
    return SampleError(f"{url}: {what} extension {suffix!r} in sample {key!r} (member {name!r} at offset {offset})")


def _is_meta(name: str) -> bool:
    """webdataset's `tar_file_iterator` skips these members before grouping."""
    if "/" not in name and name.endswith("__"):
        return True
    return _SKIP_META.match(name) is not None


def read_samples(
    stream: BinaryIO, *, url: str, start_offset: int = 0, chunk_size: int = 1 << 20, native: bool | None = None
) -> Iterator[dict[str, Any]]:
    """`iter_members` then `group_samples`: the samples of one shard stream (see both, and `read_chunks`)."""
    return chain.from_iterable(
        read_chunks(stream, url=url, start_offset=start_offset, chunk_size=chunk_size, native=native)
    )


def read_chunks(
    stream: BinaryIO, *, url: str, start_offset: int = 0, chunk_size: int = 1 << 20, native: bool | None = None
) -> Iterator[list[dict[str, Any]]]:
    """`read_samples` in lists of consecutive samples, for a caller that takes many at once
    (`mixer.stream.source_stream`).
    With the compiled core (`NATIVE`; ``native=False`` or ``mixer.read.tario.NATIVE = False`` turns it off) the
    common members are walked and grouped in C (up to 64 samples a list) and the rest, from the first member
    it declines on, by the code above (one a list): the samples, errors and damage fields are the same."""
    if _tarwalk is not None and (NATIVE if native is None else native):
        return _read_native(stream, url, start_offset, chunk_size)
    return (
        [raw]
        for raw in group_samples(
            iter_members(stream, url=url, start_offset=start_offset, chunk_size=chunk_size), url=url
        )
    )


# ---------------------------------------------------------------------------------------------
# the compiled core (mixer/_native/_tarwalk.c): a pure parser over the bytes read here

_tarwalk = _native.tarwalk  # None without the compiled cores: the pure-Python reader is the reader

NATIVE: bool = _tarwalk is not None
"""Whether `read_samples` uses the compiled core by default (True when it was built)."""


def _read_native(stream: BinaryIO, url: str, start_offset: int, chunk_size: int) -> Iterator[list[dict[str, Any]]]:
    """`read_samples` through ``_tarwalk.scan``, which walks and groups whole members of
    ``buf[pos:end]`` and stops when it needs more bytes (read here, as `_refill` reads them, but
    into one reused buffer where the stream has ``readinto``) or meets anything it leaves to Python
    (every error included): then `_walk` + `_group` go on from that member, with the bytes read so
    far and the sample still pending."""
    buf: bytes | bytearray = _opening(stream, url, start_offset, chunk_size)
    end = len(buf)
    readinto = getattr(stream, "readinto", None)
    scan = _tarwalk.scan
    base, pos = start_offset, 0
    sample: dict[str, Any] | None = None
    key: str | None = None
    out: list[dict[str, Any]] = []
    failure: ShardError | None = None
    eof = False
    while True:
        status, pos, need, sample, key = scan(buf, pos, end, base, url, sample, key, out)
        if out:
            yield out
            out = []
        if status == _tarwalk.END:
            if sample:
                sample["__end__"] = base + pos
                yield [sample]
            return
        if status == _tarwalk.FALLBACK:
            break
        if status == _tarwalk.MORE:  # a batch of samples handed over; the buffer has more
            continue
        have = end - pos
        if readinto is None:
            parts = [buf[pos:end]]
        else:  # keep the unread tail, then read into the same buffer (no allocation, no join)
            if isinstance(buf, bytearray) and len(buf) >= have + chunk_size:
                buf[:have] = buf[pos:end]
            else:
                buf = bytearray(buf[pos:end]) + bytearray(chunk_size)
            view = memoryview(buf)
        base += pos
        pos = 0
        while have < need:
            try:
                if readinto is None:
                    block = stream.read(max(chunk_size, need - have))
                    got = len(block) if block else 0
                    if got:
                        parts.append(block)
                else:
                    # At most chunk_size at a time (a header may claim any size): the buffer grows as bytes arrive.
                    if have == len(buf):  # full: a member larger than the buffer
                        view.release()
                        buf += bytearray(max(chunk_size, have))
                        view = memoryview(buf)
                    got = readinto(view[have : have + chunk_size]) or 0
            except ShardError as exc:
                failure = exc
                break
            if not got:
                eof = True
                break
            have += got
        if readinto is None:
            buf = b"".join(parts)
        else:
            view.release()
        end = have
        if failure is not None or eof:
            break
    rest = _Replay(stream, failure, eof) if failure is not None or eof else stream
    yield from (
        [raw]
        for raw in _group(
            _walk(cast(BinaryIO, rest), bytes(buf[pos:end]), base + pos, url, chunk_size), url, sample or {}, key
        )
    )


class _Replay:
    """The stream as `_walk` takes it over: its first read gives what the compiled path's last read
    gave (end of stream, or the `ShardError`), so the damage is reported where Python finds it."""

    def __init__(self, stream: BinaryIO, failure: ShardError | None, eof: bool) -> None:
        self.stream, self.failure, self.eof = stream, failure, eof

    def read(self, size: int) -> bytes:
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        eof, self.eof = self.eof, False
        return b"" if eof else self.stream.read(size)
