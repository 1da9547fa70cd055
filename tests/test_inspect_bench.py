"""Tools that work on any model: ``edgepack inspect --nodes`` and ``edgepack bench`` shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgepack_core.errors import UsageError
from sdk.bench import (
    MAX_INPUT_ELEMENTS,
    InputHints,
    bench,
    make_feed,
    packaged_model,
    parse_shape,
    resolve_shape,
    shapes_by_name,
)
from tests.artifacts import build_artifact
from tests.conftest import run_cli


def dynamic_model(path: Path) -> Path:
    """x [N, 3, H, W] -> Relu (named) -> Mul by 2 (unnamed) -> y; plus a com.microsoft Gelu."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu_1"),
             helper.make_node("Mul", ["r", "two"], ["y"]),
             helper.make_node("Gelu", ["y"], ["z"], name="gelu", domain="com.microsoft")]
    graph = helper.make_graph(nodes, "dyn", [x], [y, z], [helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, path)
    return path


def if_model(path: Path) -> Path:
    """An If whose branches hold nodes: inspect lists them as if/then_branch/..."""
    then_out = helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])
    else_out = helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])
    then_graph = helper.make_graph([helper.make_node("Neg", ["x"], ["t"], name="neg")], "then", [], [then_out])
    else_graph = helper.make_graph([helper.make_node("Abs", ["x"], ["e"], name="abs")], "else", [], [else_out])
    node = helper.make_node("If", ["c"], ["y"], name="choose", then_branch=then_graph, else_branch=else_graph)
    graph = helper.make_graph([node], "if", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                             helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_inspect_nodes_lists_names_op_types_and_inferred_shapes(tmp_path):
    model = dynamic_model(tmp_path / "dyn.onnx")
    result = run_cli("edgepack", "inspect", "--nodes", str(model), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["nodes"]
    assert [(r["name"], r["op_type"], r["domain"]) for r in rows] == [
        ("relu_1", "Relu", "ai.onnx"), ("#1", "Mul", "ai.onnx"), ("gelu", "Gelu", "com.microsoft")]
    # Intermediate and output shapes come from shape inference, symbolic dims kept.
    assert rows[0]["outputs"] == [{"name": "r", "dtype": "float", "shape": ["N", 3, "H", "W"]}]
    assert rows[1]["inputs"][1] == {"name": "two", "dtype": "float", "shape": [1], "initializer": True}
    assert rows[1]["outputs"][0]["shape"] == ["N", 3, "H", "W"]
    human = run_cli("edgepack", "inspect", "--nodes", str(model))
    assert human.returncode == 0
    assert "3 node(s)" in human.stdout and "com.microsoft.Gelu" in human.stdout
    assert "relu_1" in human.stdout and "r:float[N, 3, H, W]" in human.stdout


def test_inspect_nodes_walks_subgraphs(tmp_path):
    result = run_cli("edgepack", "inspect", "--nodes", str(if_model(tmp_path / "if.onnx")), "--json")
    assert result.returncode == 0, result.stderr
    names = [r["name"] for r in json.loads(result.stdout)["nodes"]]
    assert names[0] == "choose"
    assert sorted(names[1:]) == ["choose/else_branch/abs", "choose/then_branch/neg"]


def test_inspect_model_summary_without_nodes(tmp_path):
    model = dynamic_model(tmp_path / "dyn.onnx")
    result = run_cli("edgepack", "inspect", str(model), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["opsets"] == {"ai.onnx": 17, "com.microsoft": 1}
    assert [i["name"] for i in summary["inputs"]] == ["x"]  # the initializer "two" is not an input
    assert summary["op_types"] == {"Mul": 1, "Relu": 1, "com.microsoft.Gelu": 1}


def test_inspect_nodes_of_an_artifact_shows_the_packaged_model(tmp_path, keypair):
    artifact = build_artifact(tmp_path / "a", keypair[0], extra="validate: {data: synthetic}\n")
    for extra in ([], ["--trust", str(keypair[1])]):
        result = run_cli("edgepack", "inspect", "--nodes", str(artifact), "--json", *extra)
        assert result.returncode == 0, result.stderr
        rows = json.loads(result.stdout)["nodes"]
        assert [r["op_type"] for r in rows] == ["Mul"]
        assert rows[0]["outputs"][0]["shape"] == ["batch", 4]


def test_inspect_of_a_file_that_is_not_a_model_is_one_line(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07garbage that is not protobuf \xff\xff")
    for args in (["--nodes"], []):
        result = run_cli("edgepack", "inspect", *args, str(tmp_path / "junk.onnx"))
        assert result.returncode == 1
        assert result.stderr.strip().count("\n") == 0 and "not an ONNX model" in result.stderr
        assert "Traceback" not in result.stderr
    missing = run_cli("edgepack", "inspect", "--nodes", str(tmp_path / "none.onnx"))
    assert missing.returncode == 1 and "no such file" in missing.stderr


# -- bench --------------------------------------------------------------------------------------

def test_parse_shape_forms_and_refusals():
    assert parse_shape("x=1x3x224x224") == ("x", (1, 3, 224, 224))
    assert parse_shape("2X8") == (None, (2, 8))
    assert parse_shape("scale=") == ("scale", ())
    assert parse_shape("a=b=1x2") == ("a=b", (1, 2))
    for bad in ("x=1x?x3", "x=1x-1", "x=1,2"):
        with pytest.raises(UsageError):
            parse_shape(bad)


def test_shapes_by_name_needs_a_name_when_the_model_has_several_inputs():
    assert shapes_by_name(["4x2"], ["x"]) == {"x": (4, 2)}
    with pytest.raises(UsageError, match="2 inputs"):
        shapes_by_name(["4x2"], ["a", "b"])
    with pytest.raises(UsageError, match="no input 'c'"):
        shapes_by_name(["c=1"], ["a", "b"])


def test_resolve_shape_boundaries():
    assert resolve_shape("x", [1, 3], None, "model") == (1, 3)
    assert resolve_shape("x", [], None, "model") == ()
    assert resolve_shape("x", ["N", 3], (5, 3), "--shape") == (5, 3)
    assert resolve_shape("x", [None, 0], (2, 0), "--shape") == (2, 0)
    assert resolve_shape("x", ["N", 3], None, "model") == (1, 3)  # a free leading (batch) dim is 1
    assert resolve_shape("x", [-1, 3], None, "model") == (1, 3)
    for declared in (["N"], [1, "T"], ["N", "T"], [None, 3, None]):
        with pytest.raises(UsageError, match="dynamic dims"):
            resolve_shape("x", declared, None, "model")
    with pytest.raises(UsageError, match="rank 2"):
        resolve_shape("x", ["N", 3], (3,), "--shape")
    with pytest.raises(UsageError, match="dim 1 fixed to 3"):
        resolve_shape("x", ["N", 3], (1, 4), "--shape")
    assert resolve_shape("x", ["N"], (MAX_INPUT_ELEMENTS,), "--shape") == (MAX_INPUT_ELEMENTS,)
    with pytest.raises(UsageError, match="elements"):
        resolve_shape("x", ["N"], (MAX_INPUT_ELEMENTS + 1,), "--shape")


def test_feed_follows_shape_then_recipe_then_golden_then_model():
    inputs = [{"name": "x", "type": "tensor(float)", "shape": ["N", "F"]},
              {"name": "k", "type": "tensor(int64)", "shape": []},
              {"name": "s", "type": "tensor(string)", "shape": [2]}]
    golden = {"x": np.ones((3, 4), np.float32)}
    recipe = {"k": {"role": "constant", "value": 7}, "x": {"shape": [5, 4], "range": [2, 3]}}
    fed = make_feed(inputs, InputHints({"x": (2, 4)}, recipe, golden))
    assert fed["x"].shape == (2, 4) and fed["x"].min() >= 2 and fed["x"].max() <= 3
    assert fed["k"].dtype == np.int64 and int(fed["k"]) == 7
    assert fed["s"].tolist() == ["", ""]
    assert make_feed(inputs, InputHints({}, recipe, golden))["x"].shape == (5, 4)
    assert make_feed(inputs, InputHints({}, {}, golden))["x"] is golden["x"]
    with pytest.raises(UsageError, match="input x has dynamic dims"):
        make_feed(inputs, InputHints())
    with pytest.raises(UsageError, match="seq"):
        make_feed([{"name": "q", "type": "seq(tensor(float))", "shape": []}], InputHints())


def test_bench_dynamic_dims_without_a_shape_is_one_line_exit_2(tmp_path):
    model = dynamic_model(tmp_path / "dyn.onnx")
    result = run_cli("edgepack", "bench", str(model), "--runs", "2")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "input x has dynamic dims [N, 3, H, W]" in result.stderr and "--shape x=" in result.stderr
    ok = run_cli("edgepack", "bench", str(model), "--shape", "x=2x3x8x8", "--runs", "3", "--json")
    assert ok.returncode == 0, ok.stderr
    row = json.loads(ok.stdout)[0]
    assert row["shapes"] == {"x": [2, 3, 8, 8]} and row["p50_ms"] > 0
    wrong = run_cli("edgepack", "bench", str(model), "--shape", "x=2x4x8x8")
    assert wrong.returncode == 2 and "dim 1 fixed to 3" in wrong.stderr


def test_bench_takes_shapes_from_the_recipe(tmp_path):
    model = dynamic_model(tmp_path / "dyn.onnx")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: dyn\nversion: 1.0.0\nmodel: {path: dyn.onnx}\n"
                      "inputs: {x: {shape: [1, 3, 16, 16], range: [0, 1]}}\nvalidate: {data: synthetic}\n"
                      "targets: [x86]\n")
    result = run_cli("edgepack", "bench", str(model), "--recipe", str(recipe), "--runs", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["shapes"] == {"x": [1, 3, 16, 16]}


def test_bench_of_an_artifact_feeds_its_golden_sample(tmp_path, keypair):
    artifact = build_artifact(tmp_path / "a", keypair[0], extra="validate: {data: synthetic}\n")
    golden = packaged_model(artifact, None).golden
    assert list(golden) == ["x"]
    rows = bench(artifact, original=tmp_path / "a" / "model-1.0.0-2.0.onnx", runs=3)
    assert [r.label.split()[0] for r in rows] == ["original", "packaged"]
    assert rows[0].shapes == rows[1].shapes == {"x": list(golden["x"].shape)}
