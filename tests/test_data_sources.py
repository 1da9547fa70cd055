"""Data that can say anything: npz layouts, ONNX test data sets, constants, consent to
synthetic data, and golden samples that round-trip every dtype exactly to the agent."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.preprocess_spec import PreprocessSpec
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import BuildError, RecipeError, ValidationFailed
from sdk.packager.data import split_samples
from sdk.packager.onnx_graph import index_ranges
from sdk.packager.pipeline import build
from sdk.packager.sources import InputOptions
from sdk.packager.synthetic import synthetic_samples
from sdk.recipe import recipe_from_dict

# ---------------------------------------------------------------- models


def _save(path: Path, nodes, inputs, outputs, inits=(), opset: int = 17) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _all_kinds_model(path: Path) -> Path:
    """Identity on a scalar, strings, bools, int64 [3, 2] (first dim not 1) and float16."""
    specs = [("s", TensorProto.FLOAT, []), ("t", TensorProto.STRING, [2]), ("b", TensorProto.BOOL, [3]),
             ("i", TensorProto.INT64, [3, 2]), ("h", TensorProto.FLOAT16, [2])]
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in specs]
    outputs = [helper.make_tensor_value_info(f"{n}_out", t, s) for n, t, s in specs]
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n, _, _ in specs]
    return _save(path, nodes, inputs, outputs)


ALL_KINDS = {
    "s": np.array(2.5, np.float32),
    "t": np.array(["héllo", "wörld"]),
    "b": np.array([True, False, True]),
    "i": np.array([[1, -2], [3, 2**40], [5, 6]], np.int64),
    "h": np.array([0.1, 65000], np.float16),
}


def _golden(artifact: Path) -> tuple[dict, dict]:
    with tarfile.open(artifact) as tar:
        def load(name: str) -> dict:
            with np.load(io.BytesIO(tar.extractfile(name).read()), allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        return load("golden/000.inputs.npz"), load("golden/000.outputs.npz")


def _build(folder: Path, document: dict, keypair, name: str = "a.edgepkg"):
    base = {"name": "data", "version": "1.0.0", "targets": ["x86"], **document}
    return build(recipe_from_dict(base, folder), key_paths=[str(keypair[0])], output=folder / name)


def _agent_loads(artifact: Path, keypair, tmp: Path):
    extracted = extract_artifact(artifact, tmp / "x", TrustStore([load_public_key(keypair[1])]))
    return load_model(tmp / "x", extracted.manifest)  # runs the golden smoke test


# ---------------------------------------------------------------- the npz layout (pure)


def test_npz_array_of_the_input_rank_is_one_sample_and_one_more_axis_a_stack():
    one = np.zeros((3, 2))
    assert [a.shape for a in split_samples(one, 2, "auto", input_name="x")] == [(3, 2)]
    stack = np.arange(12).reshape(2, 3, 2)
    samples = split_samples(stack, 2, "auto", input_name="x")
    assert len(samples) == 2 and np.array_equal(samples[1], stack[1])
    assert [a.shape for a in split_samples(np.float32(1.5), 0, "auto", input_name="s")] == [()]
    assert len(split_samples(np.arange(5.0), 0, "auto", input_name="s")) == 5  # five scalars
    with pytest.raises(ValueError, match="rank 4"):
        split_samples(np.zeros((1, 1, 3, 2)), 2, "auto", input_name="x")


def test_npz_sample_axis_splits_a_batch_axis_or_takes_the_whole_array():
    batch = np.arange(8.0).reshape(4, 2)  # input [batch, 2], four rows
    rows = split_samples(batch, 2, 0, input_name="x")
    assert [r.shape for r in rows] == [(1, 2)] * 4 and np.array_equal(rows[3], [[6.0, 7.0]])
    columns = split_samples(np.zeros((3, 5, 2)), 2, 1, input_name="x")  # samples along axis 1 of a stack
    assert len(columns) == 5 and columns[0].shape == (3, 2)
    assert [a.shape for a in split_samples(np.zeros((2, 3, 4)), 0, None, input_name="x")] == [(2, 3, 4)]
    with pytest.raises(ValueError, match="not an axis"):
        split_samples(batch, 2, 2, input_name="x")


# ---------------------------------------------------------------- every dtype round-trips


def test_scalars_strings_bools_int64_and_float16_round_trip_exactly_through_npz_golden_and_agent(tmp_path, keypair):
    _all_kinds_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "data.npz", **ALL_KINDS)
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"npz": "data.npz"}}}, keypair)
    assert result.report["passes"]["validate"]["fidelity"]["ok"] is True
    inputs, outputs = _golden(result.output)
    for name, value in ALL_KINDS.items():
        assert inputs[name].dtype == value.dtype and inputs[name].shape == value.shape, name
        assert np.array_equal(inputs[name], value), name
        assert np.array_equal(outputs[f"{name}_out"], value) and outputs[f"{name}_out"].shape == value.shape, name
    loaded = _agent_loads(result.output, keypair, tmp_path)
    assert loaded.smoke is not None and loaded.smoke.samples == 1
    service = InferenceService(loaded)
    for strings in (ALL_KINDS["t"], ALL_KINDS["t"].astype(object)):  # unicode or object arrays of str
        answer = service.predict_tensors({**ALL_KINDS, "t": strings}, postprocess=False)
        assert answer.outputs["t_out"].tolist() == ["héllo", "wörld"]
        assert answer.outputs["i_out"].dtype == np.int64 and answer.outputs["s_out"].shape == ()


def _write_pb(folder: Path, name: str, array: np.ndarray, tensor_name: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if array.dtype.kind == "U":
        array = array.astype(object)
    (folder / name).write_bytes(numpy_helper.from_array(array, tensor_name).SerializeToString())


def _test_data(folder: Path, named: bool, expected: dict[str, np.ndarray] | None = None) -> Path:
    data_set = folder / "cases" / "test_data_set_0"
    for n, (name, value) in enumerate(ALL_KINDS.items()):
        _write_pb(data_set, f"input_{n}.pb", value, name if named else "")
    for n, (name, value) in enumerate((expected or {f"{k}_out": v for k, v in ALL_KINDS.items()}).items()):
        _write_pb(data_set, f"output_{n}.pb", value, name if named else "")
    return folder / "cases"


@pytest.mark.parametrize("named", [True, False], ids=["by-name", "by-position"])
def test_onnx_test_data_sets_feed_inputs_and_their_expected_outputs_are_checked(tmp_path, keypair, named):
    _all_kinds_model(tmp_path / "m.onnx")
    _test_data(tmp_path, named)
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"test_data": "cases"}}}, keypair)
    expected = result.report["passes"]["validate"]["expected_outputs"]
    assert expected["ok"] is True and expected["against"] == "packaged" and len(expected["outputs"]) == 5
    inputs, _ = _golden(result.output)
    assert np.array_equal(inputs["t"], ALL_KINDS["t"]) and inputs["s"].shape == ()
    _agent_loads(result.output, keypair, tmp_path)


def test_a_test_data_expected_output_off_by_one_fails_the_build_naming_output_and_element(tmp_path, keypair):
    _all_kinds_model(tmp_path / "m.onnx")
    wrong = {f"{k}_out": v for k, v in ALL_KINDS.items()}
    wrong["i_out"] = wrong["i_out"].copy()
    wrong["i_out"][2, 1] += 1
    _test_data(tmp_path, True, wrong)
    with pytest.raises(ValidationFailed, match=r"output i_out element \[2, 1\] of test_data_set_0.*must match exactly"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"test_data": "cases"}}}, keypair)


def test_a_single_test_data_set_folder_is_a_source_too(tmp_path, keypair):
    _all_kinds_model(tmp_path / "m.onnx")
    _test_data(tmp_path, True)
    result = _build(tmp_path, {"model": {"path": "m.onnx"},
                               "validate": {"data": {"test_data": "cases/test_data_set_0"}}}, keypair)
    assert result.report["passes"]["validate"]["samples"] == 1


def test_test_data_without_a_tensor_for_an_input_names_the_set_and_input(tmp_path, keypair):
    _all_kinds_model(tmp_path / "m.onnx")
    cases = _test_data(tmp_path, True)
    (cases / "test_data_set_0" / "input_2.pb").unlink()
    with pytest.raises(RecipeError, match=r"test_data_set_0: no tensor for input\(s\) b"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"test_data": "cases"}}}, keypair)


# ---------------------------------------------------------------- stacks, sample axes, mistakes


def _add_model(path: Path, width: int = 4) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, [width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    return _save(path, [helper.make_node("Add", ["x", "k"], ["y"])], [x, k], [y])


def test_a_stack_gives_one_golden_sample_per_entry_with_its_own_batch_size(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)  # 3 samples of batch 5
    np.savez(tmp_path / "d.npz", x=x, k=np.ones((3, 4), np.float32))
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"npz": "d.npz"}},
                               "golden": {"count": 3}}, keypair)
    assert len(result.manifest.golden["samples"]) == 3
    inputs, outputs = _golden(result.output)
    assert inputs["x"].shape == (5, 4) and np.array_equal(outputs["y"], x[0] + 1)


def test_npz_inputs_with_different_sample_counts_are_refused_naming_both(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.zeros((3, 5, 4), np.float32), k=np.ones((2, 4), np.float32))
    with pytest.raises(RecipeError, match=r"validate\.data\.npz: .*x: 3, k: 2"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"npz": "d.npz"}}}, keypair)


def test_npz_data_of_the_wrong_kind_is_refused_not_cast(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.array([["a"] * 4]), k=np.ones(4, np.float32))
    with pytest.raises(RecipeError, match="input x is float32, the data is str"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"npz": "d.npz"}}}, keypair)


def test_npz_sample_axis_naming_no_input_is_refused(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.zeros((1, 4), np.float32), k=np.ones(4, np.float32))
    with pytest.raises(RecipeError, match=r"validate\.data\.sample_axis\.z"):
        _build(tmp_path, {"model": {"path": "m.onnx"},
                          "validate": {"data": {"npz": "d.npz", "sample_axis": {"z": 0}}}}, keypair)


# ---------------------------------------------------------------- constants


def test_a_constant_input_is_recorded_in_the_manifest_and_fed_by_the_agent(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.arange(8, dtype=np.float32).reshape(2, 1, 4))
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "inputs": {"k": {"role": "constant",
                                                                             "value": [10, 20, 30, 40]}},
                               "validate": {"data": {"npz": "d.npz"}}}, keypair)
    spec = {i["name"]: i for i in result.manifest.raw["inputs"]}
    assert spec["k"]["role"] == "constant" and spec["k"]["value"] == [10.0, 20.0, 30.0, 40.0]
    assert "role" not in spec["x"]
    inputs, outputs = _golden(result.output)
    assert set(inputs) == {"x"}, "constants come from the manifest, not the golden inputs"
    assert np.array_equal(outputs["y"], np.arange(4, dtype=np.float32)[None] + [10, 20, 30, 40])
    model = _agent_loads(result.output, keypair, tmp_path)  # the smoke test already needed the constant
    answer = InferenceService(model).predict_tensors({"x": np.ones((1, 4), np.float32)}, postprocess=False)
    assert answer.outputs["y"].tolist() == [[11, 21, 31, 41]]


@pytest.mark.parametrize(("decl", "needle"), [
    ({"role": "constant"}, "inputs.k.value: an input with role constant needs a value"),
    ({"value": [1, 2, 3, 4]}, "inputs.k.value: only an input with role: constant"),
    ({"range": [5, 1]}, "inputs.k.range: low 5 is above high 1"),
])
def test_input_declarations_that_contradict_themselves_are_refused_naming_the_key(tmp_path, decl, needle):
    _add_model(tmp_path / "m.onnx")
    with pytest.raises(RecipeError, match=needle.replace(".", r"\.")):
        recipe_from_dict({"name": "d", "version": "1.0.0", "model": {"path": "m.onnx"}, "inputs": {"k": decl},
                          "validate": {"data": "synthetic"}}, tmp_path)


def test_a_declared_dtype_the_model_disagrees_with_is_refused_naming_the_key(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    with pytest.raises(RecipeError, match=r"inputs\.x\.dtype: is int64, the model's input is float32"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "inputs": {"x": {"dtype": "int64"}},
                          "validate": {"data": "synthetic"}}, keypair)


def test_a_constant_of_the_wrong_shape_is_refused_naming_the_key(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    with pytest.raises(RecipeError, match=r"inputs\.k\.value: has shape \[3\]"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "inputs": {"k": {"role": "constant", "value": [1, 2, 3]}},
                          "validate": {"data": "synthetic"}}, keypair)


# ---------------------------------------------------------------- consent and synthetic data


def test_without_data_validation_is_a_recipe_error_unless_synthetic_is_consented(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    with pytest.raises(RecipeError, match=r"validate\.data: no data.*validate: \{data: synthetic\}"):
        recipe_from_dict({"name": "d", "version": "1.0.0", "model": {"path": "m.onnx"}}, tmp_path)
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": "synthetic"}}, keypair)
    assert result.report["passes"]["validate"]["source"] == "synthetic"
    assert result.report["passes"]["golden"]["source"] == "synthetic"


def test_golden_data_alone_is_real_data_for_validation_too(tmp_path, keypair):
    _add_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((2, 1, 4), np.float32), k=np.ones((2, 4), np.float32))
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "golden": {"data": {"npz": "d.npz"}}}, keypair)
    assert result.report["passes"]["validate"]["source"] == "npz"
    assert result.report["passes"]["validate"]["samples"] == 2


def _gather_model(path: Path, rows: int = 5) -> Path:
    table = numpy_helper.from_array(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3), "table")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 6])
    scale = helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 6, 3])
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"]), helper.make_node("Mul", ["g", "scale"], ["out"])]
    return _save(path, nodes, [ids, scale], [out], [table])


def test_synthetic_indices_stay_within_the_table_they_index_and_declared_ranges_hold(tmp_path, keypair):
    path = _gather_model(tmp_path / "m.onnx", rows=5)
    model = onnx.load(path)
    from sdk.packager.onnx_graph import graph_io

    inputs = graph_io(model)[0]
    assert index_ranges(model, inputs) == {"ids": (0, 5)}
    table = numpy_helper.from_array(np.zeros((4, 9), np.float32), "t")
    depth = numpy_helper.from_array(np.array(7, np.int64), "depth")
    other = helper.make_graph(
        [helper.make_node("GatherND", ["t", "nd"], ["a"]), helper.make_node("Gather", ["t", "col"], ["b"], axis=1),
         helper.make_node("OneHot", ["hot", "depth", "vals"], ["c"])], "o",
        [helper.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in ("nd", "col", "hot")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b", "c")],
        [table, depth, numpy_helper.from_array(np.float32([0, 1]), "vals")])
    other_inputs = [i for i in graph_io(helper.make_model(other))[0] if i.name in ("nd", "col", "hot")]
    assert index_ranges(helper.make_model(other), other_inputs) == {"nd": (0, 4), "col": (0, 9), "hot": (0, 7)}
    samples = synthetic_samples(16, PreprocessSpec(), inputs, declared={"scale": InputOptions(range=(2.0, 3.0))},
                                graph=model)
    ids = np.stack([f["ids"] for f in samples.feeds])
    scale = np.stack([f["scale"] for f in samples.feeds])
    assert ids.min() >= 0 and ids.max() == 4, "every row reachable, none past the table"
    assert scale.min() >= 2.0 and scale.max() < 3.0
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": "synthetic"},
                               "inputs": {"scale": {"range": [2.0, 3.0]}}}, keypair)
    assert result.report["passes"]["validate"]["fidelity"]["ok"]


# ---------------------------------------------------------------- golden samples that must not be signed


def _log_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    return _save(path, [helper.make_node("Log", ["x"], ["y"])], [x], [y])


def test_a_golden_sample_with_nan_outputs_fails_the_build_naming_sample_and_output(tmp_path, keypair):
    _log_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "ok.npz", x=np.array([[1.0, 2.0]], np.float32))
    np.savez(tmp_path / "neg.npz", x=np.array([[1.0, 2.0], [-1.0, 3.0]], np.float32))
    with pytest.raises(BuildError, match=r"golden sample neg\.npz sample 1 \(golden\.data\): output y holds 1 "
                                         r"non-finite"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"npz": "ok.npz"}},
                          "golden": {"data": {"npz": "neg.npz"}}}, keypair)
    assert not (tmp_path / "a.edgepkg").exists()


def test_a_golden_sample_with_an_empty_output_fails_the_build(tmp_path, keypair):
    _log_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "empty.npz", x=np.zeros((0,), np.float32))
    with pytest.raises(BuildError, match=r"output y is empty \(shape \[0\]\)"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"npz": "empty.npz"}}}, keypair)


def _log_test_data(folder: Path, x: np.ndarray, y: np.ndarray) -> str:
    _write_pb(folder / "cases" / "test_data_set_0", "input_0.pb", x, "x")
    _write_pb(folder / "cases" / "test_data_set_0", "output_0.pb", y, "y")
    return "cases"


def test_non_finite_golden_outputs_the_test_data_declares_are_signed_and_pass_the_smoke_test(tmp_path, keypair):
    _log_model(tmp_path / "m.onnx")
    x = np.array([1.0, 0.0, -1.0], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(x)  # [0, -inf, nan]: the answer the user's own test data states
    cases = _log_test_data(tmp_path, x, y)
    document = {"model": {"path": "m.onnx"}, "validate": {"data": {"test_data": cases}}}
    # stated by the test data but not allowed in the output: the agent would refuse the answer (500)
    with pytest.raises(BuildError, match=r"output y holds 2 non-finite value\(s\) \(NaN/inf\) \(as the test data "
                                         r"expects\); .* declare outputs\.y\.allow_non_finite: true"):
        _build(tmp_path, document, keypair)
    result = _build(tmp_path, {**document, "outputs": {"y": {"allow_non_finite": True}}}, keypair)
    _, outputs = _golden(result.output)
    assert np.isneginf(outputs["y"][1]) and np.isnan(outputs["y"][2])
    loaded = _agent_loads(result.output, keypair, tmp_path)
    assert loaded.smoke is not None and loaded.smoke.samples == 1


def test_non_finite_golden_outputs_the_test_data_does_not_declare_still_fail_the_build(tmp_path, keypair):
    _log_model(tmp_path / "m.onnx")
    x = np.array([1.0, 0.0, -1.0], np.float32)
    cases = _log_test_data(tmp_path, x, np.zeros(3, np.float32))  # expects finite values
    with pytest.raises((BuildError, ValidationFailed), match=r"output y"):
        _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"test_data": cases}}}, keypair)
    assert not (tmp_path / "a.edgepkg").exists()


def test_an_empty_golden_output_the_test_data_declares_is_signed(tmp_path, keypair):
    _log_model(tmp_path / "m.onnx")
    empty = np.zeros((0,), np.float32)
    cases = _log_test_data(tmp_path, empty, empty)
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": {"test_data": cases}}}, keypair)
    _, outputs = _golden(result.output)
    assert outputs["y"].shape == (0,)
    assert _agent_loads(result.output, keypair, tmp_path).smoke.samples == 1


def _isnan_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.BOOL, [3])
    return _save(path, [helper.make_node("IsNaN", ["x"], ["y"])], [x], [y])


@pytest.mark.parametrize("declared", [True, False], ids=["allow_non_finite", "default"])
def test_non_finite_inputs_are_served_only_where_the_recipe_declares_them(tmp_path, keypair, declared):
    from device_agent.errors import BadRequest

    _isnan_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.array([1.0, 2.0, 3.0], np.float32))
    inputs = {"x": {"allow_non_finite": True}} if declared else {}
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "inputs": inputs,
                               "validate": {"data": {"npz": "d.npz"}}}, keypair)
    service = InferenceService(_agent_loads(result.output, keypair, tmp_path))
    feed = {"x": np.array([np.nan, 1.0, np.inf], np.float32)}
    if declared:
        assert service.predict_tensors(feed, postprocess=False).outputs["y"].tolist() == [True, False, False]
    else:
        with pytest.raises(BadRequest, match="NaN or infinite"):
            service.predict_tensors(feed, postprocess=False)


def test_a_model_without_inputs_builds_and_the_agent_serves_it(tmp_path, keypair):
    """onnxruntime runs input-less graphs (a Constant, a generator): so does Edgepack."""
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    value = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.5, -2.0])
    _save(tmp_path / "m.onnx", [helper.make_node("Constant", [], ["y"], value=value)], [], [y])
    result = _build(tmp_path, {"model": {"path": "m.onnx"}, "validate": {"data": "synthetic"}}, keypair)
    loaded = _agent_loads(result.output, keypair, tmp_path)
    assert loaded.manifest.inputs == [] and loaded.smoke.samples >= 1
    answer = InferenceService(loaded).predict_tensors({}, postprocess=False)
    assert answer.outputs["y"].tolist() == [1.5, -2.0]
