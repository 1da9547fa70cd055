"""Ed25519 verification through libsodium (edgepack_core/ed25519.py): what the agent checks
manifests, commands and settings documents with, without ``cryptography`` (issue 25 item 10).
Attacks first: each is refused, as strictly as ``cryptography`` refused it or more."""

from __future__ import annotations

import base64
import json
import random

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepack_core.ed25519 import PublicKey, public_key
from edgepack_core.errors import BadSignatureError, Ed25519KeyError, KeyFileError, SchemaError
from edgepack_core.settings_doc import parse_keys
from edgepack_core.signing import (
    RELEASE,
    SigningKey,
    TrustStore,
    key_id,
    load_public_key,
    public_key_pem,
    signature_document,
)

L = 2**252 + 27742317777372353535851937790883648493
"""The order of Ed25519's prime-order group: a signature's S must be below it (RFC 8032 5.1.7)."""
IDENTITY = b"\x01" + bytes(31)
"""The neutral point (y = 1): order 1. With it as the key, (R = IDENTITY, S = 0) solves the
verification equation for every message."""
SMALL_ORDER_KEYS = {
    "the neutral point": IDENTITY,
    "all zero bytes (a point of order 4)": bytes(32),
    "the point of order 2 (y = -1)": (2**255 - 20).to_bytes(32, "little"),
}
FORGERY = IDENTITY + bytes(32)

# RFC 8032, section 7.1, TEST 1 to TEST 3: (public key, message, signature).
RFC8032 = [
    (
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46b"
        "d25bf5f0595bbe24655141438e7a100b",
    ),
    (
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c"
        "387b2eaeb4302aeeb00d291612bb0c00",
    ),
    (
        "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025",
        "af82",
        "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc659"
        "4a7c15e9716ed28dc027beceea1ec40a",
    ),
]

SEEDED = random.Random(25)
PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes(SEEDED.randrange(256) for _ in range(32)))
PUBLIC = public_key(PRIVATE.public_key())
DATA = b'{"name": "digits", "version": "1.0.0"}\n'


def flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def pem_of(raw: bytes) -> bytes:
    der = bytes.fromhex("302a300506032b6570032100") + raw
    return b"-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(der) + b"\n-----END PUBLIC KEY-----\n"


def test_a_malleable_signature_with_s_plus_the_group_order_is_refused():
    signature = PRIVATE.sign(DATA)
    s = int.from_bytes(signature[32:], "little")
    malleable = signature[:32] + (s + L).to_bytes(32, "little")
    PUBLIC.verify(signature, DATA)
    with pytest.raises(BadSignatureError):
        PUBLIC.verify(malleable, DATA)
    trust = TrustStore([PUBLIC])
    document = signature_document(DATA, [SigningKey(PRIVATE)]).replace(
        base64.b64encode(signature), base64.b64encode(malleable)
    )
    with pytest.raises(BadSignatureError, match="does not match"):
        trust.verify(DATA, document)


@pytest.mark.parametrize("name", sorted(SMALL_ORDER_KEYS))
def test_a_small_order_public_key_is_refused_before_anyone_can_forge_with_it(tmp_path, name):
    raw = SMALL_ORDER_KEYS[name]
    with pytest.raises(Ed25519KeyError, match="small-order"):
        PublicKey.from_public_bytes(raw)
    trusted = tmp_path / "release.pub"
    trusted.write_bytes(pem_of(raw))
    with pytest.raises(KeyFileError, match=f"{trusted}: .*small-order"):
        load_public_key(trusted, kind=RELEASE)  # a trust file: the agent does not start on it
    with pytest.raises(SchemaError, match=r"trust\[0\]: .*small-order"):
        parse_keys("trust", [pem_of(raw).decode()])  # a settings document: refused whole


def test_even_past_the_key_check_libsodium_refuses_the_forgery_of_the_neutral_key():
    """The forgery that ``cryptography`` (OpenSSL) accepted for every message with the neutral
    point as the key; libsodium's own check refuses it too, should a key ever skip ours."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    Ed25519PublicKey.from_public_bytes(IDENTITY).verify(FORGERY, DATA)  # what it was: accepted
    unchecked = object.__new__(PublicKey)
    object.__setattr__(unchecked, "raw", IDENTITY)
    with pytest.raises(BadSignatureError):
        unchecked.verify(FORGERY, DATA)


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_a_key_of_the_wrong_length_is_one_clear_error(length):
    with pytest.raises(Ed25519KeyError, match=f"an Ed25519 public key is 32 bytes, not {length}$"):
        PublicKey.from_public_bytes(PUBLIC.raw[:1] * length)


@pytest.mark.parametrize("length", [0, 1, 63, 65, 128])
def test_a_signature_of_the_wrong_length_is_one_clear_error(length):
    signature = (PRIVATE.sign(DATA) * 2)[:length]
    with pytest.raises(BadSignatureError, match=f"an Ed25519 signature is 64 bytes, not {length}$"):
        PUBLIC.verify(signature, DATA)
    entry = {"key_id": key_id(PUBLIC), "algorithm": "ed25519", "signature": base64.b64encode(signature).decode()}
    document = json.dumps({"schema": "edgepack.sig/1", "signatures": [entry]}).encode()
    with pytest.raises(BadSignatureError, match="does not match"):
        TrustStore([PUBLIC]).verify(DATA, document)


def test_a_flipped_bit_in_the_signature_the_data_or_the_key_is_refused():
    signature = PRIVATE.sign(DATA)
    for bit in range(8 * len(signature)):
        with pytest.raises(BadSignatureError):
            PUBLIC.verify(flipped(signature, bit), DATA)
    for bit in range(8 * len(DATA)):
        with pytest.raises(BadSignatureError):
            PUBLIC.verify(signature, flipped(DATA, bit))
    refused_as_keys = 0
    for bit in range(8 * len(PUBLIC.raw)):
        try:
            other = PublicKey.from_public_bytes(flipped(PUBLIC.raw, bit))
        except Ed25519KeyError:  # not a point of the group at all
            refused_as_keys += 1
            continue
        with pytest.raises(BadSignatureError):
            other.verify(signature, DATA)
    assert 0 < refused_as_keys < 256  # both ways a flipped key can fail were taken


@pytest.mark.parametrize("index", range(len(RFC8032)))
def test_the_rfc_8032_test_vectors_verify(index):
    key, message, signature = (bytes.fromhex(part) for part in RFC8032[index])
    PublicKey.from_public_bytes(key).verify(signature, message)
    with pytest.raises(BadSignatureError):
        PublicKey.from_public_bytes(key).verify(signature, message + b"\x00")


def test_signatures_made_by_cryptography_verify():
    seeded = random.Random(8032)
    for _ in range(25):
        private = Ed25519PrivateKey.from_private_bytes(bytes(seeded.randrange(256) for _ in range(32)))
        data = bytes(seeded.randrange(256) for _ in range(seeded.randrange(0, 4096)))
        public_key(private.public_key()).verify(private.sign(data), data)


def test_a_cryptography_key_and_its_raw_bytes_are_one_key_with_one_id():
    crypto = PRIVATE.public_key()
    ours = public_key(crypto)
    assert ours == PublicKey.from_public_bytes(crypto.public_bytes_raw()) == public_key(ours)
    assert ours.public_bytes_raw() == crypto.public_bytes_raw()
    assert key_id(ours) == key_id(crypto) == SigningKey(PRIVATE).key_id
    assert TrustStore([crypto]).public_keys() == [ours] == TrustStore([ours]).public_keys()
    with pytest.raises(TypeError, match="not an Ed25519 public key: X25519PublicKey"):
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        public_key(X25519PrivateKey.generate().public_key())  # 32 raw bytes too, another curve


def test_a_public_key_pem_is_byte_for_byte_what_cryptography_writes():
    expected = PRIVATE.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert public_key_pem(PUBLIC) == public_key_pem(SigningKey(PRIVATE)) == public_key_pem(PRIVATE.public_key())
    assert public_key_pem(PUBLIC) == expected
    assert public_key_pem(PUBLIC, RELEASE) == b"edgepack-key: release\n" + expected


def test_a_key_added_in_another_pem_spelling_reaches_devices_in_the_form_they_read_without_cryptography(tmp_path):
    """The fleet server keeps (and puts in settings documents) keygen's PEM form of a key added in
    any spelling cryptography reads, so a device never needs cryptography's PEM reader for it."""
    from edgepack_core.signing import _plain_ed25519_pem
    from sdk.fleet_server import settings_db
    from sdk.fleet_server.db import open_database

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        for given, sent in (
            (b"release key, 2026\r\n" + public_key_pem(PUBLIC), public_key_pem(PUBLIC)),
            (public_key_pem(PUBLIC, RELEASE).replace(b"\n", b"\r\n") + b"\r\n", public_key_pem(PUBLIC, RELEASE)),
        ):
            added = settings_db.add_key(database, RELEASE, given.decode(), actor="admin", remote="")
            with database.read() as connection:
                (stored,) = [key.pem for key in settings_db.load_keys(connection) if key.key_id == added.key_id]
            assert added.pem == stored == sent.decode()
            assert _plain_ed25519_pem(stored.encode()) == PUBLIC
            with database.write() as connection:  # the next spelling is a new key again
                connection.execute(settings_db.tables.fleet_keys.delete())
    finally:
        database.dispose()


def _accepted_by_cryptography(raw_key: bytes, signature: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(raw_key).verify(signature, data)
    except InvalidSignature:
        return False
    return True


def _accepted_by_ours(raw_key: bytes, signature: bytes, data: bytes) -> bool:
    try:
        PublicKey.from_public_bytes(raw_key).verify(signature, data)
    except (Ed25519KeyError, BadSignatureError):
        return False
    return True


def test_no_signature_cryptography_refused_is_accepted_now():
    """Differential: every case (bit flips, S + kL, S with its top bits set, the RFC vectors, the
    small-order forgeries) accepted now was accepted by cryptography (OpenSSL); the only cases
    cryptography accepted and libsodium refuses are the forgeries with a small-order key."""
    signature = PRIVATE.sign(DATA)
    s = int.from_bytes(signature[32:], "little")
    cases = [(PUBLIC.raw, signature, DATA)]
    cases += [(PUBLIC.raw, flipped(signature, bit), DATA) for bit in range(512)]
    cases += [(PUBLIC.raw, signature[:32] + (s + k * L).to_bytes(32, "little"), DATA) for k in (1, 2, 3)]
    cases += [(PUBLIC.raw, signature[:63] + bytes([signature[63] | top]), DATA) for top in (0x20, 0x40, 0x80)]
    cases += [(bytes.fromhex(k), bytes.fromhex(sig), bytes.fromhex(m)) for k, m, sig in RFC8032]
    cases += [(raw, FORGERY, b"manifest %d" % i) for raw in SMALL_ORDER_KEYS.values() for i in range(8)]
    only_cryptography = set()
    for raw_key, sig, data in cases:
        ours, theirs = _accepted_by_ours(raw_key, sig, data), _accepted_by_cryptography(raw_key, sig, data)
        assert theirs or not ours, (raw_key.hex(), sig.hex())
        if theirs and not ours:
            only_cryptography.add(raw_key)
    assert only_cryptography <= set(SMALL_ORDER_KEYS.values()) and IDENTITY in only_cryptography
    assert sum(_accepted_by_ours(*case) for case in cases) == 1 + len(RFC8032)
