"""The fidelity check of lossless builds: every output on its own, floats within rtol/atol by
dtype, everything else exact, the worst element named; and the build applying it alike to
real and synthetic data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from sdk.errors import ValidationFailed
from sdk.packager.fidelity import DEFAULT_TOLERANCES, check_fidelity, tolerance
from sdk.packager.pipeline import build
from sdk.recipe import recipe_from_dict


def _one(name: str, want, got):
    return check_fidelity([{name: np.asarray(want)}], [{name: np.asarray(got)}])


def test_float32_defaults_are_rtol_1e3_and_atol_1e5():
    assert tolerance(np.dtype(np.float32)) == (1e-3, 1e-5) == DEFAULT_TOLERANCES["float32"]
    assert tolerance(np.dtype(np.int64)) is None and tolerance(np.dtype(bool)) is None
    assert tolerance(np.dtype(str)) is None


def test_float32_passes_at_the_tolerance_and_fails_just_past_it():
    want = np.array([0.0, 1000.0], np.float64)
    at_edge = want + np.array([1e-5 * 0.999, (1e-5 + 1e-3 * 1000) * 0.999])
    assert _one("y", want.astype(np.float32), at_edge.astype(np.float32)).ok
    past = want.copy()
    past[1] += (1e-5 + 1e-3 * 1000) * 1.01
    result = _one("y", want.astype(np.float32), past.astype(np.float32))
    assert not result.ok and result.worst.index == (1,) and 1.0 < result.worst.ratio < 1.02
    small = _one("y", np.float32([0.0]), np.float32([2e-5]))  # atol alone judges values near zero
    assert not small.ok and "atol 1e-05" in small.summary()


def test_float16_gets_a_wider_default_than_float32():
    want, got = np.array([1.0]), np.array([1.005])
    assert _one("y", want.astype(np.float16), got.astype(np.float16)).ok
    assert not _one("y", want.astype(np.float32), got.astype(np.float32)).ok


def test_integers_bools_and_strings_must_match_exactly_naming_the_element():
    result = _one("ids", np.array([[1, 2], [3, 4]], np.int64), np.array([[1, 2], [3, 5]], np.int64))
    assert not result.ok and result.worst.index == (1, 1) and "must match exactly" in result.summary()
    assert not _one("mask", np.array([True, False]), np.array([True, True])).ok
    words = _one("w", np.array(["cat", "dog"]), np.array(["cat", "dig"], dtype=object))
    assert not words.ok and words.worst.got == "dig" and words.worst.expected == "dog"
    assert _one("w", np.array(["cat"]), np.array(["cat"], dtype=object)).ok


def test_nan_is_accepted_only_where_nan_was_expected():
    assert _one("y", np.float32([np.nan, np.inf, 1.0]), np.float32([np.nan, np.inf, 1.0])).ok
    assert not _one("y", np.float32([1.0, 2.0]), np.float32([np.nan, 2.0])).ok
    assert not _one("y", np.float32([np.nan]), np.float32([0.0])).ok
    assert not _one("y", np.float32([np.inf]), np.float32([-np.inf])).ok


def test_the_report_names_the_worst_output_sample_and_element():
    reference = [{"a": np.float32([1.0, 2.0]), "b": np.float32([[5.0, 6.0]])},
                 {"a": np.float32([1.0, 2.0]), "b": np.float32([[5.0, 6.0]])}]
    candidate = [{"a": np.float32([1.0, 2.0001]), "b": np.float32([[5.0, 6.0]])},
                 {"a": np.float32([1.0, 2.0]), "b": np.float32([[5.0, 6.5]])}]
    result = check_fidelity(reference, candidate, sample_names=["first.png", "second.png"])
    doc = result.to_json()
    assert not result.ok and doc["worst_output"] == "b"
    assert "output b element [0, 1] of second.png: got 6.5, expected 6.0" in result.summary()
    assert [o["ok"] for o in doc["outputs"]] == [True, False]


def test_a_shape_or_dtype_change_or_a_missing_output_is_a_failure():
    assert "shape [3]" in _one("y", np.zeros(2, np.float32), np.zeros(3, np.float32)).summary()
    assert "dtype" in _one("y", np.zeros(2, np.float32), np.zeros(2, np.int64)).summary()
    missing = check_fidelity([{"y": np.zeros(1)}], [{}])
    assert not missing.ok and "missing" in missing.summary()


def test_an_explicit_tolerance_replaces_the_default():
    want, got = np.float32([1.0]), np.float32([1.01])
    assert not check_fidelity([{"y": want}], [{"y": got}]).ok
    assert check_fidelity([{"y": want}], [{"y": got}], rtol=0.02).ok


def test_empty_outputs_compare_without_crashing():
    assert _one("y", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)).ok


# ---------------------------------------------------------------- in a build


def _model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    n = helper.make_tensor_value_info("n", TensorProto.INT64, ["batch"])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("ArgMax", ["x"], ["n"], axis=1, keepdims=0)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y, n]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("data", ["synthetic", {"npz": "d.npz"}], ids=["synthetic", "real"])
def test_real_data_gets_the_same_per_output_tolerance_check_as_synthetic(tmp_path, keypair, data):
    _model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).standard_normal((8, 1, 4)).astype(np.float32))
    recipe = recipe_from_dict({"name": "f", "version": "1.0.0", "model": {"path": "m.onnx"},
                               "validate": {"data": data}}, tmp_path)
    report = build(recipe, key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg").report["passes"]["validate"]
    assert report["metric"] == "tolerance" and report["budget_met"] is True
    outputs = {o["output"]: o for o in report["fidelity"]["outputs"]}
    assert outputs["y"]["rtol"] == 1e-3 and outputs["y"]["atol"] == 1e-5
    assert outputs["n"]["rtol"] is None, "integer outputs are compared exactly"


def _test_data(folder: Path, x: np.ndarray, y: np.ndarray) -> None:
    from onnx import numpy_helper

    data_set = folder / "t" / "test_data_set_0"
    data_set.mkdir(parents=True)
    (data_set / "input_0.pb").write_bytes(numpy_helper.from_array(x, "x").SerializeToString())
    (data_set / "output_0.pb").write_bytes(numpy_helper.from_array(y, "y").SerializeToString())


@pytest.mark.parametrize(("offset", "passes"), [(5e-6, True), (2e-5, False)])
def test_test_data_expected_outputs_are_held_to_the_same_tolerance(tmp_path, keypair, offset, passes):
    _model(tmp_path / "m.onnx")
    x = np.array([[-1.0, 0.0, 0.5, 2.0]], np.float32)
    _test_data(tmp_path, x, np.maximum(x, 0) + np.float32([offset, 0, 0, 0]))
    recipe = recipe_from_dict({"name": "f", "version": "1.0.0", "model": {"path": "m.onnx"},
                               "validate": {"data": {"test_data": "t"}}}, tmp_path)
    if passes:
        report = build(recipe, key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg").report
        assert report["passes"]["validate"]["expected_outputs"]["ok"] is True
        return
    with pytest.raises(ValidationFailed, match=r"expected outputs: output y element \[0, 0\] of test_data_set_0"):
        build(recipe, key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg")
    assert not (tmp_path / "a.edgepkg").exists()
