"""What onnxruntime loads, Edgepack packages: opsets old and new, IR 3, ai.onnx.ml-only graphs,
contrib ops, every io dtype; checker findings onnxruntime tolerates are warnings; opset
conversion is an explicit, checked step. Each case is built through the real pipeline, loaded
by the real agent runtime and run on the same inputs as bare onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import BuildError, ModelError
from sdk.packager.onnx_graph import graph_io, lower_ir_version, prune_opset_imports
from sdk.packager.passes.ort_optimize import check_optimized, dangling_inputs, outputs_differ, probe_feeds
from sdk.packager.passes.runtime_compat import host_runtime_row
from sdk.packager.pipeline import build
from sdk.recipe import recipe_from_dict

HOST_ORT = ".".join(ort.__version__.split(".")[:3])


def _save(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def _build(folder: Path, key: Path, model_path: Path, **recipe: object):
    data = {"name": model_path.stem.replace("_", "-"), "version": "1.0.0", "model": {"path": model_path.name},
            "postprocess": {"kind": "raw"}, "validate": {"data": "synthetic"}, "targets": ["x86"], **recipe}
    return build(recipe_from_dict(data, folder), key_paths=[str(key)], output=folder / f"{model_path.stem}.edgepkg")


def _serve(result, folder: Path, public: Path):
    verified = extract_artifact(result.output, folder / f"x-{result.output.stem}",
                                TrustStore([load_public_key(public)]))
    return InferenceService(load_model(verified.root, verified.manifest))


def _bare(model_path: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _graph(nodes, inputs, outputs, inits=(), *, opsets=(("", 17),), ir: int = 8) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = ir
    return model


def _vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _same_as_bare(service, model_path: Path, feed: dict[str, np.ndarray]) -> None:
    got = service.predict_tensors(feed, postprocess=False).outputs
    for name, want in zip(service.model.output_names, _bare(model_path, feed), strict=True):
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)


def test_opset_7_model_builds_runs_and_records_an_old_minimum(tmp_path, keypair):
    private, public = keypair
    model = _graph([helper.make_node("Add", ["x", "b"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
                   [_vi("x", TensorProto.FLOAT, [1, 4])], [_vi("z", TensorProto.FLOAT, [1, 4])],
                   [numpy_helper.from_array(np.array([1, -2, 3, -4], np.float32), "b")], opsets=(("", 7),), ir=3)
    model.graph.input.append(_vi("b", TensorProto.FLOAT, [4]))  # IR 3: initializers are inputs too
    path = _save(model, tmp_path, "opset7.onnx")
    result = _build(tmp_path, private, path)
    section = result.manifest.raw["model"]
    assert section["opset"] == 7 and section["opsets"] == {"ai.onnx": 7}
    assert section["min_onnxruntime"] == "1.0.0", "opset 7 and IR 4 run on every release in the table"
    assert [i.name for i in result.manifest.inputs] == ["x"], "an IR-3 initializer is not an input to feed"
    feed = {"x": np.array([[0.5, 1, -7, 2]], np.float32)}
    _same_as_bare(_serve(result, tmp_path, public), path, feed)


def test_ir3_model_whose_initializers_fold_away_keeps_no_unfed_input(tmp_path, keypair):
    """onnxruntime's optimizer folds Mul(w, 2) into a new initializer and used to keep ``w`` as a
    graph input without a value; the built graph must take only ``x``."""
    private, public = keypair
    w = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    two = numpy_helper.from_array(np.array([2], np.float32), "two")
    model = _graph([helper.make_node("Mul", ["w", "two"], ["w2"]), helper.make_node("Add", ["x", "w2"], ["y"])],
                   [_vi("x", TensorProto.FLOAT, ["n", 4]), _vi("w", TensorProto.FLOAT, [4]),
                    _vi("two", TensorProto.FLOAT, [1])], [_vi("y", TensorProto.FLOAT, ["n", 4])], [w, two],
                   opsets=(("", 11),), ir=3)
    path = _save(model, tmp_path, "ir3_fold.onnx")
    result = _build(tmp_path, private, path)
    built = onnx.load_from_string(_member(result.output, "model/model.onnx"))
    initialised = {i.name for i in built.graph.initializer}
    assert [i.name for i in built.graph.input if i.name not in initialised] == ["x"]
    assert not dangling_inputs(built, {"x"})
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.ones((3, 4), np.float32)})


def _member(artifact: Path, name: str) -> bytes:
    import tarfile

    with tarfile.open(artifact) as tar:
        return tar.extractfile(name).read()


def test_opset_22_model_builds_and_a_target_with_an_older_runtime_is_refused(tmp_path, keypair):
    private, public = keypair
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [2, 3])],
                   [_vi("y", TensorProto.FLOAT, [2, 3])], opsets=(("", 22),), ir=10)
    path = _save(model, tmp_path, "opset22.onnx")
    result = _build(tmp_path, private, path)
    assert result.manifest.raw["model"]["min_onnxruntime"] == "1.21.0"
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.linspace(-3, 3, 6, dtype=np.float32).reshape(2, 3)})
    # A target whose devices run an older onnxruntime is refused before signing, naming why.
    with pytest.raises(BuildError) as refused:
        _build(tmp_path, private, path, targets=["x86", "rpi"], output="rpi.edgepkg")
    message = str(refused.value)
    assert message == ("runtime_compat: opset22.onnx: target rpi runs onnxruntime 1.16.0, but opset 22 (ai.onnx) "
                       "needs onnxruntime >= 1.21.0")
    assert not (tmp_path / "rpi.edgepkg").exists()


@pytest.mark.parametrize(("declared", "builds"), [("1.21.0", True), ("1.21", True), ("1.20.9", False)])
def test_a_recipe_that_names_its_devices_onnxruntime_moves_the_target_limit(tmp_path, keypair, declared, builds):
    private, _ = keypair
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [2, 3])],
                   [_vi("y", TensorProto.FLOAT, [2, 3])], opsets=(("", 22),), ir=10)
    path = _save(model, tmp_path, "opset22.onnx")
    recipe = {"targets": ["rpi"], "target_onnxruntime": {"rpi": declared}}
    if builds:
        assert _build(tmp_path, private, path, **recipe).manifest.raw["model"]["min_onnxruntime"] == "1.21.0"
    else:
        with pytest.raises(BuildError, match=rf"target rpi runs onnxruntime {declared}, but opset 22"):
            _build(tmp_path, private, path, **recipe)


def test_target_onnxruntime_names_only_known_profiles(tmp_path):
    from sdk.errors import SchemaError

    with pytest.raises(SchemaError, match=r"target_onnxruntime\.pi"):
        recipe_from_dict({"name": "a", "version": "1.0.0", "model": {"path": "m.onnx"},
                          "validate": {"data": "synthetic"}, "target_onnxruntime": {"pi": "1.20.0"}}, tmp_path)


def test_opset_newer_than_the_table_needs_the_build_hosts_runtime(tmp_path, keypair):
    private, public = keypair
    host = host_runtime_row()
    assert host is not None and host.version == HOST_ORT and host.opset >= 27
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [2])],
                   [_vi("y", TensorProto.FLOAT, [2])], opsets=(("", 27),), ir=10)
    path = _save(model, tmp_path, "opset27.onnx")
    result = _build(tmp_path, private, path)
    assert result.manifest.raw["model"]["min_onnxruntime"] == HOST_ORT
    assert result.report["passes"]["runtime_compat"]["reason"] == "opset 27 (ai.onnx)"
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.array([-1, 2], np.float32)})


def test_opset_newer_than_any_runtime_is_refused_naming_the_model(tmp_path, keypair):
    private, _ = keypair
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [2])],
                   [_vi("y", TensorProto.FLOAT, [2])], opsets=(("", 99),), ir=10)
    path = _save(model, tmp_path, "future.onnx")
    with pytest.raises(ModelError) as refused:
        _build(tmp_path, private, path, model={"path": path.name})
    assert str(refused.value).startswith("future.onnx: ") and "opset 99" in str(refused.value)


def test_ml_only_model_is_accepted_and_no_default_domain_is_added(tmp_path, keypair):
    private, public = keypair
    node = helper.make_node("Scaler", ["x"], ["y"], domain="ai.onnx.ml", offset=[1.0, 2.0, 3.0],
                            scale=[2.0, 0.5, 1.0])
    model = _graph([node], [_vi("x", TensorProto.FLOAT, ["n", 3])], [_vi("y", TensorProto.FLOAT, ["n", 3])],
                   opsets=(("ai.onnx.ml", 1),), ir=8)
    path = _save(model, tmp_path, "scaler.onnx")
    result = _build(tmp_path, private, path)
    section = result.manifest.raw["model"]
    assert "opset" not in section and section["opsets"] == {"ai.onnx.ml": 1}
    built = onnx.load_from_string(_member(result.output, "model/model.onnx"))
    assert [(e.domain, e.version) for e in built.opset_import] == [("ai.onnx.ml", 1)]
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})


def _contrib_model(tmp_path: Path) -> Path:
    nodes = [helper.make_node("QuickGelu", ["x"], ["g"], domain="com.microsoft", alpha=1.702),
             helper.make_node("Neg", ["g"], ["y"])]
    model = _graph(nodes, [_vi("x", TensorProto.FLOAT, [1, 8])], [_vi("y", TensorProto.FLOAT, [1, 8])],
                   opsets=(("", 13), ("com.microsoft", 1)), ir=7)
    return _save(model, tmp_path, "quickgelu.onnx")


def test_contrib_op_model_builds_with_its_own_minimum(tmp_path, keypair):
    private, public = keypair
    path = _contrib_model(tmp_path)
    result = _build(tmp_path, private, path)
    section = result.manifest.raw["model"]
    assert section["min_onnxruntime"] == "1.15.0"
    assert result.report["passes"]["runtime_compat"]["reason"] == "contrib op com.microsoft.QuickGelu"
    assert section["opsets"] == {"ai.onnx": 13, "com.microsoft": 1}
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.linspace(-2, 2, 8, dtype=np.float32)[None]})


def _unsorted_model(tmp_path: Path) -> Path:
    """Nodes out of topological order: onnx.checker refuses it, onnxruntime sorts and runs it."""
    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["x"], ["a"])]
    model = _graph(nodes, [_vi("x", TensorProto.FLOAT, [1, 3])], [_vi("y", TensorProto.FLOAT, [1, 3])])
    return _save(model, tmp_path, "unsorted.onnx")


def test_checker_finding_onnxruntime_tolerates_is_a_warning(tmp_path, keypair):
    private, public = keypair
    path = _unsorted_model(tmp_path)
    result = _build(tmp_path, private, path)
    warning = next(w for w in result.warnings if w.startswith("onnx.checker:"))
    assert "topologically sorted" in warning and "onnxruntime loads unsorted.onnx" in warning
    assert result.report["passes"]["check"]["ok"] is False
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.array([[1, -2, 3]], np.float32)})


def test_strict_check_turns_the_checker_finding_into_an_error(tmp_path, keypair):
    private, _ = keypair
    path = _unsorted_model(tmp_path)
    with pytest.raises(ModelError) as refused:
        _build(tmp_path, private, path, model={"path": path.name, "strict_check": True})
    message = str(refused.value)
    assert message.startswith("unsorted.onnx: onnx.checker refused it (model.strict_check is on)")
    assert "topologically sorted" in message


def test_checker_finding_onnxruntime_also_refuses_is_an_error(tmp_path, keypair):
    private, _ = keypair
    model = _graph([helper.make_node("Relu", ["nowhere"], ["y"])], [_vi("x", TensorProto.FLOAT, [1])],
                   [_vi("y", TensorProto.FLOAT, [1])])
    path = _save(model, tmp_path, "dangling.onnx")
    with pytest.raises(ModelError) as refused:
        _build(tmp_path, private, path)
    message = str(refused.value)
    assert message.startswith("dangling.onnx: onnx.checker refused it (") and "onnxruntime cannot load it" in message


def test_custom_domain_is_refused_naming_the_op(tmp_path, keypair):
    private, _ = keypair
    model = _graph([helper.make_node("Frobnicate", ["x"], ["y"], domain="org.example")],
                   [_vi("x", TensorProto.FLOAT, [2])], [_vi("y", TensorProto.FLOAT, [2])],
                   opsets=(("", 17), ("org.example", 1)))
    path = _save(model, tmp_path, "custom.onnx")
    with pytest.raises(ModelError) as refused:
        _build(tmp_path, private, path)
    assert "custom.onnx" in str(refused.value) and "Frobnicate (org.example)" in str(refused.value)


def test_string_bool_scalar_and_float16_io_round_trip(tmp_path, keypair):
    private, public = keypair
    nodes = [helper.make_node("Identity", ["s"], ["s_out"]), helper.make_node("Not", ["b"], ["b_out"]),
             helper.make_node("Add", ["h", "h"], ["h_out"]), helper.make_node("Neg", ["k"], ["k_out"]),
             helper.make_node("Cast", ["b"], ["i_out"], to=TensorProto.INT32)]
    model = _graph(nodes, [_vi("s", TensorProto.STRING, ["n"]), _vi("b", TensorProto.BOOL, [3]),
                           _vi("h", TensorProto.FLOAT16, [2, 2]), _vi("k", TensorProto.INT64, [])],
                   [_vi("s_out", TensorProto.STRING, ["n"]), _vi("b_out", TensorProto.BOOL, [3]),
                    _vi("h_out", TensorProto.FLOAT16, [2, 2]), _vi("k_out", TensorProto.INT64, []),
                    _vi("i_out", TensorProto.INT32, [3])])
    path = _save(model, tmp_path, "dtypes.onnx")
    result = _build(tmp_path, private, path)
    specs = {t.name: (t.dtype, t.shape) for t in result.manifest.inputs}
    assert specs == {"s": ("string", ("n",)), "b": ("bool", (3,)), "h": ("float16", (2, 2)), "k": ("int64", ())}
    service = _serve(result, tmp_path, public)
    feed = {"s": np.array(["a", "bé"], dtype=object), "b": np.array([True, False, True]),
            "h": np.array([[1.5, -2], [0.25, 3]], np.float16), "k": np.array(7, np.int64)}
    got = service.model.run(feed)  # the device's session; the HTTP typing of strings is the agent's own
    assert got["s_out"].tolist() == ["a", "bé"] and got["b_out"].tolist() == [False, True, False]
    assert got["h_out"].dtype == np.float16 and got["h_out"].tolist() == [[3.0, -4.0], [0.5, 6.0]]
    assert got["k_out"].shape == () and int(got["k_out"]) == -7 and got["i_out"].tolist() == [1, 0, 1]


def test_literal_minus_one_and_zero_dims_and_named_dims_in_the_io_spec():
    x = _vi("x", TensorProto.FLOAT, [1, 3])
    x.type.tensor_type.shape.dim[0].dim_value = -1  # some exporters write -1 for "any"
    empty = _vi("e", TensorProto.FLOAT, [0, "batch", None])
    model = _graph([helper.make_node("Identity", ["x"], ["y"])], [x, empty], [_vi("y", TensorProto.FLOAT, [1, 3])])
    inputs, _ = graph_io(model)
    assert inputs[0].shape == ("x_dim0", 3)
    assert inputs[1].shape == (0, "batch", "e_dim2")


def test_input_of_unknown_rank_needs_a_declared_shape(tmp_path, keypair):
    private, public = keypair
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, None)],
                   [_vi("y", TensorProto.FLOAT, None)])
    path = _save(model, tmp_path, "norank.onnx")
    with pytest.raises(ModelError) as refused:
        _build(tmp_path, private, path)
    assert str(refused.value) == ("norank.onnx: input: x declares no rank; declare its shape in the recipe: "
                                  "inputs: {x: {shape: [...]}}")
    result = _build(tmp_path, private, path, inputs={"x": {"shape": ["n", 3]}})
    assert result.manifest.inputs[0].shape == ("n", 3) and result.manifest.outputs[0].shape == ("n", 3)
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.array([[1, -2, 3]], np.float32)})


def test_sequence_output_is_refused_with_the_zipmap_hint():
    seq = helper.make_tensor_sequence_value_info("y", TensorProto.FLOAT, None)
    model = _graph([helper.make_node("SequenceConstruct", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [2])], [seq])
    with pytest.raises(ModelError) as refused:
        graph_io(model, "clf.onnx")
    assert str(refused.value).startswith("clf.onnx: output: y is a sequence_type, not a tensor")


def test_convert_opset_is_an_explicit_validated_step(tmp_path, keypair):
    private, public = keypair
    model = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [_vi("x", TensorProto.FLOAT, [2, 5])],
                   [_vi("y", TensorProto.FLOAT, [2, 5])], opsets=(("", 11),), ir=6)
    path = _save(model, tmp_path, "softmax11.onnx")
    result = _build(tmp_path, private, path, model={"path": path.name, "convert_opset": 17})
    assert result.manifest.raw["model"]["opset"] == 17
    assert result.report["passes"]["convert_opset"] == {"from": 11, "to": 17}
    assert result.report["passes"]["validate"]["budget_met"] is True
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.arange(10, dtype=np.float32).reshape(2, 5)})


def test_convert_opset_failure_is_one_clear_error(tmp_path, keypair):
    private, _ = keypair
    model = _graph([helper.make_node("LayerNormalization", ["x", "s"], ["y"])], [_vi("x", TensorProto.FLOAT, [2, 3])],
                   [_vi("y", TensorProto.FLOAT, [2, 3])], [numpy_helper.from_array(np.ones(3, np.float32), "s")])
    path = _save(model, tmp_path, "layernorm.onnx")
    with pytest.raises(ModelError) as refused:
        _build(tmp_path, private, path, model={"path": path.name, "convert_opset": 16})
    message = str(refused.value)
    assert message.startswith("layernorm.onnx: onnx.version_converter cannot convert opset 17 to 16")
    assert "LayerNormalization" in message and "\n" not in message


def test_built_artifact_imports_only_the_domains_its_nodes_use(tmp_path, keypair):
    """onnxruntime's optimized-model save adds ai.onnx.ml, com.microsoft and more; they are pruned."""
    private, _ = keypair
    model = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", TensorProto.FLOAT, ["n", 3])],
                   [_vi("y", TensorProto.FLOAT, ["n", 2])],
                   [numpy_helper.from_array(np.ones((3, 2), np.float32), "w")])
    path = _save(model, tmp_path, "matmul.onnx")
    result = _build(tmp_path, private, path)
    assert result.report["passes"]["ort_optimize"]["applied"] is True
    built = onnx.load_from_string(_member(result.output, "model/model.onnx"))
    assert [(e.domain, e.version) for e in built.opset_import] == [("", 17)]
    assert result.manifest.raw["model"]["opsets"] == {"ai.onnx": 17}


def test_an_unused_import_newer_than_the_target_runs_is_pruned_not_refused(tmp_path, keypair):
    """ai.onnx.ml 4 needs onnxruntime 1.17; unused, it goes, and the rpi target's 1.16 runs the rest."""
    private, public = keypair
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [2])],
                   [_vi("y", TensorProto.FLOAT, [2])], opsets=(("", 17), ("ai.onnx.ml", 4)))
    path = _save(model, tmp_path, "unused_ml.onnx")
    result = _build(tmp_path, private, path, targets=["rpi"])
    assert result.manifest.raw["model"]["opsets"] == {"ai.onnx": 17}
    assert result.report["passes"]["opset"]["opsets"] == {"ai.onnx": 17, "ai.onnx.ml": 4}
    built = onnx.load_from_string(_member(result.output, "model/model.onnx"))
    assert [(e.domain, e.version) for e in built.opset_import] == [("", 17)]
    _same_as_bare(_serve(result, tmp_path, public), tmp_path / "unused_ml.onnx", {"x": np.array([-1, 1], np.float32)})


def test_newest_ir_stamp_is_lowered_so_older_devices_load_the_artifact(tmp_path, keypair):
    """onnx.helper stamps its newest IR (onnxruntime 1.32 only); an opset-17 graph needs IR 8."""
    private, public = keypair
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"])], "g", [_vi("x", TensorProto.FLOAT, [1, 5])],
                              [_vi("y", TensorProto.FLOAT, [1, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert model.ir_version == onnx.IR_VERSION > 10
    path = _save(model, tmp_path, "newest_ir.onnx")
    result = _build(tmp_path, private, path, targets=["rpi", "x86"])
    assert result.manifest.raw["model"]["ir_version"] == 8
    assert result.manifest.raw["model"]["min_onnxruntime"] == "1.12.0"
    assert result.report["passes"]["runtime_compat"]["ir_lowered_from"] == onnx.IR_VERSION
    assert onnx.load_from_string(_member(result.output, "model/model.onnx")).ir_version == 8
    _same_as_bare(_serve(result, tmp_path, public), path, {"x": np.arange(5, dtype=np.float32)[None]})


def test_ir_is_kept_when_the_graph_uses_what_a_later_ir_brought():
    relu = [helper.make_node("Relu", ["x"], ["y"])]
    io = ([_vi("x", TensorProto.FLOAT, [2])], [_vi("y", TensorProto.FLOAT, [2])])
    float8 = _graph(relu, *io, [helper.make_tensor("f8", TensorProto.FLOAT8E4M3FN, [1], [1.0])], ir=11)
    assert lower_ir_version(float8) is None and float8.ir_version == 11
    with_function = _graph(relu, *io, ir=11)
    with_function.functions.append(helper.make_function("local", "f", ["a"], ["b"],
                                                        [helper.make_node("Relu", ["a"], ["b"])],
                                                        [helper.make_opsetid("", 17)]))
    assert lower_ir_version(with_function) is None
    classic = _graph(relu, *io, [numpy_helper.from_array(np.ones(2, np.float32), "w")], opsets=(("", 7),), ir=11)
    assert lower_ir_version(classic) == 11 and classic.ir_version == 4, "a non-input initializer needs IR 4"
    already = _graph(relu, *io, ir=8)
    assert lower_ir_version(already) is None and already.ir_version == 8


def test_prune_keeps_domains_used_inside_subgraphs():
    then_branch = helper.make_graph([helper.make_node("Scaler", ["x"], ["t"], domain="ai.onnx.ml", scale=[2.0])],
                                    "then", [], [_vi("t", TensorProto.FLOAT, [1])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                                    [_vi("e", TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)
    model = _graph([node], [_vi("c", TensorProto.BOOL, []), _vi("x", TensorProto.FLOAT, [1])],
                   [_vi("y", TensorProto.FLOAT, [1])],
                   opsets=(("", 17), ("ai.onnx.ml", 3), ("com.microsoft", 1), ("ai.onnx.training", 1)))
    assert prune_opset_imports(model) == ["ai.onnx.training", "com.microsoft"]
    assert {(e.domain, e.version) for e in model.opset_import} == {("", 17), ("ai.onnx.ml", 3)}


# ---------------------------------------------------------------- the optimizer's self-check

def _scale(factor: float) -> onnx.ModelProto:
    k = numpy_helper.from_array(np.array([factor], np.float32), "k")
    return _graph([helper.make_node("Mul", ["x", "k"], ["y"])], [_vi("x", TensorProto.FLOAT, ["n", 4])],
                  [_vi("y", TensorProto.FLOAT, ["n", 4])], [k])


def test_optimizer_check_accepts_an_equal_graph_and_refuses_a_different_one():
    inputs, _ = graph_io(_scale(2.0))
    assert check_optimized(_scale(2.0), _scale(2.0), inputs) is None
    reason = check_optimized(_scale(2.0), _scale(2.01), inputs)
    assert reason is not None and reason.startswith("output y differs by up to") and "sample 0" in reason


def test_optimizer_check_refuses_a_graph_input_nobody_feeds():
    broken = _scale(2.0)
    del broken.graph.initializer[:]
    broken.graph.input.append(_vi("k", TensorProto.FLOAT, [1]))  # the IR-3 leftover: an input without value
    inputs, _ = graph_io(_scale(2.0))
    reason = check_optimized(_scale(2.0), broken, inputs)
    assert reason == "the optimized graph reads k, which nothing feeds or initialises"


def test_outputs_differ_boundaries():
    base = {"y": np.array([1.0, 2.0], np.float32)}
    assert outputs_differ(base, {"y": np.array([1.0, 2.0 + 2.0e-3 * 0.9 + 1e-4 * 0.5], np.float32)}) is None
    assert outputs_differ(base, {"y": np.array([1.0, 2.01], np.float32)}) is not None
    assert outputs_differ({"i": np.array([1, 2])}, {"i": np.array([1, 3])}) == "output i differs"
    assert outputs_differ({"n": np.array([np.nan])}, {"n": np.array([np.nan])}) is None, "NaN in both places agrees"
    assert "is float64[2]" in outputs_differ(base, {"y": np.array([1.0, 2.0])})


def test_probe_feeds_are_index_safe_and_typed():
    feeds = probe_feeds(graph_io(_graph([], [_vi("i", TensorProto.INT64, ["n", 2]), _vi("s", TensorProto.STRING, [1]),
                                             _vi("f", TensorProto.FLOAT16, [3])], []))[0], 2)
    assert len(feeds) == 2 and feeds[0]["i"].tolist() == [[0, 0]] and feeds[0]["s"].tolist() == ["a"]
    assert feeds[0]["f"].dtype == np.float16 and ((feeds[0]["f"] >= 0) & (feeds[0]["f"] < 1)).all()


def test_optimizer_failure_keeps_the_unoptimized_graph_with_a_one_line_reason(tmp_path):
    from sdk.packager.passes.base import BuildContext, get_pass

    model = _graph([helper.make_node("Sin", ["x"], ["y"])], [_vi("x", TensorProto.INT32, [2])],
                   [_vi("y", TensorProto.INT32, [2])])  # no Sin kernel for int32: onnxruntime refuses it
    _save(model, tmp_path, "sin.onnx")
    recipe = recipe_from_dict({"name": "sin", "version": "1.0.0", "model": {"path": "sin.onnx"},
                               "validate": {"data": "synthetic"}}, tmp_path)
    ctx = BuildContext(recipe=recipe, workdir=tmp_path, model=model)
    ctx.inputs, ctx.outputs = graph_io(model)
    get_pass("ort_optimize").run(ctx)
    assert ctx.model is model
    assert ctx.report["ort_optimize"]["applied"] is False
    (warning,) = ctx.warnings
    assert warning.startswith("ort_optimize: kept the unoptimized graph: onnxruntime's optimizer failed: ")
    assert "Sin" in warning and "\n" not in warning
