"""Admission before install: pure rule boundaries (name binding, versions within a name,
profile, I/O contract)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from device_agent.updates.admission import DevicePolicy, admit, contract_difference, policy_names
from edgepack_core.manifest import Manifest


def raw(name: str = "scale", version: str = "1.0.0", **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": 1, "name": name, "version": version, "created": "2026-01-01T00:00:00Z", "files": {},
        "model": {"path": "model.onnx", "opset": 17},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["N", 4]}],
        "preprocess": {"kind": "tensor"},
    }
    doc.update(changes)
    return doc


def m(name: str = "scale", version: str = "1.0.0", **changes: Any) -> Manifest:
    return Manifest(raw(name, version, **changes))


def command(version: str = "1.1.0", **extra: Any) -> dict[str, Any]:
    return {"type": "deploy", "version": version, **extra}


POLICY = DevicePolicy(profile="x86")


def test_a_newer_same_name_same_contract_model_is_admitted():
    assert admit(m(version="1.1.0"), m(), command(), POLICY) is None


def test_first_install_on_an_empty_device_admits_any_name():
    assert admit(m("othermodel", "9.0.0"), None, command("9.0.0"), POLICY) is None


def test_cross_name_upgrade_othermodel_9_is_refused():
    reason = admit(m("othermodel", "9.0.0"), m("scale", "1.0.0"), command("9.0.0"), POLICY)
    assert reason is not None and "'othermodel' is not allowed" in reason


def test_allowed_names_bind_the_device():
    policy = DevicePolicy(profile="x86", allowed_names=policy_names(["scale", "scale-v2"]))
    assert admit(m("scale-v2", "0.1.0"), m("scale", "3.0.0"), command("0.1.0"), policy) is None
    assert "not allowed" in admit(m("othermodel", "9.0.0"), m(), command("9.0.0"), policy)
    # an explicit list also binds an empty device
    assert "not allowed" in admit(m("othermodel", "9.0.0"), None, command("9.0.0"), policy)
    assert policy_names(None) is None


def test_versions_compare_only_within_a_name():
    policy = DevicePolicy(profile="x86", allowed_names=frozenset({"a", "b"}), known_versions={"b": "2.0.0"})
    assert admit(m("b", "2.0.1"), m("a", "5.0.0"), command("2.0.1"), policy) is None
    reason = admit(m("b", "1.9.9"), m("a", "5.0.0"), command("1.9.9"), policy)
    assert reason is not None and "not newer than b 2.0.0" in reason


@pytest.mark.parametrize("version, admitted", [("1.0.0", False), ("0.9.9", False), ("1.0.1", True),
                                               ("1.0.1-rc.1", True), ("1.0.0-rc.1", False)])
def test_version_boundary(version, admitted):
    assert (admit(m(version=version), m(), command(version), POLICY) is None) is admitted


def test_downgrade_only_with_force_downgrade_true():
    assert admit(m(version="0.9.0"), m(), command("0.9.0", force_downgrade=True), POLICY) is None
    assert admit(m(version="0.9.0"), m(), command("0.9.0", force_downgrade=False), POLICY) is not None
    assert admit(m(version="0.9.0"), m(), command("0.9.0", force_downgrade="yes"), POLICY) is not None


def test_the_artifact_must_be_what_the_command_announced():
    assert "announced" in admit(m(version="1.2.0"), m(), command("1.1.0"), POLICY)
    assert "announced" in admit(m("scale", "1.1.0"), m(), command("1.1.0", name="other"), POLICY)


def test_target_profile():
    targets = {"jetson": {"providers": ["CUDAExecutionProvider"]}}
    reason = admit(m(version="1.1.0", targets=targets), m(), command(), POLICY)
    assert reason == "built for jetson, not for this device's profile x86"
    assert admit(m(version="1.1.0", targets={"x86": {}}), m(), command(), POLICY) is None


def test_contract_change_audio_onto_image_device_is_refused():
    image = m(preprocess={"kind": "image"}, inputs=[{"name": "image", "dtype": "float32",
                                                      "shape": [1, 3, 224, 224]}])
    audio = m(version="1.1.0", preprocess={"kind": "tensor"},
              inputs=[{"name": "waveform", "dtype": "float32", "shape": [1, 16000]}])
    reason = admit(audio, image, command(), POLICY)
    assert reason is not None and "preprocessing kind is tensor, was image" in reason
    assert admit(audio, image, command(allow_contract_change=True), POLICY) is None
    assert admit(audio, image, command(allow_contract_change=1), POLICY) is not None


@pytest.mark.parametrize("changes, expected", [
    ({"inputs": [{"name": "z", "dtype": "float32", "shape": ["N", 4]}]}, "input 'x' is gone"),
    ({"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 4]},
                 {"name": "w", "dtype": "float32", "shape": [1]}]}, "input 'w' is new"),
    ({"inputs": [{"name": "x", "dtype": "float16", "shape": ["N", 4]}]}, "input 'x' dtype is float16, was float32"),
    ({"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 5]}]}, "input 'x' dim 1 is 5, was 4"),
    ({"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 4, 1]}]}, "input 'x' has rank 3, was 2"),
    ({"inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}]}, "input 'x' dim 0 is fixed 1"),
    ({"outputs": [{"name": "y", "dtype": "float32", "shape": ["N", 3]}]}, "output 'y' dim 1 is 3, was 4"),
    ({"outputs": [{"name": "y", "dtype": "float32", "shape": ["N", "K"]}]}, "output 'y' dim 1 is symbolic"),
    ({"outputs": [{"name": "logits", "dtype": "float32", "shape": ["N", 4]}]}, "output 'y' is gone"),
    ({"outputs": [{"name": "y", "dtype": "int64", "shape": ["N", 4]}]}, "output 'y' dtype is int64"),
    ({"postprocess": {"kind": "softmax"}}, "postprocessing kind is softmax, was none"),
])
def test_contract_difference_names_the_first_difference(changes, expected):
    difference = contract_difference(raw(), raw(**changes))
    assert difference is not None and expected in difference


def test_compatible_contract_changes_pass():
    base = raw(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4]}])
    relaxed = raw(inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 4]}])
    assert contract_difference(base, relaxed) is None  # an input accepting more is compatible
    renamed_symbol = raw(outputs=[{"name": "y", "dtype": "float32", "shape": ["batch", 4]}])
    assert contract_difference(raw(), renamed_symbol) is None
    constant = copy.deepcopy(raw())
    constant["inputs"].append({"name": "scale", "dtype": "float32", "shape": [1], "role": "constant"})
    assert contract_difference(raw(), constant) is None  # the agent feeds constants, not clients
    assert contract_difference(raw(), raw()) is None


# ------------------------------------------------------------------ exact reasons and edges


def test_announcement_mismatch_names_both():
    assert admit(m(version="1.2.0"), m(), command("1.1.0"), POLICY) == \
        "artifact is scale 1.2.0, the command announced scale 1.1.0"
    assert admit(m("scale", "1.1.0"), m(), command("1.1.0", name="other"), POLICY) == \
        "artifact is scale 1.1.0, the command announced other 1.1.0"


def test_name_refusal_lists_the_allowed_names():
    policy = DevicePolicy(profile="x86", allowed_names=policy_names(["scale-v2", "scale"]))
    assert admit(m("othermodel", "9.0.0"), m(), command("9.0.0"), policy) == \
        "model name 'othermodel' is not allowed on this device (allowed: scale, scale-v2)"


def test_version_refusal_names_the_newest_known_version():
    assert admit(m(version="1.0.0"), m(), command("1.0.0"), POLICY) == \
        "scale 1.0.0 is not newer than scale 1.0.0 on this device (a signed command with force_downgrade overrides)"


def test_the_newer_of_the_active_and_the_recorded_version_is_the_floor():
    behind = DevicePolicy(profile="x86", known_versions={"scale": "0.5.0"})  # the active model is newer
    reason = admit(m(version="0.9.0"), m(version="1.0.0"), command("0.9.0"), behind)
    assert reason is not None and "not newer than scale 1.0.0 on this device" in reason
    assert admit(m(version="1.0.1"), m(version="1.0.0"), command("1.0.1"), behind) is None
    ahead = DevicePolicy(profile="x86", known_versions={"scale": "2.0.0"})  # a newer one was installed before
    reason = admit(m(version="1.5.0"), m(version="1.0.0"), command("1.5.0"), ahead)
    assert reason is not None and "not newer than scale 2.0.0 on this device" in reason


def test_an_active_version_equal_to_the_recorded_one_keeps_the_recorded_text():
    # build metadata does not order versions: the active 1.0.0+b is not newer than the recorded 1.0.0+a
    policy = DevicePolicy(profile="x86", known_versions={"scale": "1.0.0+a"})
    reason = admit(m(version="1.0.0+c"), m(version="1.0.0+b"), command("1.0.0+c"), policy)
    assert reason is not None and "not newer than scale 1.0.0+a on this device" in reason


def test_profile_refusal_lists_every_target():
    targets = {"x86-avx512": {}, "jetson": {}}
    assert admit(m(version="1.1.0", targets=targets), m(), command(), POLICY) == \
        "built for jetson, x86-avx512, not for this device's profile x86"


def test_contract_refusal_names_the_difference_and_the_override():
    assert admit(m(version="1.1.0", postprocess={"kind": "softmax"}), m(), command(), POLICY) == \
        "I/O contract changes: postprocessing kind is softmax, was none (a signed command with " \
        "allow_contract_change overrides)"


def _only(*keys: str) -> dict[str, Any]:
    """A raw manifest with only these keys (absent lists read as empty)."""
    return {key: value for key, value in raw().items() if key in keys}


@pytest.mark.parametrize("active, new, expected", [
    ({}, {}, None),
    (_only("inputs", "preprocess"), raw(), "output 'y' is new (was: none)"),
    (raw(), _only("inputs", "preprocess"), "output 'y' is gone (now: none)"),
    (_only("outputs", "preprocess"), raw(), "input 'x' is new (was: none)"),
    (raw(), _only("outputs", "preprocess"), "input 'x' is gone (now: none)"),
    (raw(), raw(inputs=[{"name": "z", "dtype": "float32", "shape": [1]}, {"name": "v", "dtype": "float32",
                                                                         "shape": [1]}]),
     "input 'x' is gone (now: z, v)"),
    (raw(inputs=[{"name": "x", "dtype": "float32", "shape": [1]}, {"name": "w", "dtype": "float32", "shape": [1]}]),
     raw(inputs=[{"name": "x", "dtype": "float32", "shape": [1]}, {"name": "w", "dtype": "float32", "shape": [1]},
                 {"name": "v", "dtype": "float32", "shape": [1]}]),
     "input 'v' is new (was: x, w)"),
    (raw(), raw(inputs=[{"name": "x", "dtype": "float32", "shape": ["N", "M"]}]), None),
    (raw(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4]}]),
     raw(inputs=[{"name": "x", "dtype": "float32", "shape": ["N", 4]}]), None),
    (raw(), raw(outputs=[{"name": "y", "dtype": "float32", "shape": [1, 4]}]), "output 'y' dim 0 is fixed 1, was "
                                                                             "symbolic 'N'"),
    (raw(outputs=[{"name": "y", "dtype": "float32", "shape": [1, 4]}]), raw(), "output 'y' dim 0 is symbolic 'N', "
                                                                             "was fixed 1"),
    (raw(), raw(outputs=[{"name": "y", "dtype": "float32", "shape": ["N", 4, 2]}]),
     "output 'y' has rank 3, was 2 (['N', 4, 2] vs ['N', 4])"),
    (raw(postprocess={"kind": "softmax"}), raw(postprocess={"kind": "softmax"}), None),
    (raw(postprocess={"kind": "softmax"}), raw(), "postprocessing kind is none, was softmax"),
    (raw(preprocess={"kind": "image"}), raw(preprocess={"kind": "image"}), None),
    (raw(), raw(preprocess=None), "preprocessing kind is none, was tensor"),
])
def test_contract_difference_exact(active, new, expected):
    assert contract_difference(active, new) == expected


def test_an_unreadable_recorded_version_gives_way_to_the_active_version():
    garbled = DevicePolicy(profile="x86", known_versions={"scale": "not-a-version"})
    assert admit(m(version="1.1.0"), m(version="1.0.0"), command("1.1.0"), garbled) is None
    reason = admit(m(version="0.9.0"), m(version="1.0.0"), command("0.9.0"), garbled)
    assert reason is not None and "not newer than scale 1.0.0 on this device" in reason


def test_an_unreadable_recorded_version_with_no_active_model_is_a_reason_not_a_crash():
    garbled = DevicePolicy(profile="x86", known_versions={"scale": "not-a-version"})
    assert admit(m(version="9.0.0"), None, command("9.0.0"), garbled) == (
        "the version recorded for scale on this device ('not-a-version') is unreadable: refusing to compare")
