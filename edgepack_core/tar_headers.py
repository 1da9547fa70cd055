"""The tar headers of an artifact, block by block: the bounded ustar/PAX parser and the rule
that every header byte is the one Edgepack's writer puts there (see :mod:`edgepack_core.artifact`,
rules 2 and 2a). Pure: bytes in, a :class:`MemberHeader` or a typed refusal out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgepack_core.errors import (
    ArtifactError,
    LimitExceededError,
    TruncatedArchiveError,
    UnsafeMemberError,
    UnsignedBytesError,
)

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
# A PAX record for one long name, or a GNU long name, fits in far less; nothing larger is
# ever read into memory.
MAX_EXTENDED_HEADER_BYTES = 4096
# tar pads its output to a record (10 KiB by default, 1 MiB at the largest common blocking
# factor); more zeros than that after the end marker is not padding.
MAX_TRAILING_PADDING = 1 << 20

REGULAR_TYPES = (b"0", b"\0")
HARDLINK_TYPE, SYMLINK_TYPE = b"1", b"2"
DEVICE_TYPES = (b"3", b"4", b"6")  # character device, block device, fifo
PAX_TYPE, PAX_GLOBAL_TYPE, GNU_LONGNAME_TYPE, GNU_LONGLINK_TYPE = b"x", b"g", b"L", b"K"
GNU_TYPES = (GNU_LONGNAME_TYPE, GNU_LONGLINK_TYPE)
PAX_HEADER_NAME = "././@PaxHeader"
MEMBER_MODE, PAX_HEADER_MODE = 0o644, 0
NAME_FIELD_BYTES = 100
# The ustar header block, field by field (POSIX.1-1988 offsets).
HEADER_FIELDS = (
    ("name", 0, 100),
    ("mode", 100, 108),
    ("uid", 108, 116),
    ("gid", 116, 124),
    ("size", 124, 136),
    ("mtime", 136, 148),
    ("checksum", 148, 156),
    ("typeflag", 156, 157),
    ("linkname", 157, 257),
    ("magic", 257, 263),
    ("version", 263, 265),
    ("uname", 265, 297),
    ("gname", 297, 329),
    ("devmajor", 329, 337),
    ("devminor", 337, 345),
    ("prefix", 345, 500),
    ("pad", 500, 512),
)
# A regular file's device numbers: empty since Python 3.11.4's tarfile, zero before it. Both are
# "no device"; an artifact written on either host verifies.
_NO_DEVICE = (bytes(8), b"0000000\0")
_MAGICS = (b"ustar\x0000", b"ustar  \x00")  # POSIX ustar, GNU


@dataclass(frozen=True)
class MemberHeader:
    """One tar member as the reader sees it: name, size and type after any PAX/GNU header."""

    name: str
    size: int
    type: bytes
    linkname: str = ""
    raw: bytes = field(default=b"", repr=False, compare=False)
    """The member's own 512-byte header block, for :func:`check_writer_header`."""
    pax_path: bool = field(default=False, compare=False)
    """Whether the name came from a PAX ``path`` record."""


def _octal(field: bytes, what: str) -> int:
    if field[:1] in (b"\x80", b"\xff"):
        raise ArtifactError(f"tar header {what} is a base-256 number (not accepted)")
    text = field.partition(b"\0")[0].strip(b" ")
    if text.strip(b"01234567"):
        raise ArtifactError(f"tar header {what} is not an octal number")
    return int(text, 8) if text else 0


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as err:
        raise UnsafeMemberError(repr(raw)[:80], f"{what} is not UTF-8") from err


def parse_header(block: bytes) -> MemberHeader:
    """Decode one 512-byte ustar (or GNU) header block. Pure; refuses anything else."""
    if len(block) != BLOCK:
        raise TruncatedArchiveError("archive ends inside a tar header")
    magic = block[257:265]
    if magic not in _MAGICS:
        raise ArtifactError("not a ustar tar header")
    checksum = _octal(block[148:156], "checksum")
    if checksum != sum(block[:148]) + 8 * 0x20 + sum(block[156:]):
        raise ArtifactError("tar header checksum mismatch")
    name = block[0:100].partition(b"\0")[0]
    prefix = block[345:500].partition(b"\0")[0] if magic == _MAGICS[0] else b""
    if prefix:
        name = prefix + b"/" + name
    linkname = block[157:257].partition(b"\0")[0]
    return MemberHeader(
        _text(name, "name"), _octal(block[124:136], "size"), block[156:157], _text(linkname, "link name")
    )


def parse_pax_records(data: bytes) -> dict[str, str]:
    """Decode PAX extended header records (``"<len> key=value\\n"``). Pure."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 12)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise ArtifactError("malformed PAX header record")
        end = pos + int(digits)
        if end > len(data) or end <= space + 1 or data[end - 1 : end] != b"\n":
            raise ArtifactError("malformed PAX header record")
        key, sep, value = data[space + 1 : end - 1].partition(b"=")
        if not sep:
            raise ArtifactError("malformed PAX header record")
        records[_text(key, "PAX key")] = _text(value, "PAX value")
        pos = end
    return records


def pax_record(key: str, value: str) -> bytes:
    """One PAX record exactly as ``tarfile`` writes it: the shortest length that counts itself. Pure."""
    body = b" %s=%s\n" % (key.encode(), value.encode())
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def pax_fields(data: bytes) -> dict[str, Any]:
    """The member fields a PAX header sets: only the name, from the one ``path`` record the
    writer puts there, laid out as it lays it out (no other key, no second record). Pure."""
    records = parse_pax_records(data)
    unknown = sorted(set(records) - {"path"})
    if unknown:
        raise UnsignedBytesError(
            PAX_HEADER_NAME, "PAX key", f"PAX key {_show(unknown[0])} (Edgepack writes only 'path')"
        )
    if "path" not in records or data != pax_record("path", records["path"]):
        raise UnsignedBytesError(
            PAX_HEADER_NAME, "PAX records", "PAX records are not the one 'path' record Edgepack writes"
        )
    return {"name": records["path"], "pax_path": True}


def _show(raw: bytes | str) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


def writer_fields(name_field: bytes, size: int, typeflag: bytes, mode: int) -> dict[str, bytes]:
    """Every ustar field of a header as Edgepack's writer fills it, but the checksum (which is
    computed over the others) and the device numbers (see ``_NO_DEVICE``). Pure."""
    zero = b"0000000\0"
    return {
        "name": name_field.ljust(NAME_FIELD_BYTES, b"\0"),
        "mode": b"%07o\0" % mode,
        "uid": zero,
        "gid": zero,
        "size": b"%011o\0" % size,
        "mtime": b"00000000000\0",
        "typeflag": typeflag,
        "linkname": bytes(100),
        "magic": b"ustar\0",
        "version": b"00",
        "uname": bytes(32),
        "gname": bytes(32),
        "devmajor": bytes(8),
        "devminor": bytes(8),
        "prefix": bytes(155),
        "pad": bytes(12),
    }


def check_writer_fields(block: bytes, member: str, expected: dict[str, bytes]) -> None:
    """Refuse a header block whose fields differ from ``expected`` (see :func:`writer_fields`),
    naming the first field that does. Pure."""
    for name, start, end in HEADER_FIELDS:
        actual = block[start:end]
        # The checksum's value is checked by parse_header; here its layout.
        want = b"%06o\0 " % (sum(block[:148]) + 8 * 0x20 + sum(block[156:])) if name == "checksum" else expected[name]
        if actual != want and not (name in ("devmajor", "devminor") and actual in _NO_DEVICE):
            raise UnsignedBytesError(
                member, name, f"tar header field {name} holds {_show(actual)}, Edgepack writes {_show(want)}"
            )


def ustar_name(name: str) -> tuple[bytes, bool]:
    """The ustar name field the writer fills for ``name``, and whether the name needs a PAX
    ``path`` record (``tarfile``: non-ASCII, or over 100 characters). Pure."""
    return name.encode("ascii", "replace")[:NAME_FIELD_BYTES], not name.isascii() or len(name) > NAME_FIELD_BYTES


def check_writer_header(member: MemberHeader) -> None:
    """A regular member's header block must be the one the writer makes for its name and size. Pure."""
    name_field, needs_pax = ustar_name(member.name)
    if member.pax_path != needs_pax:
        problem = (
            "a PAX path record for a name that fits the ustar field"
            if member.pax_path
            else "a name that only fits a PAX path record, without one"
        )
        raise UnsignedBytesError(member.name, "name", f"tar header field name: {problem}")
    check_writer_fields(member.raw, member.name, writer_fields(name_field, member.size, b"0", MEMBER_MODE))


def check_extended_header(header: MemberHeader, seen_kinds: set[bytes]) -> None:
    """Decide whether a PAX/GNU extended header may be read at all. Pure.

    Its size is checked before a byte of it is read: that is the whole point of parsing
    headers here rather than with ``tarfile``.
    """
    if header.size > MAX_EXTENDED_HEADER_BYTES:
        raise LimitExceededError(f"extended tar header ({chr(header.type[0])})", header.size, MAX_EXTENDED_HEADER_BYTES)
    if header.type in seen_kinds:
        raise UnsafeMemberError(header.name, "repeated extended header for one member")


def padding(size: int) -> int:
    """Zero bytes that fill a member of ``size`` bytes to its last block."""
    return -size % BLOCK
