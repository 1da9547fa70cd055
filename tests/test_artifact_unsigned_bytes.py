"""Every byte of an artifact is signed or refused (issue 21, item 10a).

The signature covers manifest.json, and manifest.json covers each member's name, size and
contents. The rest of the archive (tar header fields, the zero padding of each member's last
block, PAX headers, manifest.sig's own layout) is covered by nothing, so the reader requires
exactly what Edgepack's writer puts there. Each attack below edits one such byte in an
otherwise valid, validly signed artifact; the property tests flip any byte at all.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import shutil
import struct
import tarfile
import zlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepack_core.artifact import check_gzip_header, extract_artifact, verify_artifact
from edgepack_core.errors import ArtifactError, SignatureLayoutError, UnsignedBytesError
from edgepack_core.manifest import MANIFEST_NAME, SIGNATURE_NAME
from edgepack_core.signing import (
    SigningKey,
    TrustStore,
    check_signature_layout,
    generate_private_key,
    signature_document,
)
from edgepack_core.tar_headers import BLOCK, check_writer_fields, pax_record, writer_fields
from sdk.artifact_writer import write_artifact

MODEL = b"\x08\x07fake-onnx-model-bytes" * 10  # 210 bytes: 302 bytes of padding follow
LONG = "assets/" + "long-name-" * 5 + "/" + "x" * 60 + ".txt"  # 122 characters: a PAX path record
FILES = {"model/model.onnx": MODEL, LONG: b"ab", "assets/labels.txt": b"a\nb\n"}
MANIFEST = {
    "format": 1,
    "name": "demo",
    "version": "1.0.0",
    "created": "2026-01-01T00:00:00Z",
    "model": {"path": "model/model.onnx", "opset": 17},
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
    "files": {},
}
KEY = SigningKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))  # fixed: the same bytes every run
TRUST = TrustStore([KEY.private.public_key()])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("unsigned")


@pytest.fixture(scope="module")
def plain(folder) -> bytes:
    """The writer's own uncompressed artifact: every byte of it is a tar byte."""
    path = folder / "plain.edgepkg"
    write_artifact(path, MANIFEST, FILES, [KEY], compress=False)
    return path.read_bytes()


@pytest.fixture(scope="module")
def packed(folder) -> bytes:
    path = folder / "packed.edgepkg"
    write_artifact(path, MANIFEST, FILES, [KEY])
    return path.read_bytes()


def _headers(tar: bytes) -> dict[str, int]:
    """Each member's header offset by name ("pax:" + name for the PAX header before it)."""
    offsets: dict[str, int] = {}
    offset, pax = 0, None
    while tar[offset : offset + BLOCK] != bytes(BLOCK):
        size = int(tar[offset + 124 : offset + 135], 8)
        if tar[offset + 156 : offset + 157] == b"x":
            pax = offset
        else:
            name = tar[offset : offset + 100].rstrip(b"\0").decode()
            name = LONG if pax is not None else name
            offsets[name] = offset
            if pax is not None:
                offsets["pax:" + name] = pax
            pax = None
        offset += BLOCK + -(-size // BLOCK) * BLOCK
    return offsets


def _with_checksum(block: bytearray) -> bytearray:
    """Re-seal a header block's checksum the way tarfile writes it, so only the edit differs."""
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return block


def _edit_header(tar: bytes, member: str, start: int, value: bytes) -> bytes:
    offset = _headers(tar)[member]
    block = bytearray(tar[offset : offset + BLOCK])
    block[start : start + len(value)] = value
    return tar[:offset] + bytes(_with_checksum(block)) + tar[offset + BLOCK :]


def _refusal(folder: Path, data: bytes) -> ArtifactError:
    path = folder / "attack.edgepkg"
    path.write_bytes(data)
    with pytest.raises(ArtifactError) as info:
        verify_artifact(path, TRUST)
    dest = folder / "attack-dest"
    with pytest.raises(type(info.value)):
        extract_artifact(path, dest, TRUST)
    assert not dest.exists(), "a refused artifact is never extracted, not even in part"
    return info.value


def _verifies(folder: Path, data: bytes) -> None:
    path = folder / "fine.edgepkg"
    path.write_bytes(data)
    assert verify_artifact(path, TRUST).manifest.name == "demo"


# --------------------------------------------------------------------------- padding bytes


def test_the_writers_own_artifacts_verify_plain_and_compressed(folder, plain, packed):
    _verifies(folder, plain)
    _verifies(folder, packed)
    _verifies(folder, gzip.compress(plain, mtime=0))


@pytest.mark.parametrize("member", [MANIFEST_NAME, SIGNATURE_NAME, "model/model.onnx", LONG, "pax:" + LONG])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_non_zero_byte_in_a_members_block_padding_is_refused(folder, plain, member, where):
    offset = _headers(plain)[member]
    size = int(plain[offset + 124 : offset + 135], 8)
    assert size % BLOCK, "the member must leave padding in its last block"
    end_of_data = offset + BLOCK + size
    position = end_of_data if where == "first" else end_of_data + (-size % BLOCK) - 1
    assert plain[position] == 0
    evil = plain[:position] + b"X" + plain[position + 1 :]
    error = _refusal(folder, evil)
    assert isinstance(error, UnsignedBytesError) and error.field == "padding"
    name = "././@PaxHeader" if member.startswith("pax:") else member
    assert str(error) == f"unsafe member {name!r}: non-zero bytes in the tar block padding after its data"


def test_a_non_zero_byte_in_the_padding_of_a_compressed_artifact_is_refused(folder, plain):
    offset = _headers(plain)["model/model.onnx"]
    position = offset + BLOCK + len(MODEL) + 100
    evil = plain[:position] + b"\x01" + plain[position + 1 :]
    error = _refusal(folder, gzip.compress(evil, mtime=0))
    assert isinstance(error, UnsignedBytesError) and error.field == "padding"


# --------------------------------------------------------------------------- each header field

# (field, offset, a value another tar writer would put there). Each edit keeps the member's
# name, size and type as they were, so before this rule each one verified.
FIELD_EDITS = [
    ("name", 16, b"\0evil"),  # bytes after the name's terminating NUL
    ("mode", 100, b"0000755\0"),
    ("mode", 100, b"000644 \0"),  # the same mode, written as other tars do
    ("uid", 108, b"0001750\0"),
    ("gid", 116, b"0001750\0"),
    ("size", 124, b"        322 "),  # the same size, space-terminated
    ("mtime", 136, b"15133200000\0"),
    ("typeflag", 156, b"\0"),  # the pre-POSIX spelling of a regular file
    ("linkname", 157, b"/etc/passwd"),
    ("magic", 257, b"ustar  \0"),  # GNU tar's magic (and version)
    ("uname", 265, b"root"),
    ("gname", 297, b"root"),
    ("devmajor", 329, b"0000001\0"),
    ("devminor", 337, b"0000001\0"),
    ("devmajor", 329, b"0000000 "),
    ("prefix", 346, b"assets"),  # after the prefix field's first NUL: the name is unchanged
    ("pad", 500, b"\x01"),
]


@pytest.mark.parametrize(("field", "start", "value"), FIELD_EDITS, ids=[f"{f}-{v!r}" for f, _, v in FIELD_EDITS])
@pytest.mark.parametrize("member", [MANIFEST_NAME, SIGNATURE_NAME, "model/model.onnx"])
def test_a_tar_header_field_the_writer_does_not_set_that_way_is_refused(folder, plain, member, field, start, value):
    if field == "size":
        value = b"%11o " % _size(plain, member)
    error = _refusal(folder, _edit_header(plain, member, start, value))
    assert isinstance(error, UnsignedBytesError), error
    assert error.field == field and error.member == member, str(error)
    assert str(error).startswith(f"unsafe member {member!r}: tar header field {field} holds ")


def _size(tar: bytes, member: str) -> int:
    offset = _headers(tar)[member]
    return int(tar[offset + 124 : offset + 135], 8)


def test_the_checksum_written_another_way_is_refused(folder, plain):
    offset = _headers(plain)["model/model.onnx"]
    block = bytearray(plain[offset : offset + BLOCK])
    block[148:156] = b" " * 8
    block[148:156] = b"%07o\0" % sum(block)  # the same value, seven digits: valid tar, not the writer's
    error = _refusal(folder, plain[:offset] + bytes(block) + plain[offset + BLOCK :])
    assert isinstance(error, UnsignedBytesError) and error.field == "checksum"


@pytest.mark.parametrize(
    ("field", "start", "value"),
    [("mode", 100, b"0000644\0"), ("uid", 108, b"0000001\0"), ("uname", 265, b"root"), ("pad", 511, b"\x01")],
)
def test_a_changed_field_in_a_pax_header_block_is_refused(folder, plain, field, start, value):
    error = _refusal(folder, _edit_header(plain, "pax:" + LONG, start, value))
    assert isinstance(error, UnsignedBytesError) and (error.field, error.member) == (field, "././@PaxHeader")


def test_device_numbers_empty_or_zero_both_verify_and_one_more_is_refused(folder, plain):
    """Python 3.11.4's tarfile stopped writing zero device numbers for regular files: an
    artifact from either host verifies; the next value up does not."""
    older = plain
    for member in (MANIFEST_NAME, SIGNATURE_NAME, "model/model.onnx"):
        older = _edit_header(older, member, 329, b"0000000\x000000000\0")
    _verifies(folder, older)
    error = _refusal(folder, _edit_header(plain, "model/model.onnx", 337, b"0000001\0"))
    assert error.field == "devminor"


def test_every_byte_of_a_header_block_is_checked():
    expected = writer_fields(b"a.txt", 3, b"0", 0o644)
    block = bytearray(512)
    for name, (start, end) in {
        "name": (0, 100),
        "mode": (100, 108),
        "uid": (108, 116),
        "gid": (116, 124),
        "size": (124, 136),
        "mtime": (136, 148),
        "typeflag": (156, 157),
        "linkname": (157, 257),
        "magic": (257, 263),
        "version": (263, 265),
        "uname": (265, 297),
        "gname": (297, 329),
        "devmajor": (329, 337),
        "devminor": (337, 345),
        "prefix": (345, 500),
        "pad": (500, 512),
    }.items():
        block[start:end] = expected[name]
        assert len(expected[name]) == end - start, name
    check_writer_fields(bytes(_with_checksum(block)), "a.txt", expected)
    for start in range(512):
        evil = bytearray(block)
        evil[start] ^= 0x40
        if not 148 <= start < 156:
            evil = _with_checksum(evil)
        with pytest.raises(UnsignedBytesError):
            check_writer_fields(bytes(evil), "a.txt", expected)


# --------------------------------------------------------------------------- extended headers


def _repack(folder: Path, infos: dict[str, dict], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """The writer's artifact rebuilt with tarfile, with ``infos[name]`` set on a member's TarInfo."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=out, mode="w", format=fmt) as tar,
        tarfile.open(fileobj=io.BytesIO(_plain(folder))) as source,
    ):
        for member in source.getmembers():
            data = source.extractfile(member).read()
            for attr, value in infos.get(member.name, {}).items():
                setattr(member, attr, value)
            tar.addfile(member, io.BytesIO(data))
    return out.getvalue()


def _plain(folder: Path) -> bytes:
    return (folder / "plain.edgepkg").read_bytes()


def test_a_repacked_artifact_with_the_writers_fields_still_verifies(folder, plain):
    assert _repack(folder, {}) == plain
    _verifies(folder, _repack(folder, {}))


def test_a_gnu_long_name_header_is_refused(folder, plain):
    gnu = _repack(folder, {}, fmt=tarfile.GNU_FORMAT)
    error = _refusal(folder, gnu)
    assert isinstance(error, UnsignedBytesError) and error.field == "magic"  # manifest.json's GNU magic, first
    # The long name's GNU ``L`` header in place of the writer's PAX header, all else the writer's.
    offsets = _headers(plain)
    pax, member = offsets["pax:" + LONG], offsets[LONG]
    info = tarfile.TarInfo(LONG)
    info.size = 2
    long_link = info.tobuf(format=tarfile.GNU_FORMAT)[:-BLOCK]  # the L header and its name blocks
    assert long_link[156:157] == b"L"
    error = _refusal(folder, plain[:pax] + long_link + plain[member:])
    assert isinstance(error, UnsignedBytesError) and error.field == "typeflag"
    assert "GNU long-name header" in str(error)


@pytest.mark.parametrize(
    "key",
    [
        "comment",
        "mtime",
        "uid",
        "uname",
        "linkpath",
        "size",
        "atime",
        "hdrcharset",
        "SCHILY.xattr.security.capability",
        "GNU.sparse.map",
    ],
)
def test_a_pax_key_edgepack_does_not_write_is_refused(folder, key):
    value = str(len(MODEL)) if key == "size" else "0" if key in ("mtime", "uid", "atime") else "x"
    evil = _repack(folder, {"model/model.onnx": {"pax_headers": {key: value}}})
    error = _refusal(folder, evil)
    assert isinstance(error, UnsignedBytesError) and error.field == "PAX key", str(error)
    assert str(error) == f"unsafe member '././@PaxHeader': PAX key {key!r} (Edgepack writes only 'path')"


def test_a_pax_key_beside_the_long_names_path_is_refused(folder):
    evil = _repack(folder, {LONG: {"pax_headers": {"comment": "hidden"}}})
    assert _refusal(folder, evil).field == "PAX key"


def test_a_pax_path_for_a_name_that_fits_the_ustar_field_is_refused(folder):
    evil = _repack(folder, {"model/model.onnx": {"pax_headers": {"path": "model/model.onnx"}}})
    error = _refusal(folder, evil)
    assert error.field == "name" and "a PAX path record for a name that fits the ustar field" in str(error)


def test_a_long_name_in_the_ustar_prefix_instead_of_a_pax_header_is_refused(folder):
    error = _refusal(folder, _repack(folder, {}, fmt=tarfile.USTAR_FORMAT))
    assert error.field == "name" and error.member == LONG, str(error)


def test_a_long_names_truncated_ustar_field_must_be_the_writers(folder, plain):
    error = _refusal(folder, _edit_header(plain, LONG, 99, b"?"))
    assert error.field == "name" and error.member == LONG


def _with_pax_data(tar: bytes, body: bytes) -> bytes:
    """The long name's PAX header holding ``body`` instead of the writer's record."""
    pax = _headers(tar)["pax:" + LONG]
    block = bytearray(tar[pax : pax + BLOCK])
    old_blocks = -(-int(block[124:135], 8) // BLOCK) * BLOCK
    block[124:136] = b"%011o\0" % len(body)
    return tar[:pax] + bytes(_with_checksum(block)) + body + bytes(-len(body) % BLOCK) + tar[pax + BLOCK + old_blocks :]


def test_a_pax_path_record_laid_out_another_way_is_refused(folder, plain):
    canonical = pax_record("path", LONG)
    assert _with_pax_data(plain, canonical) == plain
    length, rest = canonical.split(b" ", 1)
    leading_zero = b"%0*d " % (len(length) + 1, len(canonical) + 1) + rest  # the same record, one byte longer
    for body in (leading_zero, canonical + canonical):
        error = _refusal(folder, _with_pax_data(plain, body))
        assert error.field == "PAX records", str(error)


def test_pax_records_are_the_ones_tarfile_writes():
    for value in ("p", "a" * 90, "a" * 93, "a" * 94, "a" * 95, "é" * 60):
        info = tarfile.TarInfo(value)
        info.pax_headers = {"path": value}
        buf = info.tobuf(format=tarfile.PAX_FORMAT)
        size = int(buf[124:135], 8)
        assert buf[BLOCK : BLOCK + size] == pax_record("path", value), value


# --------------------------------------------------------------------------- manifest.sig layout


def _with_signature(folder: Path, signature: bytes) -> bytes:
    return _repack_member(folder, SIGNATURE_NAME, signature)


def _repack_member(folder: Path, name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar,
        tarfile.open(fileobj=io.BytesIO(_plain(folder))) as source,
    ):
        for member in source.getmembers():
            body = source.extractfile(member).read()
            if member.name == name:
                body, member.size = data, len(data)
            tar.addfile(member, io.BytesIO(body))
    return out.getvalue()


def _signature_variants(manifest: bytes) -> dict[str, bytes]:
    canonical = signature_document(manifest, [KEY])
    doc = json.loads(canonical)
    entry = doc["signatures"][0]
    return {
        "trailing space": canonical + b" ",
        "trailing newline": canonical + b"\n",
        "compact json": json.dumps(doc, sort_keys=True).encode() + b"\n",
        "keys unsorted": json.dumps({"signatures": doc["signatures"], "schema": doc["schema"]}, indent=1).encode()
        + b"\n",
        "an extra top-level key": json.dumps({**doc, "comment": "x" * 100}, sort_keys=True, indent=1).encode() + b"\n",
        "an extra key in the entry": json.dumps(
            {**doc, "signatures": [{**entry, "note": "x"}]}, sort_keys=True, indent=1
        ).encode()
        + b"\n",
        "escaped ascii": canonical.replace(b'"ed25519"', b'"ed\\u00325519"'),
        "a duplicated key": canonical.replace(b' "schema"', b' "schema": "junk",\n "schema"', 1),
    }


@pytest.mark.parametrize(
    "variant",
    [
        "trailing space",
        "trailing newline",
        "compact json",
        "keys unsorted",
        "an extra top-level key",
        "an extra key in the entry",
        "escaped ascii",
        "a duplicated key",
    ],
)
def test_a_manifest_sig_that_verifies_in_another_layout_is_refused(folder, plain, variant):
    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        manifest = tar.extractfile(MANIFEST_NAME).read()
    signature = _signature_variants(manifest)[variant]
    assert TRUST.verify(manifest, signature) == KEY.key_id, "the signature itself still verifies"
    error = _refusal(folder, _with_signature(folder, signature))
    assert isinstance(error, SignatureLayoutError), str(error)
    assert str(error) == "manifest.sig is not laid out as Edgepack writes it (keys, spacing or padding)"


def test_a_manifest_sig_whose_base64_sets_the_unused_padding_bits_is_refused(folder, plain):
    """The last base64 character of a 64-byte signature carries 2 bits and 4 unused ones, and a
    decoder ignores those: the same signature in up to 16 spellings, one of them the writer's."""
    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        manifest = tar.extractfile(MANIFEST_NAME).read()
        canonical = tar.extractfile(SIGNATURE_NAME).read()
    encoded = json.loads(canonical)["signatures"][0]["signature"]
    assert encoded.endswith("==")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(encoded[-3])
    other = encoded[:-3] + alphabet[last ^ 0b0001] + "=="
    assert base64.b64decode(other) == base64.b64decode(encoded)
    signature = canonical.replace(encoded.encode(), other.encode())
    assert TRUST.verify(manifest, signature) == KEY.key_id, "the same signature, spelled another way"
    error = _refusal(folder, _with_signature(folder, signature))
    assert isinstance(error, SignatureLayoutError)
    assert str(error) == "manifest.sig holds a signature in non-canonical base64 (padding bits set)"


def test_the_writers_manifest_sig_layout_is_accepted_with_one_or_two_keys():
    second = generate_private_key()
    for keys in ([KEY], [KEY, second]):
        check_signature_layout(signature_document(b"manifest", keys))
    with pytest.raises(SignatureLayoutError, match="not valid JSON"):
        check_signature_layout(b"\xff")
    entry = json.loads(signature_document(b"manifest", [KEY]))["signatures"][0]
    odd = {"schema": "edgepack.sig/1", "signatures": [{**entry, "algorithm": 7}]}
    with pytest.raises(SignatureLayoutError):
        check_signature_layout(json.dumps(odd, sort_keys=True, indent=1).encode() + b"\n")


# --------------------------------------------------------------------------- any byte at all

PROPERTY = settings(
    max_examples=600, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _flipped(path: Path, artifact: bytes, data: st.DataObject) -> Path:
    """``artifact`` with one byte, at any position, XORed with any non-zero mask."""
    position = data.draw(st.integers(0, len(artifact) - 1), label="position")
    mask = data.draw(st.integers(1, 255), label="mask")
    evil = bytearray(artifact)
    evil[position] ^= mask
    path.write_bytes(bytes(evil))
    return path


@PROPERTY
@given(data=st.data())
def test_any_byte_flipped_in_an_uncompressed_artifact_is_refused(folder, plain, data):
    """In a plain tar every byte is a tar byte, and every tar byte is signed or fixed by the
    writer: no flip of any bit of any byte verifies."""
    path = _flipped(folder / "flipped.tar", plain, data)
    with pytest.raises(ArtifactError):
        verify_artifact(path, TRUST)


@PROPERTY
@given(data=st.data())
def test_any_byte_flipped_in_a_compressed_artifact_is_refused_or_changes_nothing(folder, packed, data):
    """A flip in the gzip framing (its mtime or OS byte) may leave the tar bytes as they were;
    then the verified contents are byte-identical. Never a silently different model."""
    path = _flipped(folder / "flipped.edgepkg", packed, data)
    dest = folder / "flipped-dest"
    try:
        verified = extract_artifact(path, dest, TRUST, durable=False)
    except ArtifactError:
        assert not dest.exists()
        return
    try:
        assert gzip.decompress(path.read_bytes()) == gzip.decompress(packed), "accepted only when the tar is unchanged"
        assert {name: (dest / name).read_bytes() for name in FILES} == FILES
        assert set(verified.manifest.files) == set(FILES)
    finally:
        shutil.rmtree(dest)


# --------------------------------------------------------------------------- the gzip header


def _gzip(tar: bytes, flags: int, fields: bytes) -> bytes:
    """One gzip stream of ``tar`` whose header sets ``flags`` and carries ``fields`` (RFC 1952)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = compressor.compress(tar) + compressor.flush()
    trailer = struct.pack("<II", zlib.crc32(tar), len(tar) & 0xFFFFFFFF)
    return b"\x1f\x8b\x08" + bytes([flags]) + bytes(4) + b"\x02\xff" + fields + body + trailer


@pytest.mark.parametrize(
    ("flag", "fields"),
    [
        (0x04, struct.pack("<H", 12) + b"EP" + struct.pack("<H", 8) + b"payload!"),  # FEXTRA
        (0x10, b"a comment that could carry anything\0"),  # FCOMMENT
        (0x02, b"\0\0"),  # FHCRC
        (0x01, b""),  # FTEXT
        (0x20, b""),  # reserved
    ],
)
def test_a_gzip_header_field_that_can_carry_unsigned_bytes_is_refused(folder, plain, flag, fields):
    error = _refusal(folder, _gzip(plain, flag, fields))
    assert isinstance(error, UnsignedBytesError) and (error.member, error.field) == ("gzip header", "flags")
    assert f"gzip header flags {flag:#04x}: only FNAME is accepted" in str(error)


def test_a_gzip_file_name_is_accepted_up_to_255_bytes(folder, plain):
    _verifies(folder, _gzip(plain, 0x00, b""))
    _verifies(folder, _gzip(plain, 0x08, b"n" * 255 + b"\0"))
    error = _refusal(folder, _gzip(plain, 0x08, b"n" * 256 + b"\0"))
    assert (error.field, str(error)) == ("FNAME", "unsafe member 'gzip header': a gzip file name over 255 bytes")
    with pytest.raises(UnsignedBytesError):
        check_gzip_header(b"\x1f\x8b\x08\x08" + bytes(6) + b"n" * 400)
    check_gzip_header(b"\x1f\x8b\x08\x08" + bytes(6) + b"n" * 255 + b"\0")
