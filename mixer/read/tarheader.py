"""One tar header block at a time: the typeflags, checksums, numeric fields, GNU long names and PAX
records, read exactly as Python's `tarfile` reads them, and `TarDamage`, the error every damaged
byte becomes (see :mod:`mixer.read.tario`, which walks the stream with these)."""

from __future__ import annotations

import re
from typing import Any

from mixer.errors import ShardError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
LOW_BYTES = bytes(range(128))

# Typeflags (as ints: indexing bytes gives ints). tarfile.REGULAR_TYPES minus GNU sparse, which we
# refuse rather than expand.
REGULAR = frozenset(b"0\x007")
LONGNAME, LONGLINK = ord("L"), ord("K")
PAX_LOCAL = frozenset(b"xX")  # 'X' is Solaris' spelling of 'x'
PAX_GLOBAL = ord("g")
EXTENSIONS = frozenset(b"xXgLK")  # headers that describe the next member
SPARSE = ord("S")
# Supported non-regular types whose data tarfile does NOT skip (`_proc_builtin`): hard/sym links,
# devices, directories, FIFOs. Any other unknown type is skipped like a regular file's data.
NO_DATA = frozenset(b"123456")
PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")  # tarfile._proc_pax


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


def checksum_ok(block: bytes) -> bool:
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


def extension(typeflag: int, payload: bytes, global_pax: dict[str, str], url: str, offset: int) -> Any:
    """What an extension header contributes to the next member (see `apply_extensions`)."""
    if typeflag == LONGNAME:
        return nts(payload)
    if typeflag == LONGLINK:
        return None
    records = parse_pax(payload, url, offset)
    if typeflag == PAX_GLOBAL:
        global_pax.update(records)  # tarfile: applies to every later member
        return None
    return {**global_pax, **records}  # tarfile: a local header sees the global records under its own


def signed_mismatch(buf: bytes, pos: int, stored: int, unsigned: int) -> bool:
    """False when `stored` is the signed-char checksum some old tars (Sun, NeXT) write."""
    header = buf[pos : pos + 148] + buf[pos + 156 : pos + BLOCK]
    high = len(header.translate(None, LOW_BYTES))  # how many bytes are >= 0x80
    return stored != unsigned - 256 * high


def header_number(buf: bytes, pos: int, field: int, url: str, base: int) -> int:
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
            raise corrupt(url, base + pos, f"invalid number field at byte {field} ({raw!r})") from None
    return n


def nts(raw: bytes) -> str:
    """A NUL-terminated header string, decoded as tarfile does (UTF-8, surrogateescape)."""
    end = raw.find(b"\0")
    return (raw[:end] if end >= 0 else raw).decode("utf-8", "surrogateescape")


def parse_pax(payload: bytes, url: str, offset: int) -> dict[str, str]:
    """PAX records ``"%d %s=%s\\n"``, parsed like `tarfile._proc_pax` (which stops at the first
    record that does not parse)."""
    records: dict[str, str] = {}
    pos = 0
    while True:
        match = PAX_RECORD.match(payload, pos)
        if not match:
            if any(keyword.startswith("GNU.sparse.") for keyword in records):  # GNU tar's PAX sparse formats
                raise sparse_member(url, offset, records.get("GNU.sparse.name", records.get("path", "?")))
            return records
        length = int(match.group(1))
        if length == 0:
            raise corrupt(url, offset, "PAX record of length 0")
        keyword = match.group(2).decode("utf-8", "surrogateescape")
        value = payload[match.end(2) + 1 : match.start(1) + length - 1]
        records[keyword] = value.decode("utf-8", "surrogateescape")
        pos += length


def apply_extensions(
    name: str, size: int, exts: list[tuple[int, Any]], global_pax: dict[str, str], url: str, first: int
) -> tuple[str, int]:
    """The member's name and size after its extension headers, in tarfile's precedence: the global
    PAX path first, then the extension headers from the innermost out (so the first one wins)."""
    if "path" in global_pax:
        name = global_pax["path"].rstrip("/")
    for typeflag, value in reversed(exts):
        if typeflag == LONGNAME:
            name = value
        elif typeflag in PAX_LOCAL:
            if "path" in value:
                name = value["path"].rstrip("/")
            if "size" in value:
                try:
                    size = int(value["size"])
                except ValueError:
                    size = -1
                if size < 0:  # tarfile would read it as 0 and misparse the rest of the shard
                    raise corrupt(url, first, f"invalid PAX size {value['size']!r}")
    return name, size


def sparse_member(url: str, offset: int, name: str) -> TarDamage:
    """A GNU sparse member (``tar --sparse``): its data is a map of holes that mixer does not read."""
    return TarDamage(
        f"{url}: member {name!r} at offset {offset} is a GNU sparse file, which mixer does not read: "
        "write the shard without `tar --sparse` (webdataset's ShardWriter never writes sparse members)",
        offset=offset,
    )


def corrupt(url: str, offset: int, why: str) -> TarDamage:
    return TarDamage(f"{url}: corrupt header at offset {offset}: {why}", offset=offset)
