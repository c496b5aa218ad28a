"""Generator stages that turn a tar byte stream into members and then into WebDataset samples.

Why not `tarfile` (and so `webdataset`): in stream mode `tarfile` ends *silently* when it meets a
corrupt header after the first one, or a shard cut at a member boundary (CPython issue 120740), so a
damaged shard quietly loses its tail; and it costs ~40 µs per small sample. Here every header
checksum is verified, the end-of-archive block is required, and the per-member work is a handful of
slices on one large buffer.

Pipeline: ``iter_members(stream) -> group_samples(members) -> samples``; `read_samples` chains them.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable, Iterator
from typing import Any, BinaryIO
from zlib import adler32

from .errors import ConfigError, SampleError, ShardError

__all__ = ["TarDamage", "group_samples", "iter_members", "read_samples"]

Member = tuple[str, int, bytes]

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_LOW_BYTES = bytes(range(128))

# Typeflags (as ints: indexing bytes gives ints). tarfile.REGULAR_TYPES minus GNU sparse, which we
# refuse rather than expand.
_REGULAR = frozenset(b"0\x007")
_LONGNAME, _LONGLINK = ord("L"), ord("K")
_PAX_LOCAL = frozenset(b"xX")  # 'X' is Solaris' spelling of 'x'
_PAX_GLOBAL = ord("g")
_EXTENSIONS = frozenset(b"xXgLK")  # headers that describe the next member
_SPARSE = ord("S")
# Supported non-regular types whose data tarfile does NOT skip (`_proc_builtin`): hard/sym links,
# devices, directories, FIFOs. Any other unknown type is skipped like a regular file's data.
_NO_DATA = frozenset(b"123456")

# webdataset.tariterators, verbatim, so that key/extension splitting and metadata skipping agree
# exactly (our fast paths below fall back to these whenever they are not provably equivalent).
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")  # tarfile._proc_pax
_RESERVED = frozenset(("__key__", "__url__", "__offset__", "__end__"))


class TarDamage(ShardError):
    """The tar stream breaks off: truncated, a corrupt header, or the byte stream itself failed.

    ``offset``: the shard offset of the first header block that could not be read whole (where the
    damage is). ``member``: that member's name when its header was read before the damage (its data
    was cut), else None. ``stop``: how far the stream was read (its end when truncated; else the
    damage). ``truncated``: the stream simply ended there (nothing of the shard follows),
    as opposed to unreadable bytes with more of the shard after them. ``lost``: filled in by
    `group_samples`: the keys of the samples the damage cut (members of them were read, but not all),
    which are therefore not delivered.
    """

    def __init__(
        self, message: str, *, offset: int, stop: int | None = None, member: str | None = None, truncated: bool = False
    ) -> None:
        super().__init__(message)
        self.offset = offset
        self.stop = offset if stop is None else stop
        self.member = member
        self.truncated = truncated
        self.lost: list[str] = []


# ---------------------------------------------------------------------------------------------
# stage 1: byte stream -> members


def iter_members(
    stream: BinaryIO, *, url: str, start_offset: int = 0, chunk_size: int = 1 << 20
) -> Generator[Member, None, int]:
    """Yield ``(name, offset, data)`` for each regular-file member of a tar stream.

    ``offset`` is the shard byte offset of the member's first header block (its GNU long-name or
    PAX header when it has one), so re-opening the shard there with ``start_offset=offset`` resumes
    at this member. The stream must start at a member boundary; ``start_offset`` only labels it.

    Names follow `tarfile`: ustar prefix, GNU ``L`` long names and PAX ``path`` records (local and
    global) are applied; directories, links, devices and other non-regular members are skipped.
    Every header checksum is verified (unsigned or signed sum). The archive must end with a zero
    block: running out of bytes before it, mid-header or mid-data, is a `ShardError` ("truncated"),
    and no member with incomplete data is ever yielded. A bad checksum is a `ShardError`
    ("corrupt header"). Both are a `TarDamage` saying where. A shard that is empty, or whose first
    block is no tar header, says so ("empty file", "not a tar file (starts with ...)"). The
    generator's return value is the offset of the end-of-archive block (`group_samples` uses it as
    the last sample's ``__end__``).
    """
    if start_offset < 0 or start_offset % _BLOCK:
        raise ConfigError(f"{url}: start_offset must be a non-negative multiple of 512 (got {start_offset})")
    if chunk_size < _BLOCK:
        raise ConfigError(f"{url}: chunk_size must be >= 512 (got {chunk_size})")
    buf = b""
    blen = pos = 0
    base = start_offset  # shard offset of buf[0]
    first = -1  # shard offset of the first extension header of the member being assembled
    exts: list[tuple[int, Any]] = []  # (typeflag, payload) of pending extension headers, in order
    global_pax: dict[str, str] = {}
    if start_offset == 0:  # once per shard: a clear word for files that are no tar at all
        buf = _first_block(stream, chunk_size, url)
        blen = len(buf)
    while True:
        if pos + _BLOCK > blen:
            buf, base = _refill(stream, buf, pos, base, _BLOCK, chunk_size, url, "a tar header or end block", first if exts else -1)
            pos, blen = 0, len(buf)
        typeflag = buf[pos + 156]
        field = buf[pos + 148 : pos + 156]
        try:
            stored = int(field.rstrip(b"\0 "), 8)
        except ValueError:  # not the common "%06o\0 " spelling: parse exactly as tarfile does
            stored = _header_number(buf, pos, 148, url, base)
        # adler32 is the only C-speed byte sum at hand. A 512-byte sum can exceed its modulus but a
        # 256-byte one cannot (256 * 255 < 65521), so adler32's low half is exactly 1 + the byte sum
        # of each half. The checksum field counts as 8 spaces (+256) instead of its own bytes.
        unsigned = (
            (adler32(buf[pos : pos + 256]) & 0xFFFF)
            + (adler32(buf[pos + 256 : pos + 512]) & 0xFFFF)
            - (adler32(field) & 0xFFFF)
            + 255
        )
        if stored != unsigned and _signed_mismatch(buf, pos, stored, unsigned):
            if buf[pos : pos + _BLOCK] == _ZERO_BLOCK:
                if exts:
                    raise _corrupt(url, first, "an extension header is followed by the end-of-archive block")
                return base + pos
            raise _corrupt(url, base + pos, f"bad checksum (stored {stored}, computed {unsigned})")
        try:
            size = int(buf[pos + 124 : pos + 136].rstrip(b"\0 "), 8)
        except ValueError:
            size = _header_number(buf, pos, 124, url, base)
        if size < 0:  # int() takes a sign; tarfile would too, and then misread the shard
            raise _corrupt(url, base + pos, f"negative size {size}")

        if typeflag in _REGULAR:
            end = buf.find(b"\0", pos, pos + 100)
            name = buf[pos : end if end >= 0 else pos + 100].decode("utf-8", "surrogateescape")
            if typeflag != 0 or not name.endswith("/"):  # "name/" of type NUL: a V7 directory
                if buf[pos + 345]:  # ustar prefix (tarfile applies it whatever the magic says)
                    name = _nts(buf[pos + 345 : pos + 500]) + "/" + name
                if exts or global_pax:
                    name, size = _apply_extensions(name, size, exts, global_pax, url, first)
                need = _BLOCK + ((size + 511) & -512)
                if pos + need > blen:
                    buf, base = _refill(stream, buf, pos, base, need, chunk_size, url, f"member {name!r}", first if exts else -1, name)
                    pos, blen = 0, len(buf)
                offset = first if exts else base + pos
                data = buf[pos + _BLOCK : pos + _BLOCK + size]
                pos += need
                if exts:
                    exts.clear()
                yield name, offset, data
                continue
            has_data = False
        elif typeflag in _EXTENSIONS:
            need = _BLOCK + ((size + 511) & -512)
            if pos + need > blen:
                buf, base = _refill(stream, buf, pos, base, need, chunk_size, url, "an extension header", first if exts else -1)
                pos, blen = 0, len(buf)
            if not exts:
                first = base + pos
            payload = buf[pos + _BLOCK : pos + _BLOCK + size]
            exts.append((typeflag, _extension(typeflag, payload, global_pax, url, base + pos)))
            pos += need
            continue
        elif typeflag == _SPARSE:
            raise TarDamage(f"{url}: unsupported GNU sparse member at offset {base + pos}", offset=base + pos)
        else:
            has_data = typeflag not in _NO_DATA
        # A non-regular member: consume its extension headers and skip it (and its data, where
        # tarfile would: unknown types yes, links/devices/directories no).
        if exts or global_pax:
            _, size = _apply_extensions("", size, exts, global_pax, url, first)
            exts.clear()
        skip = _BLOCK + ((size + 511) & -512) if has_data else _BLOCK
        if pos + skip > blen:
            buf, base = _refill(stream, buf, pos, base, skip, chunk_size, url, "a non-regular member", first if exts else -1)
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
) -> tuple[bytes, int]:
    """``(buf[pos:] + more of the stream, its shard offset)``, at least `need` bytes long, or a
    `TarDamage` if the stream ends (or fails) first: every header and every data block must be there.
    `first` is the offset of the pending extension headers (-1: none), `member` the name of the member
    whose data is wanted (None while a header is)."""
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
        while buf and len(buf) < _BLOCK:
            more = stream.read(chunk_size)
            if not more:
                break
            buf += more
    except ShardError as exc:
        raise TarDamage(str(exc), offset=0, stop=len(buf), truncated=getattr(exc, "truncated", False)) from exc
    if not buf:
        raise TarDamage(f"{url}: empty file (0 bytes), not a tar shard", offset=0, stop=0, truncated=True)
    block = buf[:_BLOCK]
    if len(block) == _BLOCK and (block == _ZERO_BLOCK or block[257:262] == b"ustar" or _checksum_ok(block)):
        return buf
    if len(block) < _BLOCK and (block[257:262] == b"ustar" or not block.strip(b"\0")):
        return buf  # a header or end block cut short: reported as truncated by the caller
    hint = ""
    if block[:2] == b"\x1f\x8b":
        hint = "; gzip-compressed data: name the shard .tar.gz or .tgz"
    elif block[:6] == b"\xfd7zXZ\x00":
        hint = "; xz-compressed data: name the shard .tar.xz"
    elif block[:4] == b"\x28\xb5\x2f\xfd":
        hint = "; zstd-compressed data, which is not supported"
    raise TarDamage(f"{url}: not a tar file (starts with {block[:16]!r}, {len(buf)}{'+' if len(buf) >= chunk_size else ''} bytes){hint}", offset=0)


def _checksum_ok(block: bytes) -> bool:
    """Whether a 512-byte block's checksum field holds its unsigned or signed sum (as tarfile checks)."""
    field = block[148:156]
    end = field.find(b"\0")
    text = (field[:end] if end >= 0 else field).strip()
    try:
        stored = int(text, 8)
    except ValueError:
        return False
    rest = block[:148] + block[156:]
    unsigned = 256 + sum(rest)
    signed = 256 + sum(b - 256 if b > 127 else b for b in rest)
    return stored in (unsigned, signed)


def _extension(typeflag: int, payload: bytes, global_pax: dict[str, str], url: str, offset: int) -> Any:
    """What an extension header contributes to the next member (see `_apply_extensions`)."""
    if typeflag == _LONGNAME:
        return _nts(payload)
    if typeflag == _LONGLINK:
        return None
    records = _parse_pax(payload, url, offset)
    if typeflag == _PAX_GLOBAL:
        global_pax.update(records)  # tarfile: applies to every later member
        return None
    return {**global_pax, **records}  # tarfile: a local header sees the global records under its own


def _signed_mismatch(buf: bytes, pos: int, stored: int, unsigned: int) -> bool:
    """False when `stored` is the signed-char checksum some old tars (Sun, NeXT) write."""
    header = buf[pos : pos + 148] + buf[pos + 156 : pos + _BLOCK]
    high = len(header.translate(None, _LOW_BYTES))  # how many bytes are >= 0x80
    return stored != unsigned - 256 * high


def _header_number(buf: bytes, pos: int, field: int, url: str, base: int) -> int:
    """A 12- or 8-byte numeric header field, exactly as `tarfile.nti` reads it (octal or base-256)."""
    width = 8 if field == 148 else 12
    raw = buf[pos + field : pos + field + width]
    if raw[0] in (0o200, 0o377):  # GNU base-256, big-endian, 0o377 = negative
        n = int.from_bytes(raw[1:], "big")
        if raw[0] == 0o377:
            n -= 256 ** (width - 1)
    else:
        end = raw.find(b"\0")
        text = (raw[:end] if end >= 0 else raw).strip()
        try:
            text.decode("ascii")
            n = int(text, 8) if text else 0
        except ValueError:
            raise _corrupt(url, base + pos, f"invalid number field at byte {field} ({raw!r})") from None
    return n


def _nts(raw: bytes) -> str:
    """A NUL-terminated header string, decoded as tarfile does (UTF-8, surrogateescape)."""
    end = raw.find(b"\0")
    return (raw[:end] if end >= 0 else raw).decode("utf-8", "surrogateescape")


def _parse_pax(payload: bytes, url: str, offset: int) -> dict[str, str]:
    """PAX records ``"%d %s=%s\\n"``, parsed like `tarfile._proc_pax` (which stops at the first
    record that does not parse)."""
    records: dict[str, str] = {}
    pos = 0
    while True:
        match = _PAX_RECORD.match(payload, pos)
        if not match:
            return records
        length = int(match.group(1))
        if length == 0:
            raise _corrupt(url, offset, "PAX record of length 0")
        keyword = match.group(2).decode("utf-8", "surrogateescape")
        value = payload[match.end(2) + 1 : match.start(1) + length - 1]
        if keyword.startswith("GNU.sparse."):
            raise TarDamage(f"{url}: unsupported GNU sparse member (PAX header at offset {offset})", offset=offset)
        records[keyword] = value.decode("utf-8", "surrogateescape")
        pos += length


def _apply_extensions(
    name: str, size: int, exts: list[tuple[int, Any]], global_pax: dict[str, str], url: str, first: int
) -> tuple[str, int]:
    """The member's name and size after its extension headers, in tarfile's precedence: the global
    PAX path first, then the extension headers from the innermost out (so the first one wins)."""
    if "path" in global_pax:
        name = global_pax["path"].rstrip("/")
    for typeflag, value in reversed(exts):
        if typeflag == _LONGNAME:
            name = value
        elif typeflag in _PAX_LOCAL:
            if "path" in value:
                name = value["path"].rstrip("/")
            if "size" in value:
                try:
                    size = int(value["size"])
                except ValueError:
                    size = -1
                if size < 0:  # tarfile would read it as 0 and misparse the rest of the shard
                    raise _corrupt(url, first, f"invalid PAX size {value['size']!r}")
    return name, size


def _corrupt(url: str, offset: int, why: str) -> TarDamage:
    return TarDamage(f"{url}: corrupt header at offset {offset}: {why}", offset=offset)


# ---------------------------------------------------------------------------------------------
# stage 2: members -> samples


def group_samples(members: Iterable[Member], *, url: str) -> Iterator[dict[str, Any]]:
    """Group consecutive members into samples by webdataset's rules (`tar_file_iterator` +
    `group_by_keys` with `base_plus_ext`).

    A member named ``__x__`` (no slash), or matching ``__…__`` / ``__…__/…`` at the start, is
    skipped; the key is everything up to the first dot of the last path component, the extension
    (lower-cased) everything after it (odd names such as ``dir/.x.y`` go through webdataset's own
    regex); a member whose name has no such dot is skipped; a new sample starts whenever the key
    changes (so a key that comes back later starts a second sample, as in webdataset). A repeated extension within a sample is a `SampleError` (an
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
    it = iter(members)
    sample: dict[str, Any] = {}  # empty until the first member
    key = None
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
            last_end = offset + _BLOCK + ((len(data) + 511) & -512)
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


def read_samples(stream: BinaryIO, *, url: str, start_offset: int = 0, chunk_size: int = 1 << 20) -> Iterator[dict[str, Any]]:
    """`iter_members` then `group_samples`: the samples of one shard stream (see both)."""
    return group_samples(iter_members(stream, url=url, start_offset=start_offset, chunk_size=chunk_size), url=url)
