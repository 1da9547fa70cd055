"""Operator signatures on commands: canonical bytes, verification, scope (target and expiry)."""

from __future__ import annotations

import copy
import json
import math

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepack_core.command_auth import (
    DOMAIN,
    MAX_SIGNED_LIFETIME_S,
    authorize_command,
    canonical_bytes,
    check_scope,
    requires_signature,
    sign_command,
    verify_command,
)
from edgepack_core.errors import CommandSignatureError, EdgepackError
from edgepack_core.signing import SigningKey, TrustStore, key_id

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def operator() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def trust(operator: Ed25519PrivateKey) -> TrustStore:
    return TrustStore([operator.public_key()])


def deploy_command(**extra: object) -> dict:
    return {"schema": "edgepack.cmd/1", "id": "deploy-1", "type": "deploy", "expires_at": NOW + 3600,
            "target": {"device": "pi-07"}, "version": "1.2.0", "size": 10, "sha256": "0" * 64,
            "artifact": {"url": "http://127.0.0.1:1/a.edgepkg"}, **extra}


def test_signed_command_verifies_and_names_the_key(operator, trust):
    signed = sign_command(deploy_command(), operator)
    assert signed["signature"]["keyid"] == key_id(operator.public_key())
    assert verify_command(signed, trust) == key_id(operator.public_key())
    assert "signature" not in deploy_command()  # the input is not changed


def test_signing_key_wrapper_signs_the_same(operator, trust):
    signed = sign_command(deploy_command(), SigningKey(operator))
    assert verify_command(signed, trust)


def test_canonical_bytes_ignore_key_order_and_signature(operator):
    command = deploy_command()
    reordered = dict(reversed(list(command.items())))
    assert canonical_bytes(command) == canonical_bytes(reordered)
    assert canonical_bytes(sign_command(command, operator)) == canonical_bytes(command)
    assert canonical_bytes(command).startswith(DOMAIN)


@pytest.mark.parametrize("field, value", [
    ("id", "deploy-2"), ("expires_at", NOW + 7200), ("target", {"device": "pi-08"}), ("version", "1.2.1"),
    ("force_downgrade", True), ("health_window_s", 0), ("type", "rollback"), ("allow_contract_change", True),
])
def test_any_changed_field_breaks_the_signature(operator, trust, field, value):
    signed = sign_command(deploy_command(), operator)
    signed[field] = value
    with pytest.raises(CommandSignatureError, match="does not match"):
        verify_command(signed, trust)


def test_unsigned_force_downgrade_is_refused(trust):
    with pytest.raises(CommandSignatureError, match="must be signed"):
        verify_command(deploy_command(force_downgrade=True), trust)


def test_signature_by_another_key_is_refused(trust):
    stranger = Ed25519PrivateKey.generate()
    with pytest.raises(CommandSignatureError, match="not an operator key"):
        verify_command(sign_command(deploy_command(), stranger), trust)


def test_manifest_style_signature_of_the_plain_json_does_not_pass(operator, trust):
    """Domain separation: a signature over the JSON without the prefix (as a manifest would be
    signed) is not a command signature."""
    command = deploy_command()
    plain = canonical_bytes(command)[len(DOMAIN):]
    forged = {**command, "signature": {"keyid": key_id(operator.public_key()),
                                        "sig": SigningKey(operator).sign(plain)["signature"]}}
    with pytest.raises(CommandSignatureError, match="does not match"):
        verify_command(forged, trust)


@pytest.mark.parametrize("block", [
    "abc", {"keyid": "0" * 16}, {"keyid": "0" * 16, "sig": "AA==", "alg": "none"}, {"keyid": "xyz", "sig": "AA=="},
    {"keyid": "0" * 16, "sig": ""}, {"keyid": "0" * 16, "sig": "A" * 129}, {"keyid": 5, "sig": "AA=="},
])
def test_malformed_signature_blocks_are_refused(trust, block):
    with pytest.raises(CommandSignatureError):
        verify_command({**deploy_command(), "signature": block}, trust)


def test_garbage_base64_signature_by_a_trusted_key_is_refused(operator, trust):
    block = {"keyid": key_id(operator.public_key()), "sig": "!!!not-base64!!!"}
    with pytest.raises(CommandSignatureError):
        verify_command({**deploy_command(), "signature": block}, trust)


def test_non_finite_values_cannot_be_signed(operator):
    with pytest.raises(CommandSignatureError, match="cannot be signed"):
        sign_command(deploy_command(health_window_s=math.nan), operator)


def test_the_error_is_part_of_the_error_tree():
    assert issubclass(CommandSignatureError, EdgepackError)


@pytest.mark.parametrize("command, needed", [
    ({"type": "ping"}, False), ({"type": "get-state"}, False), ({"type": "deploy"}, True),
    ({"type": "rollback"}, True), ({"type": "cancel"}, True), ({"type": "set-telemetry-interval"}, True),
    ({"type": "something-new"}, True), ({"type": "ping", "force_downgrade": False}, True),
    ({"type": "get-state", "health_window_s": 5}, True), ({"type": "ping", "allow_contract_change": False}, True),
])
def test_which_commands_need_a_signature(command, needed):
    assert requires_signature(command) is needed


# ------------------------------------------------------------------ scope


def test_scope_accepts_this_device_and_its_groups():
    check_scope(deploy_command(), device_id="pi-07", groups=[], now=NOW)
    check_scope(deploy_command(target={"group": "kitchen"}), device_id="pi-07", groups=["kitchen"], now=NOW)


@pytest.mark.parametrize("target, message", [
    ({"device": "pi-08"}, "not for this device"), ({"group": "garage"}, "not for this device"),
    ({"fleet": "all"}, "device or a group"), ({"device": "pi-07", "group": "kitchen"}, "must name its target"),
    (None, "must name its target"), ("pi-07", "must name its target"),
])
def test_scope_refuses_other_targets(target, message):
    command = deploy_command(target=target)
    if target is None:
        del command["target"]
    with pytest.raises(CommandSignatureError, match=message):
        check_scope(command, device_id="pi-07", groups=["kitchen"], now=NOW)


def test_expiry_boundaries():
    check_scope(deploy_command(expires_at=NOW + 0.001), device_id="pi-07", groups=[], now=NOW)
    check_scope(deploy_command(expires_at=NOW + MAX_SIGNED_LIFETIME_S), device_id="pi-07", groups=[], now=NOW)
    with pytest.raises(CommandSignatureError, match="expired"):
        check_scope(deploy_command(expires_at=NOW), device_id="pi-07", groups=[], now=NOW)
    with pytest.raises(CommandSignatureError, match="more than"):
        check_scope(deploy_command(expires_at=NOW + MAX_SIGNED_LIFETIME_S + 1), device_id="pi-07", groups=[],
                    now=NOW)
    for bad in (math.inf, math.nan, True, "soon", None):
        with pytest.raises(CommandSignatureError, match="expires_at"):
            check_scope(deploy_command(expires_at=bad), device_id="pi-07", groups=[], now=NOW)


def test_authorize_lets_read_only_and_unprotected_commands_through(operator, trust):
    assert authorize_command({"type": "ping", "id": "p"}, trust, device_id="pi-07", groups=[], now=NOW) is None
    assert authorize_command(deploy_command(force_downgrade=True), None, device_id="pi-07", groups=[],
                             now=NOW) is None
    signed = sign_command(deploy_command(), operator)
    assert authorize_command(signed, trust, device_id="pi-07", groups=[], now=NOW) == key_id(operator.public_key())
    with pytest.raises(CommandSignatureError, match="not for this device"):
        authorize_command(signed, trust, device_id="pi-99", groups=[], now=NOW)


def test_signed_command_survives_a_json_round_trip(operator, trust):
    signed = sign_command(deploy_command(health_window_s=12.5), operator)
    assert verify_command(json.loads(json.dumps(signed)), trust)
    tampered = copy.deepcopy(signed)
    tampered["artifact"]["url"] = "http://evil.example/a.edgepkg"
    with pytest.raises(CommandSignatureError):
        verify_command(tampered, trust)


# ------------------------------------------------------------------ operator keys on the host


def test_keygen_operator_writes_a_private_0600_pair_that_signs_commands(tmp_path):
    from click.testing import CliRunner

    from sdk.cli import main
    from sdk.keys import load_operator_key

    private, public = tmp_path / "op.key", tmp_path / "op.pub"
    result = CliRunner().invoke(main, ["keygen", "--operator", "--private", str(private), "--public", str(public)])
    assert result.exit_code == 0, result.output
    assert "operator key" in result.output
    assert private.stat().st_mode & 0o777 == 0o600
    key = load_operator_key(private)
    signed = sign_command(deploy_command(), key)
    assert verify_command(signed, TrustStore.from_paths([public])) == key.key_id
    again = CliRunner().invoke(main, ["keygen", "--operator", "--private", str(private), "--public", str(public)])
    assert again.exit_code != 0 and "already exists" in again.output


def test_operator_key_readable_by_others_is_refused(tmp_path):
    from sdk.keys import load_operator_key, write_operator_keypair

    private, public = tmp_path / "op.key", tmp_path / "op.pub"
    write_operator_keypair(private, public)
    private.chmod(0o644)
    from edgepack_core.errors import KeyFileError

    with pytest.raises(KeyFileError, match="chmod 600"):
        load_operator_key(private)
    with pytest.raises(KeyFileError, match="no such key file"):
        load_operator_key(tmp_path / "missing.key")
