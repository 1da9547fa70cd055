"""Attacks on the artifact reader, each test named after what it blocks."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from edgepack_core.artifact import Limits, extract_artifact, read_extracted, verify_artifact
from edgepack_core.errors import (
    ArtifactError,
    BadSignatureError,
    DowngradeError,
    IntegrityError,
    LimitExceededError,
    ManifestError,
    MissingSignatureError,
    TruncatedArchiveError,
    UnsafeMemberError,
    UntrustedKeyError,
)
from edgepack_core.manifest import canonical_bytes
from edgepack_core.signing import TrustStore, generate_private_key, signature_document
from edgepack_core.versions import Version, check_upgrade
from sdk.artifact_writer import file_entry, write_artifact

MODEL = b"\x08\x07fake-onnx-model-bytes" * 10


def _manifest(version: str = "1.0.0") -> dict:
    return {
        "format": 1,
        "name": "demo",
        "version": version,
        "created": "2026-01-01T00:00:00Z",
        "model": {"path": "model/model.onnx", "opset": 17},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
        "files": {},
    }


@pytest.fixture()
def key():
    return generate_private_key()


@pytest.fixture()
def trust(key):
    return TrustStore([key.private.public_key()])


@pytest.fixture()
def good(tmp_path, key) -> Path:
    path = tmp_path / "good.edgepkg"
    write_artifact(path, _manifest(), {"model/model.onnx": MODEL, "assets/labels.txt": b"a\nb\n"}, [key])
    return path


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    out = []
    with tarfile.open(path, "r:*") as tar:
        for m in tar.getmembers():
            data = tar.extractfile(m).read() if m.isfile() else b""
            out.append((m, data))
    return out


def _rewrite(path: Path, members: list[tuple[tarfile.TarInfo, bytes]], mode: str = "w:gz") -> Path:
    out = path.with_name("evil.edgepkg")
    with tarfile.open(out, mode) as tar:
        for info, data in members:
            info = _copy(info)
            if info.isfile():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return out


def _copy(info: tarfile.TarInfo) -> tarfile.TarInfo:
    new = tarfile.TarInfo(info.name)
    for attr in ("size", "mode", "mtime", "type", "linkname", "uid", "gid"):
        setattr(new, attr, getattr(info, attr))
    return new


def _signed_with(members, key, mutate) -> list[tuple[tarfile.TarInfo, bytes]]:
    """Re-sign a mutated manifest with ``key`` (an attacker who holds a trusted key's
    signature cannot do this; used to craft members the manifest does list)."""
    manifest = json.loads(members[0][1])
    mutate(manifest)
    data = canonical_bytes(manifest)
    sig = signature_document(data, [key])
    return [(members[0][0], data), (members[1][0], sig), *members[2:]]


def test_valid_artifact_verifies_and_extracts(good, trust, tmp_path):
    result = verify_artifact(good, trust)
    assert result.manifest.name == "demo" and result.key_id == trust.key_ids[0]
    dest = tmp_path / "store" / "demo-1.0.0"
    extracted = extract_artifact(good, dest, trust)
    assert (dest / "model/model.onnx").read_bytes() == MODEL
    assert read_extracted(extracted.root, trust).manifest.version == "1.0.0"


def test_tampered_model_byte_is_refused(good, trust, tmp_path):
    members = _members(good)
    idx = next(i for i, (m, _) in enumerate(members) if m.name == "model/model.onnx")
    data = bytearray(members[idx][1])
    data[5] ^= 0x01
    members[idx] = (members[idx][0], bytes(data))
    evil = _rewrite(good, members)
    with pytest.raises(IntegrityError, match="sha256"):
        verify_artifact(evil, trust)
    dest = tmp_path / "x"
    with pytest.raises(IntegrityError):
        extract_artifact(evil, dest, trust)
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x.partial")], "half-extracted leftovers"


def test_changed_manifest_is_refused(good, trust):
    members = _members(good)
    manifest = json.loads(members[0][1])
    manifest["version"] = "9.9.9"
    members[0] = (members[0][0], canonical_bytes(manifest))
    with pytest.raises(BadSignatureError):
        verify_artifact(_rewrite(good, members), trust)


def test_signed_by_untrusted_key_is_refused(good):
    other = TrustStore([generate_private_key().private.public_key()])
    with pytest.raises(UntrustedKeyError):
        verify_artifact(good, other)


def test_key_rotation_accepts_either_trusted_key(tmp_path, key):
    new_key = generate_private_key()
    path = tmp_path / "rotated.edgepkg"
    write_artifact(path, _manifest(), {"model/model.onnx": MODEL}, [key, new_key])
    assert verify_artifact(path, TrustStore([new_key.private.public_key()])).key_id == new_key.key_id
    assert verify_artifact(path, TrustStore([key.private.public_key()])).key_id == key.key_id


def test_missing_signature_is_refused(good, trust):
    members = [m for m in _members(good) if m[0].name != "manifest.sig"]
    with pytest.raises(MissingSignatureError):
        verify_artifact(_rewrite(good, members), trust)


def test_file_not_in_manifest_is_refused(good, trust):
    members = _members(good)
    extra = tarfile.TarInfo("model/backdoor.so")
    members.append((extra, b"\x7fELF"))
    with pytest.raises(UnsafeMemberError, match="not listed"):
        verify_artifact(_rewrite(good, members), trust)


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/passwd", "assets/../../escape.txt", "./assets/x"])
def test_path_traversal_member_is_refused(good, trust, key, tmp_path, name):
    members = _members(good)
    evil_info = tarfile.TarInfo(name)
    members.append((evil_info, b"owned"))
    # Even when the attacker manages to list the name in a manifest, the schema refuses it.
    signed = _signed_with(members, key, lambda m: m["files"].update({name: file_entry(b"owned")}))
    with pytest.raises((UnsafeMemberError, ManifestError)):
        extract_artifact(_rewrite(good, signed), tmp_path / "dest", trust)
    assert not (tmp_path / "escape.txt").exists()
    with pytest.raises(UnsafeMemberError):
        verify_artifact(_rewrite(good, members), trust)


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_symlink_or_hardlink_member_is_refused(good, trust, key, tmp_path, kind):
    members = _members(good)
    link = tarfile.TarInfo("assets/link.txt")
    link.type = kind
    link.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else "model/model.onnx"
    members.append((link, b""))
    signed = _signed_with(members, key, lambda m: m["files"].update({"assets/link.txt": file_entry(b"")}))
    with pytest.raises(UnsafeMemberError, match="link"):
        extract_artifact(_rewrite(good, signed), tmp_path / "dest", trust)
    assert not (tmp_path / "dest").exists()


def test_device_file_member_is_refused(good, trust, key, tmp_path):
    members = _members(good)
    dev = tarfile.TarInfo("assets/dev")
    dev.type = tarfile.CHRTYPE
    members.append((dev, b""))
    signed = _signed_with(members, key, lambda m: m["files"].update({"assets/dev": file_entry(b"")}))
    with pytest.raises(UnsafeMemberError, match="device"):
        verify_artifact(_rewrite(good, signed), trust)


def test_duplicate_member_names_are_refused(good, trust):
    members = _members(good)
    dup = next(m for m in members if m[0].name == "assets/labels.txt")
    members.append((dup[0], b"c\nd\n"))  # the second copy would overwrite the first on extract
    with pytest.raises(UnsafeMemberError, match="duplicate"):
        verify_artifact(_rewrite(good, members), trust)


def test_member_over_size_limit_is_refused(good, trust):
    with pytest.raises(LimitExceededError, match=r"member model/model\.onnx"):
        verify_artifact(good, trust, Limits(max_member_bytes=len(MODEL) - 1))


def test_archive_over_size_limit_is_refused(good, trust):
    with pytest.raises(LimitExceededError, match="archive"):
        verify_artifact(good, trust, Limits(max_archive_bytes=good.stat().st_size - 1))


def test_too_many_members_is_refused(good, trust):
    with pytest.raises(LimitExceededError, match="member count"):
        verify_artifact(good, trust, Limits(max_members=3))


def test_decompression_bomb_total_is_refused(good, trust):
    with pytest.raises(LimitExceededError, match="unpacked"):
        verify_artifact(good, trust, Limits(max_total_bytes=len(MODEL)))


def test_truncated_archive_is_refused(good, trust, tmp_path):
    raw = good.read_bytes()
    for cut in (len(raw) // 2, len(raw) - 20, 40):
        short = tmp_path / f"short-{cut}.edgepkg"
        short.write_bytes(raw[:cut])
        dest = tmp_path / f"dest-{cut}"
        with pytest.raises((TruncatedArchiveError, ArtifactError)):
            extract_artifact(short, dest, trust)
        assert not dest.exists()


def test_uncompressed_truncated_tar_is_refused(good, trust, tmp_path):
    plain = _rewrite(good, _members(good), mode="w")
    with tarfile.open(plain) as tar:
        last = tar.getmembers()[-1]
    raw = plain.read_bytes()
    # Cut inside the last member's data, and just before the end-of-archive marker.
    for cut in (last.offset_data + 10, last.offset_data + tarfile.BLOCKSIZE):
        short = tmp_path / f"short-{cut}.tar"
        short.write_bytes(raw[:cut])
        with pytest.raises(TruncatedArchiveError):
            verify_artifact(short, trust)


def test_missing_listed_file_is_refused(good, trust):
    members = [m for m in _members(good) if m[0].name != "assets/labels.txt"]
    with pytest.raises(IntegrityError, match="missing"):
        verify_artifact(_rewrite(good, members), trust)


def test_manifest_not_first_is_refused(good, trust):
    members = _members(good)
    members = [members[2], *members[:2], *members[3:]]
    with pytest.raises(ArtifactError, match="first member"):
        verify_artifact(_rewrite(good, members), trust)


def test_file_changed_after_install_is_caught(good, trust, tmp_path):
    dest = tmp_path / "installed"
    extract_artifact(good, dest, trust)
    (dest / "assets/labels.txt").write_bytes(b"evil\n")
    with pytest.raises(IntegrityError):
        read_extracted(dest, trust)


@pytest.mark.parametrize(("candidate", "installed"), [("1.0.0", "1.0.0"), ("1.0.0", "1.0.1"),
                                                      ("1.2.0-rc.1", "1.2.0"), ("0.9.10", "1.0.0")])
def test_downgrade_or_same_version_is_refused(candidate, installed):
    with pytest.raises(DowngradeError):
        check_upgrade(candidate, installed)
    check_upgrade(candidate, installed, force=True)  # an explicit force is the only way past


def test_upgrade_is_accepted_and_versions_order_semver():
    check_upgrade("1.10.0", "1.9.0")
    check_upgrade("1.2.0", "1.2.0-rc.2")
    assert Version("1.0.0-alpha") < Version("1.0.0-alpha.1") < Version("1.0.0-beta") < Version("1.0.0")


# --------------------------------------------------------------------------- bounded header parser

from edgepack_core.artifact import check_member_header, check_total  # noqa: E402
from edgepack_core.errors import SignatureError  # noqa: E402
from edgepack_core.manifest import Manifest, parse_manifest  # noqa: E402
from edgepack_core.tar_headers import (  # noqa: E402
    MAX_EXTENDED_HEADER_BYTES,
    MAX_TRAILING_PADDING,
    MemberHeader,
    check_extended_header,
    parse_header,
    parse_pax_records,
    pax_fields,
)


def _manifest_with(files: dict[str, bytes]):
    doc = _manifest()
    doc["files"] = {name: file_entry(data) for name, data in {"model/model.onnx": MODEL, **files}.items()}
    return parse_manifest(canonical_bytes(doc))


def _block(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, fmt: int = tarfile.USTAR_FORMAT,
           linkname: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, linkname
    return info.tobuf(format=fmt)


def test_hardlink_header_is_refused_as_a_link():
    expected = _manifest_with({"assets/a.txt": b""})
    header = MemberHeader("assets/a.txt", 0, b"1", "model/model.onnx")
    with pytest.raises(UnsafeMemberError, match=r"hardlink to 'model/model\.onnx'"):
        check_member_header(header, expected, set(), Limits())


def test_symlink_header_is_refused_as_a_link():
    expected = _manifest_with({"assets/a.txt": b""})
    with pytest.raises(UnsafeMemberError, match="symlink to '/etc/passwd'"):
        check_member_header(MemberHeader("assets/a.txt", 0, b"2", "/etc/passwd"), expected, set(), Limits())


@pytest.mark.parametrize("kind", [b"5", b"7", b"S", b"g"])
def test_directory_contiguous_sparse_or_unknown_member_is_not_a_regular_file(kind):
    expected = _manifest_with({"assets/a.txt": b""})
    with pytest.raises(UnsafeMemberError, match="not a regular file"):
        check_member_header(MemberHeader("assets/a.txt", 0, kind), expected, set(), Limits())


@pytest.mark.parametrize("kind", [b"0", b"\0"])
def test_regular_member_listed_with_its_size_is_accepted(kind):
    expected = _manifest_with({"assets/a.txt": b"abc"})
    check_member_header(MemberHeader("assets/a.txt", 3, kind), expected, set(), Limits(max_member_bytes=3))
    with pytest.raises(LimitExceededError):
        check_member_header(MemberHeader("assets/a.txt", 3, kind), expected, set(), Limits(max_member_bytes=2))


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sig"])
def test_manifest_listing_itself_cannot_smuggle_a_second_copy(good, trust, key, tmp_path, name):
    members = _members(good)
    forged = b'{"format": 1}'
    members.append((tarfile.TarInfo(name), forged))
    signed = _signed_with(members, key, lambda m: m["files"].update({name: file_entry(forged)}))
    with pytest.raises(ManifestError, match=f"{name} cannot list itself"):
        verify_artifact(_rewrite(good, signed), trust)
    with pytest.raises(ManifestError, match="cannot list itself"):
        extract_artifact(_rewrite(good, signed), tmp_path / "dest", trust)
    assert not (tmp_path / "dest").exists()
    # The header rule refuses the second copy on its own too (a manifest built around the schema).
    doc = json.loads(members[0][1])
    doc["files"][name] = file_entry(forged)
    with pytest.raises(UnsafeMemberError, match="duplicate"):
        check_member_header(MemberHeader(name, len(forged), b"0"), Manifest(doc), set(), Limits())


def test_total_bound_is_inclusive_at_the_limit(good, trust):
    check_total(100, Limits(max_total_bytes=100))
    with pytest.raises(LimitExceededError, match="unpacked artifact is 101"):
        check_total(101, Limits(max_total_bytes=100))
    with tarfile.open(good) as tar:
        total = sum(m.size for m in tar.getmembers())
    assert verify_artifact(good, trust, Limits(max_total_bytes=total)).manifest.name == "demo"
    with pytest.raises(LimitExceededError, match="unpacked"):
        verify_artifact(good, trust, Limits(max_total_bytes=total - 1))


def test_signature_with_another_algorithm_label_is_refused(good, trust, key):
    members = _members(good)
    doc = json.loads(members[1][1])
    doc["signatures"][0]["algorithm"] = "rsa-pss-sha256"  # the ed25519 bytes are still valid
    members[1] = (members[1][0], json.dumps(doc).encode())
    with pytest.raises(SignatureError, match="unsupported signature algorithm 'rsa-pss-sha256'"):
        verify_artifact(_rewrite(good, members), trust)


def test_header_with_bad_checksum_is_refused():
    block = bytearray(_block("assets/a.txt", size=3))
    block[0] ^= 0x01
    with pytest.raises(ArtifactError, match="checksum"):
        parse_header(bytes(block))


def test_header_with_base256_size_is_refused():
    block = bytearray(_block("assets/a.txt", size=3))
    block[124:136] = b"\x80" + bytes(10) + b"\x03"
    block[148:156] = b"        "
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    with pytest.raises(ArtifactError, match="base-256"):
        parse_header(bytes(block))


def test_pre_posix_tar_header_is_refused():
    block = bytearray(_block("assets/a.txt", size=3))
    block[257:265] = bytes(8)
    with pytest.raises(ArtifactError, match="not a ustar"):
        parse_header(bytes(block))


def test_ustar_prefix_and_gnu_headers_are_read():
    long_name = "d" * 90 + "/" + "n" * 90
    header = parse_header(_block(long_name, size=7))
    assert (header.name, header.size, header.type) == (long_name, 7, b"0")
    gnu = parse_header(_block("assets/a.txt", size=5, fmt=tarfile.GNU_FORMAT))
    assert (gnu.name, gnu.size) == ("assets/a.txt", 5)


def test_extended_header_size_is_checked_before_reading():
    check_extended_header(MemberHeader("././@PaxHeader", MAX_EXTENDED_HEADER_BYTES, b"x"), set())
    with pytest.raises(LimitExceededError, match="extended tar header"):
        check_extended_header(MemberHeader("././@PaxHeader", MAX_EXTENDED_HEADER_BYTES + 1, b"x"), set())
    with pytest.raises(UnsafeMemberError, match="repeated"):
        check_extended_header(MemberHeader("././@LongLink", 10, b"L"), {b"L"})


def test_pax_path_overrides_the_header_name():
    assert parse_pax_records(b"21 path=assets/b.txt\n11 size=42\n") == {"path": "assets/b.txt", "size": "42"}
    assert pax_fields(b"21 path=assets/b.txt\n") == {"name": "assets/b.txt", "pax_path": True}


@pytest.mark.parametrize("records", [b"99 path=x\n", b"x path=x\n", b"9 pathx\n", b"10 path=x ", b"3 =\n"])
def test_malformed_pax_records_are_refused(records):
    with pytest.raises(ArtifactError, match="PAX"):
        parse_pax_records(records)


def test_long_member_name_in_pax_header_is_accepted(tmp_path, key, trust):
    name = "assets/" + "long-name-" * 12 + ".txt"  # over the 100 bytes of a ustar name field
    path = tmp_path / "long.edgepkg"
    write_artifact(path, _manifest(), {"model/model.onnx": MODEL, name: b"x"}, [key])
    assert name in verify_artifact(path, trust).manifest.files


def test_global_pax_header_is_refused(good, trust, tmp_path):
    members = _members(good)
    out = tmp_path / "global.edgepkg"
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}) as tar:
        for info, data in members:
            tar.addfile(_copy(info), io.BytesIO(data))
    with pytest.raises(UnsafeMemberError, match="global PAX"):
        verify_artifact(out, trust)


def test_zero_padding_after_the_end_marker_is_bounded(good, trust, tmp_path):
    import gzip

    body = gzip.decompress(good.read_bytes()).rstrip(b"\0")
    tar = body + bytes(-len(body) % 512) + bytes(1024)  # members, then the two-block end marker
    ok = tmp_path / "padded.edgepkg"
    ok.write_bytes(gzip.compress(tar + bytes(MAX_TRAILING_PADDING), mtime=0))
    assert verify_artifact(ok, trust).manifest.name == "demo"
    bad = tmp_path / "overpadded.edgepkg"
    bad.write_bytes(gzip.compress(tar + bytes(MAX_TRAILING_PADDING + 512), mtime=0))
    with pytest.raises(LimitExceededError, match="zero padding"):
        verify_artifact(bad, trust)


@pytest.mark.parametrize("mode", ["w:xz", "w:bz2", "w"])
def test_trailing_bytes_after_xz_bz2_or_plain_tar_are_refused(good, trust, tmp_path, mode):
    clean = _rewrite(good, _members(good), mode=mode)
    assert verify_artifact(clean, trust).manifest.name == "demo"
    dirty = tmp_path / "dirty.edgepkg"
    dirty.write_bytes(clean.read_bytes() + b"#!/bin/sh\n")
    with pytest.raises(ArtifactError, match=r"after the (end of the compressed stream|tar end-of-archive)"):
        verify_artifact(dirty, trust)


def test_member_after_a_lone_zero_block_is_refused(good, trust, tmp_path):
    import gzip

    tar = gzip.decompress(good.read_bytes()).rstrip(b"\0")
    tar += bytes(-len(tar) % 512)
    evil = _block("evil.sh", size=0)
    out = tmp_path / "lone.edgepkg"
    out.write_bytes(gzip.compress(tar + bytes(512) + evil + bytes(1024), mtime=0))
    with pytest.raises(ArtifactError, match="after the tar end-of-archive marker"):
        verify_artifact(out, trust)


# --------------------------------------------------------------------------- header rules, exactly
# Each refusal is checked by its whole message and each field by its exact bytes, so that a rule
# that changes (a bound off by one, a field read from the wrong offset) fails a test.

from edgepack_core.tar_headers import _octal, _text  # noqa: E402


def _message(call, *args) -> str:
    with pytest.raises(ArtifactError) as info:
        call(*args)
    return str(info.value)


def _set_checksum(block: bytearray) -> bytes:
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block)


def test_octal_fields_read_digits_up_to_the_first_nul():
    assert _octal(b"0000017\0", "size") == 15
    assert _octal(b" 17 \0", "size") == 15
    assert _octal(b"17\0xy\0", "size") == 15, "bytes after the terminating NUL are ignored"
    assert _octal(b"\0" * 12, "size") == 0
    assert _octal(b"777777777777", "size") == 0o777777777777
    assert _message(_octal, b"\t17\0", "size") == "tar header size is not an octal number"
    assert _message(_octal, b"X17\0", "size") == "tar header size is not an octal number"
    assert _message(_octal, b"1X\0", "size") == "tar header size is not an octal number"
    assert _message(_octal, b"18\0", "mode") == "tar header mode is not an octal number"
    assert _message(_octal, b"\x80" + bytes(11), "size") == "tar header size is a base-256 number (not accepted)"
    assert _message(_octal, b"\xff" * 12, "size") == "tar header size is a base-256 number (not accepted)"


def test_text_fields_must_be_utf8():
    assert _text("é".encode(), "name") == "é"
    assert _message(_text, b"a\xff", "link name") == "unsafe member \"b'a\\\\xff'\": link name is not UTF-8"
    long_raw = b"\xfe" * 100
    assert _message(_text, long_raw, "name") == f"unsafe member {repr(long_raw)[:80]!r}: name is not UTF-8"


def test_header_fields_are_read_from_their_exact_offsets():
    name, link = "n" * 100, "l" * 100  # full-width fields: no terminating NUL
    block = bytearray(_block(name, tarfile.SYMTYPE, linkname=link))
    block[124:136] = b"000000000007"  # twelve digits, no NUL either
    block[136:148] = b"777777777777"
    header = parse_header(_set_checksum(block))
    assert header == MemberHeader(name, 7, b"2", link)


def test_gnu_header_ignores_the_ustar_prefix_area():
    block = bytearray(_block("assets/a.txt", size=3, fmt=tarfile.GNU_FORMAT))
    block[345:500] = b"\xff" * 155  # GNU keeps times and sparse data there; it is not a name prefix
    header = parse_header(_set_checksum(block))  # (a checksum over 0o100000: all seven bytes count)
    assert (header.name, header.size) == ("assets/a.txt", 3)


def test_header_refusals_say_what_is_wrong():
    good_block = _block("assets/a.txt", size=3)
    assert _message(parse_header, good_block[:511]) == "archive ends inside a tar header"
    v7 = bytearray(good_block)
    v7[257:265] = bytes(8)
    assert _message(parse_header, bytes(v7)) == "not a ustar tar header"
    bad_sum = bytearray(good_block)
    bad_sum[0] ^= 1
    assert _message(parse_header, bytes(bad_sum)) == "tar header checksum mismatch"
    garbled = bytearray(good_block)
    garbled[148:156] = b"9\0      "
    assert _message(parse_header, bytes(garbled)) == "tar header checksum is not an octal number"
    size = bytearray(good_block)
    size[124:136] = b"9" * 11 + b"\0"
    assert _message(parse_header, _set_checksum(size)) == "tar header size is not an octal number"
    name = bytearray(good_block)
    name[0:3] = b"\xff\xfe\xfd"
    assert "name is not UTF-8" in _message(parse_header, _set_checksum(name))
    link = bytearray(_block("assets/a.txt", tarfile.SYMTYPE, linkname="ok"))
    link[157:159] = b"\xff\xfe"
    assert _message(parse_header, _set_checksum(link)).endswith(": link name is not UTF-8")


def _record(key: str, value: str, width: int = 0) -> bytes:
    body = f" {key}={value}\n".encode()
    length = len(body) + max(width, 1)
    while len(str(length).zfill(width)) + len(body) != length:
        length += 1
    return str(length).zfill(width).encode() + body


def test_pax_record_length_has_at_most_eleven_digits():
    assert parse_pax_records(_record("path", "a", width=11)) == {"path": "a"}
    assert _message(parse_pax_records, _record("path", "a", width=12)) == "malformed PAX header record"


def test_pax_records_split_on_the_first_space_and_first_equals():
    assert parse_pax_records(_record("linkpath", "x=y z")) == {"linkpath": "x=y z"}
    assert parse_pax_records(_record("comment", "a b c d e f")) == {"comment": "a b c d e f"}
    assert parse_pax_records(b"") == {}


@pytest.mark.parametrize("records", [b"4 a=b\n", b"5 a=b\n", b"7 a=b\n", b"3 \n", b"5 ab\n", b"6 =b\nx", b"6 a=b\nx"])
def test_pax_record_refusals_are_one_message(records):
    assert _message(parse_pax_records, records) == "malformed PAX header record"


def test_pax_key_and_value_must_be_utf8():
    assert _message(parse_pax_records, b"6 \xff=b\n").endswith(": PAX key is not UTF-8")
    assert _message(parse_pax_records, b"6 a=\xff\n").endswith(": PAX value is not UTF-8")


def test_pax_fields_exactly():
    assert pax_fields(_record("path", "p")) == {"name": "p", "pax_path": True}
    assert _message(pax_fields, _record("linkpath", "t") + _record("path", "p")) == (
        "unsafe member '././@PaxHeader': PAX key 'linkpath' (Edgepack writes only 'path')")
    assert _message(pax_fields, _record("mtime", "1.5")) == (
        "unsafe member '././@PaxHeader': PAX key 'mtime' (Edgepack writes only 'path')")
    assert _message(pax_fields, b"") == (
        "unsafe member '././@PaxHeader': PAX records are not the one 'path' record Edgepack writes")
    assert _message(pax_fields, b"\xff\0").endswith("malformed PAX header record")


def test_extended_header_refusals_exactly():
    big = MemberHeader("././@PaxHeader", MAX_EXTENDED_HEADER_BYTES + 1, b"x")
    assert _message(check_extended_header, big, set()) == (
        f"extended tar header (x) is {MAX_EXTENDED_HEADER_BYTES + 1} bytes or more, over the limit of "
        f"{MAX_EXTENDED_HEADER_BYTES}")
    odd = MemberHeader("h", MAX_EXTENDED_HEADER_BYTES + 1, b"\xff")
    assert _message(check_extended_header, odd, set()).startswith("extended tar header (\xff) is ")
    assert _message(check_extended_header, MemberHeader("h", 1, b"L"), {b"L"}) == (
        "unsafe member 'h': repeated extended header for one member")
    check_extended_header(MemberHeader("h", 1, b"L"), {b"x"})


@pytest.mark.parametrize(("name", "kind", "size", "expected"), [
    ("assets/a.txt", b"1", 0,
     "unsafe member 'assets/a.txt': hardlink to 'model/model.onnx' (links are never extracted)"),
    ("assets/a.txt", b"2", 0,
     "unsafe member 'assets/a.txt': symlink to 'model/model.onnx' (links are never extracted)"),
    ("assets/a.txt", b"3", 0, "unsafe member 'assets/a.txt': device or fifo member"),
    ("assets/a.txt", b"4", 0, "unsafe member 'assets/a.txt': device or fifo member"),
    ("assets/a.txt", b"6", 0, "unsafe member 'assets/a.txt': device or fifo member"),
    ("assets/a.txt", b"5", 0, "unsafe member 'assets/a.txt': not a regular file"),
    ("/assets/a.txt", b"0", 3, "unsafe member '/assets/a.txt': absolute path or path traversal"),
    ("assets\\a.txt", b"0", 3, "unsafe member 'assets\\\\a.txt': absolute path or path traversal"),
    ("assets/../a.txt", b"0", 3, "unsafe member 'assets/../a.txt': absolute path or path traversal"),
    ("assets/./a.txt", b"0", 3, "unsafe member 'assets/./a.txt': absolute path or path traversal"),
    ("assets//a.txt", b"0", 3, "unsafe member 'assets//a.txt': absolute path or path traversal"),
    ("model/model.onnx", b"0", 3, "unsafe member 'model/model.onnx': duplicate member name"),
    ("assets/b.txt", b"0", 3, "unsafe member 'assets/b.txt': file not listed in the signed manifest"),
    ("assets/a.txt", b"0", 4, "member assets/a.txt is 4 bytes or more, over the limit of 3"),
    ("assets/a.txt", b"0", 2, "assets/a.txt: size 2 differs from the signed size 3"),
])
def test_member_header_refusals_exactly(name, kind, size, expected):
    manifest = _manifest_with({"assets/a.txt": b"abc"})
    header = MemberHeader(name, size, kind, "model/model.onnx")
    assert _message(check_member_header, header, manifest, {"model/model.onnx"}, Limits(max_member_bytes=3)) \
        == expected


def test_total_refusal_exactly():
    assert _message(check_total, 11, Limits(max_total_bytes=10)) == (
        "unpacked artifact is 11 bytes or more, over the limit of 10")


def test_checksum_of_eight_digits_and_names_ending_the_field_exactly():
    block = bytearray(_block("d" * 155 + "/" + "n" * 20, size=1))  # a 155-byte ustar prefix
    block[500] = ord("z")  # the pad after the prefix field is not part of the name
    block[148:156] = b" " * 8
    block[148:156] = b"%08o" % sum(block)  # eight digits, no NUL: all eight are the checksum
    header = parse_header(bytes(block))
    assert header.name == "d" * 155 + "/" + "n" * 20


def test_link_name_is_read_up_to_its_nul_only():
    header = parse_header(_block("assets/a.txt", tarfile.SYMTYPE, linkname="dir/target file"))
    assert header == MemberHeader("assets/a.txt", 0, b"2", "dir/target file")


def test_pax_length_is_the_text_before_the_first_space():
    assert parse_pax_records(_record("a", "b c d e f g h")) == {"a": "b c d e f g h"}


# --------------------------------------------------------------------------- signature document rules, exactly

import base64  # noqa: E402

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from edgepack_core.signing import MAX_SIGNATURE_BYTES, SigningKey  # noqa: E402

FIXED = SigningKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))


def _verify_message(signature: bytes | None, data: bytes = b"manifest") -> str:
    with pytest.raises(SignatureError) as info:
        TrustStore([FIXED.private.public_key()]).verify(data, signature)
    return str(info.value)


def _doc(*entries) -> bytes:
    return json.dumps({"schema": "edgepack.sig/1", "signatures": list(entries)}).encode()


def test_signature_document_layout_is_fixed():
    text = signature_document(b"manifest", [FIXED]).decode("utf-8")
    lines = text.split("\n")
    assert lines[0] == "{" and lines[1].startswith(' "schema": ') and lines[2] == ' "signatures": ['
    assert lines[4] == '   "algorithm": "ed25519",' and lines[5].startswith('   "key_id": "')
    assert text.endswith("}\n") and not text.endswith("}\n\n")
    with pytest.raises(ValueError, match=r"^at least one signing key is required$"):
        signature_document(b"manifest", [])


def test_signature_refusals_say_what_is_wrong():
    good = json.loads(signature_document(b"manifest", [FIXED]))["signatures"][0]
    with pytest.raises(MissingSignatureError, match=r"^manifest\.sig is missing: the artifact is unsigned$"):
        TrustStore([FIXED.private.public_key()]).verify(b"manifest", None)
    assert _verify_message(b"x" * (MAX_SIGNATURE_BYTES + 1)) == "manifest.sig is too large"
    assert _verify_message(b"\xff").startswith("manifest.sig is not valid JSON: ")
    assert _verify_message(b"[]") == "manifest.sig schema is not edgepack.sig/1"
    assert _verify_message(b'{"schema": "other"}') == "manifest.sig schema is not edgepack.sig/1"
    assert _verify_message(_doc()) == "manifest.sig holds no signatures"
    assert _verify_message(b'{"schema": "edgepack.sig/1", "signatures": {"a": 1}}') == \
        "manifest.sig holds no signatures"
    assert _verify_message(_doc(7)) == "manifest.sig entry is not an object"
    assert _verify_message(_doc({"key_id": good["key_id"]})) == \
        "manifest.sig entry needs key_id and signature strings"
    assert _verify_message(_doc({"signature": good["signature"]})) == \
        "manifest.sig entry needs key_id and signature strings"
    assert _verify_message(_doc({**good, "signature": "!" + good["signature"]})) == \
        f"signature by trusted key {good['key_id']} does not match manifest.json (manifest changed?)"


def test_signature_document_at_the_size_limit_is_read():
    document = signature_document(b"manifest", [FIXED])
    padded = document + b" " * (MAX_SIGNATURE_BYTES - len(document))
    assert len(padded) == MAX_SIGNATURE_BYTES
    assert TrustStore([FIXED.private.public_key()]).verify(b"manifest", padded) == FIXED.key_id
    assert base64.b64decode(json.loads(document)["signatures"][0]["signature"], validate=True)
