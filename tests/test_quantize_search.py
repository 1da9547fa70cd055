"""Lossy builds judged by the task, on small onnx.helper models built here: a detector whose
int8 head collapses while its whole-tensor cosine stays above 0.99 (and whose float head the
search finds), a [1, T, C] sequence model measured per step, a state output left out with
validate.outputs, exclude_nodes globs, a precision that says what the graph holds; the search's
speed rule, target-derived types, budget and progress output.

Latency is the one thing not measured here: a timed assertion on a shared machine is noise.
The ``play_target`` fixture times candidates through the pass's seam
(``quantize.time_side_by_side``) as a target where int8 runs at a given fraction of fp32's
latency; everything else (quantization, calibration, sessions, judgement) is real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from sdk.errors import RecipeError, ValidationFailed
from sdk.packager import quant_search
from sdk.packager.passes import quantize
from sdk.packager.pipeline import build
from sdk.recipe import recipe_from_dict
from tests.conftest import run_cli

ANCHORS, CLASSES, FEATURES = 60, 3, 16


def _save(path: Path, nodes, inputs, outputs, inits) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _detector(path: Path) -> Path:
    """A YOLOv8-style head [1, 4 + classes, anchors]: boxes in pixels (cx, cy ~ 50..600) joined
    by Concat with sigmoid class scores, as the exported detectors of the issue are."""
    rng = np.random.default_rng(7)
    box_w = (rng.standard_normal((FEATURES, 4 * ANCHORS)) * 2).astype(np.float32)
    box_b = np.concatenate([rng.uniform(50, 600, (2, ANCHORS)), rng.uniform(20, 60, (2, ANCHORS))])
    score_w = (rng.standard_normal((FEATURES, CLASSES * ANCHORS)) * 0.8).astype(np.float32)
    inits = [numpy_helper.from_array(box_w, "box_w"), numpy_helper.from_array(score_w, "score_w"),
             numpy_helper.from_array(box_b.astype(np.float32)[None], "box_b"),
             numpy_helper.from_array(np.array([1, 4, ANCHORS], np.int64), "box_shape"),
             numpy_helper.from_array(np.array([1, CLASSES, ANCHORS], np.int64), "score_shape")]
    nodes = [helper.make_node("MatMul", ["x", "box_w"], ["bm"], name="backbone_box"),
             helper.make_node("Reshape", ["bm", "box_shape"], ["br"], name="head_box_reshape"),
             helper.make_node("Add", ["br", "box_b"], ["boxes"], name="head_box_add"),
             helper.make_node("MatMul", ["x", "score_w"], ["sm"], name="backbone_score"),
             helper.make_node("Reshape", ["sm", "score_shape"], ["sr"], name="head_score_reshape"),
             helper.make_node("Sigmoid", ["sr"], ["scores"], name="head_sigmoid"),
             helper.make_node("Concat", ["boxes", "scores"], ["out"], axis=1, name="head_concat")]
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])],
                 [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4 + CLASSES, ANCHORS])], inits)


def _detector_recipe(tmp_path: Path, **validate) -> dict:
    _detector(tmp_path / "det.onnx")
    x = np.random.default_rng(3).standard_normal((24, 1, FEATURES)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    return {"name": "det", "version": "1.0.0", "model": {"path": "det.onnx"},
            "quantize": {"mode": "static", "calibration": {"npz": "d.npz"}},
            "validate": {"data": {"npz": "d.npz"}, **validate}}


def _build(tmp_path: Path, doc: dict, keypair, name: str = "a"):
    return build(recipe_from_dict(doc, tmp_path), key_paths=[str(keypair[0])], output=tmp_path / f"{name}.edgepkg")


@pytest.fixture
def play_target(monkeypatch):
    """Time candidates as a target where a graph holding int8 runs at ``ratio`` times fp32's
    latency (fp32 1 ms); float candidates (fp16) run at fp32's speed. Returns the setter."""

    def play(ratio: float) -> None:
        def timing(fp32: Path, candidate: Path, feed) -> tuple[float, float]:
            holds_int8 = quantize.quantized_nodes(onnx.load(candidate, load_external_data=False)) > 0
            return 1e-3, 1e-3 * (ratio if holds_int8 else 1.0)

        monkeypatch.setattr(quantize, "time_side_by_side", timing)

    return play


def _artifact_model(result) -> onnx.ModelProto:
    import tarfile

    with tarfile.open(result.output) as tar:
        return onnx.load_from_string(tar.extractfile("model/model.onnx").read())


def test_a_collapsed_detector_head_fools_the_cosine_and_the_search_keeps_the_head_float(tmp_path, keypair,
                                                                                        play_target):
    play_target(0.5)
    fooled = _build(tmp_path, _detector_recipe(tmp_path, metric="cosine", min_cosine=0.99), keypair, "fooled")
    assert fooled.manifest.raw["model"]["precision"] == "int8", "the whole-tensor cosine lets the broken head through"
    first = fooled.report["passes"]["quantize"]["candidates"][0]
    assert first["task"]["outputs"][0]["cosine"] > 0.99 and first["stage"] == "requested"

    honest_doc = _detector_recipe(tmp_path)  # no metric named: the detection postprocess sets it
    honest_doc["postprocess"] = {"kind": "detection", "format": "yolov8"}
    honest = _build(tmp_path, honest_doc, keypair, "honest")
    report = honest.report["passes"]["quantize"]
    naive, head = report["candidates"]
    assert naive["metric"] == "detection" and naive["budget_met"] is False
    assert naive["task"]["outputs"][0]["recall"] < 0.5, "one uint8 scale over pixels and scores"
    assert head["stage"] == "float head" and head["budget_met"] is True and head["ships"] is True
    assert head["kept_float"]["head"] == ["head_box_reshape", "head_box_add", "head_score_reshape",
                                          "head_sigmoid", "head_concat"]
    assert head["kept_float"]["wide-range concat"] == ["out"] and head["quantized_nodes"] > 0
    assert report["sensitivity"]["wide_range_concats"][0]["tensor"] == "out"
    assert honest.manifest.raw["model"]["precision"] == "int8" and report["applied"] is True
    validate = honest.report["passes"]["validate"]
    assert validate["metric"] == "detection" and validate["task"]["outputs"][0]["recall"] >= 0.95
    assert all(e["bytes"] > 0 and e["latency_ms"] > 0 and "speedup" in e for e in report["candidates"])


def _sequence_model(path: Path) -> Path:
    """logits [1, 10, 3] = x @ W: classes 0 and 1 differ by 1e-5 (one fp16 value), class 2 is
    clear. Steps fed e_0 tie in fp16 (fp32 picks class 1); steps fed e_1 pick class 2 in both."""
    weight = np.array([[1.0, 1.0 + 1e-5, 0.0], [0.0, 0.0, 2.0], [0, 0, 0], [0, 0, 0]], np.float32)
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["logits"], name="proj")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10, 4])],
                 [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10, 3])],
                 [numpy_helper.from_array(weight, "w")])


def test_a_sequence_model_is_judged_per_step_and_the_cli_names_the_output_and_the_shortfall(tmp_path, keypair):
    _sequence_model(tmp_path / "seq.onnx")
    x = np.zeros((1, 10, 4), np.float32)
    x[0, :3, 1] = 1.0   # 3 clear steps
    x[0, 3:, 0] = 1.0   # 7 near-tie steps that fp16 flips
    np.savez(tmp_path / "d.npz", x=x)
    doc = {"name": "seq", "version": "1.0.0", "model": {"path": "seq.onnx"}, "optimize": {"fp16": True},
           "postprocess": {"kind": "ctc", "blank": 0}, "validate": {"data": {"npz": "d.npz"}}}
    with pytest.raises(ValidationFailed, match=r"output logits: per-step agreement 0\.3 \(required >= 0\.99\), "
                                               r"decoded strings equal 0\.00%, short by 0\.69"):
        _build(tmp_path, doc, keypair)
    (tmp_path / "seq.yaml").write_text(yaml.safe_dump(doc))
    result = run_cli("edgepack", "build", str(tmp_path / "seq.yaml"), "--key", str(keypair[0]),
                     "-o", str(tmp_path / "cli.edgepkg"))
    assert result.returncode == 1 and not (tmp_path / "cli.edgepkg").exists()
    assert result.stderr.strip().count("\n") == 0 and "output logits: per-step agreement 0.3" in result.stderr
    doc["validate"]["min_agreement"] = 0.3
    report = _build(tmp_path, doc, keypair).report["passes"]["validate"]
    task = report["task"]["outputs"][0]
    assert report["budget_met"] is True and report["metric"] == "sequence"
    assert (task["steps"], task["sequences"], task["string_match"]) == (10, 1, 0.0)


def test_min_string_match_fails_a_build_whose_steps_keep_the_budget_and_needs_ctc_strings(tmp_path, keypair):
    """validate.min_string_match gates the decoded strings in the validate pass too (an fp16
    build is judged there), and a build whose metric has no strings refuses the key."""
    _sequence_model(tmp_path / "seq.onnx")
    x = np.zeros((1, 10, 4), np.float32)
    x[0, :3, 1] = 1.0
    x[0, 3:, 0] = 1.0
    np.savez(tmp_path / "d.npz", x=x)
    doc = {"name": "seq", "version": "1.0.0", "model": {"path": "seq.onnx"}, "optimize": {"fp16": True},
           "postprocess": {"kind": "ctc", "blank": 0},
           "validate": {"data": {"npz": "d.npz"}, "min_agreement": 0.3, "min_string_match": 0.5}}
    with pytest.raises(ValidationFailed, match=r"output logits: string match 0 \(required >= 0\.5\), short by 0\.5$"):
        _build(tmp_path, doc, keypair)
    doc["postprocess"] = {"kind": "raw"}
    doc["validate"]["metric"] = "sequence"
    with pytest.raises(RecipeError, match=r"validate\.min_string_match.*ctc postprocess.*judged by sequence "
                                          r"with postprocess raw"):
        _build(tmp_path, doc, keypair)


def _stateful(path: Path) -> Path:
    """output = 2x (exact in fp16); stateN = 1.0001x (fp16 rounds the factor to 1)."""
    return _save(path, [helper.make_node("Mul", ["x", "two"], ["output"]),
                        helper.make_node("Mul", ["x", "drift"], ["stateN"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                 [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 8]),
                  helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [1, 8])],
                 [numpy_helper.from_array(np.float32([2.0]), "two"),
                  numpy_helper.from_array(np.float32([1.0001]), "drift")])


@pytest.mark.parametrize(("outputs", "passes"), [(None, False), (["output"], True)])
def test_validate_outputs_leaves_a_state_output_out(tmp_path, keypair, outputs, passes):
    _stateful(tmp_path / "s.onnx")
    np.savez(tmp_path / "d.npz", x=(np.arange(16, dtype=np.float32).reshape(2, 1, 8) / 8))
    validate = {"data": {"npz": "d.npz"}, "metric": "max_abs", "max_abs": 1e-6}
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"}, "optimize": {"fp16": True},
           "validate": {**validate, **({"outputs": outputs} if outputs else {})}}
    if not passes:
        with pytest.raises(ValidationFailed, match=r"output stateN: max abs diff"):
            _build(tmp_path, doc, keypair)
        return
    report = _build(tmp_path, doc, keypair).report["passes"]["validate"]
    assert [o["output"] for o in report["task"]["outputs"]] == ["output"] and report["budget_met"]


def test_validate_outputs_refuses_a_name_the_model_does_not_have(tmp_path, keypair):
    _stateful(tmp_path / "s.onnx")
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"},
           "validate": {"data": "synthetic", "outputs": ["output", "state"]}}
    with pytest.raises(RecipeError, match=r"validate\.outputs: the model has no output named 'state' "
                                          r"\(outputs: output, stateN\)"):
        _build(tmp_path, doc, keypair)


def _int8_weight(model: onnx.ModelProto, node_name: str) -> bool:
    """Whether the node's weight (input 1) comes out of a DequantizeLinear (its activation
    input is shared with a quantized node, which quantizes it for both)."""
    producers = {out: node.op_type for node in model.graph.node for out in node.output}
    node = next(n for n in model.graph.node if n.name == node_name)
    return producers.get(node.input[1]) == "DequantizeLinear"


def test_exclude_nodes_takes_globs_and_refuses_a_pattern_matching_nothing(tmp_path, keypair, play_target):
    play_target(0.5)
    doc = _detector_recipe(tmp_path, metric="cosine", min_cosine=0.9)
    doc["quantize"].update(exclude_nodes=["backbone_s*"], search=False)
    result = _build(tmp_path, doc, keypair)
    report = result.report["passes"]["quantize"]
    assert report["requested"]["excluded_nodes"] == ["backbone_score"]
    assert report["candidates"][0]["kept_float"] == {"recipe": ["backbone_score"]}
    model = _artifact_model(result)
    assert _int8_weight(model, "backbone_box") and not _int8_weight(model, "backbone_score")

    doc["quantize"]["exclude_nodes"] = ["backbone_*", "neck_*"]
    with pytest.raises(RecipeError, match=r"quantize\.exclude_nodes: 'neck_\*' matches no node of the model"):
        _build(tmp_path, doc, keypair, "b")


def test_dynamic_int8_that_quantized_nothing_ships_as_fp32(tmp_path, keypair):
    _stateful(tmp_path / "s.onnx")  # Mul only: nothing dynamic quantization touches
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"}, "quantize": {"mode": "dynamic"},
           "validate": {"data": "synthetic"}}
    result = _build(tmp_path, doc, keypair)
    assert result.manifest.raw["model"]["precision"] == "fp32"
    report = result.report["passes"]["quantize"]
    assert report["applied"] is False and report["candidates"][0]["quantized_nodes"] == 0
    assert [e["verdict"] for e in report["candidates"]] == ["changed no node of the graph"], \
        "a later int8 candidate (a subset of the first) would change nothing either"
    assert "quantization changed no node of the graph (nothing it quantizes is there); shipping fp32" in result.warnings


def test_a_search_in_a_non_tty_log_prints_one_line_per_candidate(tmp_path, keypair):
    doc = _detector_recipe(tmp_path, metric="max_abs", max_abs=0.0)  # no int8 candidate reaches it
    (tmp_path / "det.yaml").write_text(yaml.safe_dump(doc))
    result = run_cli("edgepack", "build", str(tmp_path / "det.yaml"), "--key", str(keypair[0]),
                     "-o", str(tmp_path / "log.edgepkg"), timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stderr.splitlines() if "candidate" in line]
    total = len(lines)
    assert total >= 2 and all(line.startswith(f"quantize: candidate {n}/{total} (") for n, line in
                              enumerate(lines, start=1)), "one verdict line per candidate, numbered of the total"
    assert all("misses the budget" in line and "bytes" in line and " ms (" in line for line in lines)
    assert lines[0].startswith(f"quantize: candidate 1/{total} (static minmax per-channel) misses")
    assert "head" in lines[1] and "wide-range concat" in lines[1]
    assert "trying" not in result.stderr and "quantize ..." not in result.stderr and "\r" not in result.stderr


def test_a_terminal_gets_a_bar_per_candidate_redrawn_in_place(tmp_path, keypair):
    import os
    import pty
    import subprocess

    from tests.conftest import cli

    doc = _detector_recipe(tmp_path, metric="max_abs", max_abs=0.0)
    doc["quantize"]["max_candidates"] = 2
    (tmp_path / "det.yaml").write_text(yaml.safe_dump(doc))
    leader, follower = pty.openpty()
    with subprocess.Popen([cli("edgepack"), "build", str(tmp_path / "det.yaml"), "--key", str(keypair[0]),
                           "-o", str(tmp_path / "tty.edgepkg")], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=follower, env={**os.environ, "PYTHONWARNINGS": "ignore"}
                          ) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end closed: the build is done
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=300) == 0
    os.close(leader)
    text = b"".join(chunks).decode()
    bars = [part for part in text.split("\r\x1b[K") if part.lstrip().startswith("quantize: trying candidate")]
    second = [bar.split(" [")[1].split("]")[0] for bar in bars
              if bar.lstrip().startswith("quantize: trying candidate 2/2")]
    assert second == ["--------------------", "########------------", "##############------"], \
        "quantizing, judging, timing"
    assert all("\n" not in bar for bar in bars), "a bar is redrawn, never scrolled"
    assert "quantize: candidate 1/2 (static minmax per-channel) misses the budget" in text
    assert "search stopped: quantize.max_candidates 2 reached" in text


def test_a_detection_metric_on_an_output_that_is_no_detection_head_is_one_error_naming_the_key(tmp_path, keypair):
    _stateful(tmp_path / "s.onnx")  # outputs [1, 8]: no [batch, 4 + classes, anchors] head
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"}, "optimize": {"fp16": True},
           "validate": {"data": "synthetic", "metric": "detection", "outputs": ["output"]}}
    with pytest.raises(RecipeError, match=r"validate\.metric: metric detection cannot read output output: a yolov8 "
                                          r"output is \[batch, 4 \+ classes, anchors\], got shape \[1, 8\]"):
        _build(tmp_path, doc, keypair)


def _fast_detector_doc(tmp_path: Path, **quantize_options) -> dict:
    """The detector judged by cosine 0.9 (int8 keeps it), the requested settings only."""
    doc = _detector_recipe(tmp_path, metric="cosine", min_cosine=0.9)
    doc["quantize"].update(search=False, **quantize_options)
    return doc


@pytest.mark.parametrize(("ratio", "options", "ships"), [
    (1.25, {}, False),                    # int8 at 0.8x fp32: slower
    (1.0, {}, False),                     # exactly as fast: not faster
    (0.99, {}, True),                     # 1.01x
    (1.25, {"min_speedup": 0.8}, False),  # at the limit: needs more than 0.8x
    (1.25, {"min_speedup": 0.79}, True),  # a recipe that accepts a slower int8 model
])
def test_int8_that_is_not_faster_than_fp32_does_not_ship(tmp_path, keypair, play_target, ratio, options, ships):
    play_target(ratio)
    result = _build(tmp_path, _fast_detector_doc(tmp_path, **options), keypair)
    report = result.report["passes"]["quantize"]
    entry = report["candidates"][0]
    assert entry["budget_met"] is True and entry["speedup"] == round(1 / ratio, 3)
    assert report["latency_on"].startswith("CPUExecutionProvider on the build host, the proxy for the targets' ")
    assert report["min_speedup"] == options.get("min_speedup", 1.0)
    assert result.manifest.raw["model"]["precision"] == ("int8" if ships else "fp32")
    assert report["applied"] is ships and entry["ships"] is ships
    if ships:
        slower = [w for w in result.warnings if "slower than fp32" in w]
        assert bool(slower) == (ratio > 1.0)
        return
    assert entry["verdict"] == "meets the budget but is not faster than fp32"
    assert result.warnings == [
        "int8 kept the accuracy budget but was not faster than fp32 on the build host's CPU provider, the proxy for "
        f"the target's (best {1 / ratio:.2f}x, quantize.min_speedup {options.get('min_speedup', 1.0):g}); "
        "shipping fp32"]


def _activation_zero_points(model: onnx.ModelProto) -> set[str]:
    """The element types of the zero points of QuantizeLinear nodes on activations."""
    inits = {i.name: i for i in model.graph.initializer}
    return {onnx.helper.tensor_dtype_to_np_dtype(inits[n.input[2]].data_type).name for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


@pytest.mark.parametrize(("targets", "preset", "activations"), [
    (["jetson"], None, {"int8"}),         # TensorRT: symmetric s8
    (["rpi"], None, {"uint8"}),           # arm64: u8 activations, s8 weights
    (["rpi", "jetson"], None, {"int8"}),  # one artifact for both: what TensorRT takes
    (["jetson"], "arm64", {"uint8"}),     # the recipe's preset wins
])
def test_activation_types_follow_the_target(tmp_path, keypair, play_target, targets, preset, activations):
    play_target(0.5)
    doc = _fast_detector_doc(tmp_path, **({"preset": preset} if preset else {}))
    doc["targets"] = targets
    result = _build(tmp_path, doc, keypair)
    report = result.report["passes"]["quantize"]
    assert report["preset"] == (preset or quant_search.preset_for_targets(targets, ())[0])
    assert report["preset_from"] == ("quantize.preset" if preset else quant_search.preset_for_targets(targets, ())[1])
    assert _activation_zero_points(_artifact_model(result)) == activations
    assert report["requested"]["activation_type"] == activations.copy().pop()


def test_an_x86_build_takes_the_preset_of_the_build_hosts_cpu(tmp_path, keypair, play_target):
    play_target(0.5)
    report = _build(tmp_path, _fast_detector_doc(tmp_path), keypair).report["passes"]["quantize"]
    host = quantize.read_cpu_flags()
    assert report["preset"] == quant_search.x86_preset(host)
    assert report["preset_from"] == quant_search.preset_for_targets(["x86"], host)[1]
    assert report["requested"]["reduce_range"] is (report["preset"] == "x86-avx2")


def test_an_unreadable_cpuinfo_means_no_vnni(tmp_path):
    assert quantize.read_cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "cpuinfo").write_text("flags\t: avx2 avx512_vnni\n")
    assert quant_search.x86_preset(quantize.read_cpu_flags(tmp_path / "cpuinfo")) == "x86-vnni"


@pytest.mark.parametrize(("options", "tried", "stopped"), [
    ({"max_candidates": 2}, 2, "quantize.max_candidates 2 reached"),
    ({"max_search_s": 0.001}, 1, "quantize.max_search_s 0.001 s spent"),
])
def test_the_search_stops_at_its_budget_and_says_so(tmp_path, keypair, options, tried, stopped):
    doc = _detector_recipe(tmp_path, metric="max_abs", max_abs=0.0)
    doc["quantize"].update(options)
    result = _build(tmp_path, doc, keypair)
    report = result.report["passes"]["quantize"]
    assert len(report["candidates"]) == tried and report["stopped"].startswith(stopped)
    assert report["search_s"] > 0 and report["applied"] is False
    warning = next(w for w in result.warnings if "could not meet the accuracy budget" in w)
    assert f"; search stopped: {stopped}" in warning and warning.endswith("; shipping fp32")
