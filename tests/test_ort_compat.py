"""The minimum onnxruntime of an artifact (pure rules, pinned at their boundaries) and the agent's
refusal of an artifact that needs a newer onnxruntime than the device has."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from edgepack_core.ort_compat import (
    COMPATIBILITY,
    ORT_FORMAT_READERS,
    RuntimeRow,
    RuntimeTooOld,
    ort_format_version,
    parse_version,
    required_onnxruntime,
    runtime_refusal,
    satisfies,
    target_shortfalls,
    unsupported_domains,
)
from edgepack_core.targets import PROFILE_ONNXRUNTIME, PROFILES, profile_onnxruntime
from tests.artifacts import build_artifact, resign_with_changes
from tests.conftest import run_cli

HOST = ".".join(ort.__version__.split(".")[:3])


def _need(opsets=None, ops=(), ort_format=False, **kw):
    return required_onnxruntime(opsets or {}, set(ops), ort_format, **kw)


@pytest.mark.parametrize(("opset", "version"), [
    (7, "1.0.0"), (11, "1.0.0"), (12, "1.3.0"), (13, "1.6.0"), (15, "1.9.0"), (16, "1.11.0"), (17, "1.12.0"),
    (18, "1.14.0"), (19, "1.15.0"), (20, "1.17.0"), (21, "1.18.0"), (22, "1.21.0"), (23, "1.23.0"), (24, "1.24.1"),
    (25, "1.24.1"), (26, "1.25.0"),
])
def test_default_domain_opset_boundaries_follow_onnxruntimes_table(opset, version):
    assert _need({"": opset}) == (version, f"opset {opset} (ai.onnx)")
    assert _need({"ai.onnx": opset})[0] == version, "'' and 'ai.onnx' are the same domain"


@pytest.mark.parametrize(("ml", "version"), [(1, "1.0.0"), (2, "1.0.0"), (3, "1.12.0"), (4, "1.17.0"),
                                               (5, "1.21.0")])
def test_ml_opset_boundaries(ml, version):
    assert _need({"ai.onnx.ml": ml}) == (version, f"opset {ml} (ai.onnx.ml)")


@pytest.mark.parametrize(("ir", "version"), [(6, "1.0.0"), (7, "1.3.0"), (8, "1.9.0"), (9, "1.16.0"), (10, "1.18.0"),
                                         (11, "1.23.0"), (12, "1.24.1"), (13, "1.24.1")])
def test_ir_version_boundaries(ir, version):
    assert _need({"": 7}, ir_version=ir)[0] == version


def test_the_newest_requirement_wins_and_is_named():
    assert _need({"": 17, "ai.onnx.ml": 4}, ir_version=8) == ("1.17.0", "opset 4 (ai.onnx.ml)")
    assert _need({"": 13}, [("com.microsoft", "QuickGelu"), ("", "Relu")]) == \
        ("1.15.0", "contrib op com.microsoft.QuickGelu")
    assert _need({"": 13}, [("com.microsoft", "MatMulNBits")])[0] == "1.17.0"
    assert _need({"": 17}, [("com.microsoft", "FusedConv")]) == ("1.12.0", "opset 17 (ai.onnx)")


def test_opsets_beyond_the_table_need_a_known_newer_row():
    with pytest.raises(RuntimeTooOld, match=r"opset 27 \(ai.onnx\) is newer than any onnxruntime Edgepack knows"):
        _need({"": 27})
    host = RuntimeRow("1.32.0", 28, 5, 14)
    assert _need({"": 27}, extra_rows=[host]) == ("1.32.0", "opset 27 (ai.onnx)")
    assert _need({"": 22}, extra_rows=[host])[0] == "1.21.0", "a host row never raises what the table settles"
    assert _need({"": 17}, ir_version=14, extra_rows=[host])[0] == "1.32.0"
    with pytest.raises(RuntimeTooOld):
        _need({"": 29}, extra_rows=[host])


def test_unknown_contrib_op_needs_the_building_runtime_or_is_refused():
    assert _need({"": 17}, [("com.microsoft", "BrandNewOp")], builder="1.32.0")[0] == "1.32.0"
    with pytest.raises(RuntimeTooOld, match="BrandNewOp"):
        _need({"": 17}, [("com.microsoft", "BrandNewOp")])


def test_onnxruntime_internal_layout_ops_need_the_building_runtime():
    assert _need({"": 17}, [("com.microsoft.nchwc", "Conv")], builder="1.32.0") == \
        ("1.32.0", "onnxruntime-internal op com.microsoft.nchwc.Conv (not in Edgepack's table: the building "
                   "onnxruntime is the oldest proven to run it)")


def test_ort_format_versions():
    assert _need({"": 17}, ort_format=True, ort_format_version="6") == ("1.16.0", "the .ort format version 6")
    assert _need({"": 17}, ort_format=True, ort_format_version="5")[0] == "1.13.0" == ORT_FORMAT_READERS["5"]
    assert _need({"": 17}, ort_format=True, ort_format_version="9", builder="1.32.1")[0] == "1.32.1"
    with pytest.raises(RuntimeTooOld):
        _need({"": 17}, ort_format=True, ort_format_version="9")
    assert _need({"": 17}, ort_format=False, ort_format_version="9")[0] == "1.12.0", "no .ort file, no rule"


def test_ort_format_version_is_read_from_a_real_file(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(tmp_path / "m.onnx"),
                    "--optimization_style", "Fixed"], check=True, capture_output=True, timeout=300)
    data = (tmp_path / "m.ort").read_bytes()
    assert ort_format_version(data) in ORT_FORMAT_READERS, "this onnxruntime writes a format the table knows"


@pytest.mark.parametrize("data", [b"", b"x" * 40, b"\x00\x00\x00\x00ORTM" + b"\x00" * 4,
                                  b"\xff\xff\xff\x7fORTM" + b"\x00" * 8,
                                  b"\x0c\x00\x00\x00ORTM\x00\x00\x00\x00\xf0\xff\xff\xff" + b"\x00" * 8])
def test_ort_format_version_of_hostile_bytes_is_none(data):
    assert ort_format_version(data) is None


def test_version_comparison_boundaries():
    assert satisfies("1.16.0", "1.16.0") and satisfies("1.16.3", "1.16.0") and satisfies("1.20", "1.18.0")
    assert not satisfies("1.15.1", "1.16.0") and not satisfies("1.16.0", "1.16.1")
    assert satisfies("1.18.0+cu118", "1.18.0"), "local build suffixes (JetPack, CUDA wheels) are ignored"
    assert parse_version("1.9") == (1, 9, 0) and parse_version("1.10.0") > parse_version("1.9.9")
    with pytest.raises(ValueError):
        parse_version("latest")


def test_runtime_refusal_is_one_line_naming_both_versions():
    assert runtime_refusal("scale 1.0.0", "1.16.0", "1.16.0") is None
    line = runtime_refusal("scale 1.0.0", "1.18.0", "1.17.3")
    assert line == "scale 1.0.0 needs onnxruntime >= 1.18.0, but this device has onnxruntime 1.17.3"
    assert "not a version" in runtime_refusal("scale 1.0.0", "soon", "1.17.3")


def test_target_shortfalls_name_each_target_that_is_too_old():
    runtimes = {"rpi": "1.16.0", "jetson": "1.16.0", "x86": "1.32.0"}
    assert target_shortfalls("1.16.0", "opset 19 (ai.onnx)", runtimes) == []
    lines = target_shortfalls("1.17.0", "opset 20 (ai.onnx)", runtimes)
    assert lines == ["target jetson runs onnxruntime 1.16.0, but opset 20 (ai.onnx) needs onnxruntime >= 1.17.0",
                     "target rpi runs onnxruntime 1.16.0, but opset 20 (ai.onnx) needs onnxruntime >= 1.17.0"]


def test_every_profile_names_its_onnxruntime():
    assert set(PROFILE_ONNXRUNTIME) == set(PROFILES)
    assert profile_onnxruntime("rpi", "1.32.0") == "1.16.0" and profile_onnxruntime("jetson", "1.32.0") == "1.16.0"
    assert profile_onnxruntime("x86", "1.32.0") == "1.32.0", "x86 follows pip's current release: the build host's"
    assert [r.version for r in COMPATIBILITY] == sorted((r.version for r in COMPATIBILITY), key=parse_version)


def test_unsupported_domains():
    assert unsupported_domains(["", "ai.onnx", "ai.onnx.ml", "com.microsoft"]) == []
    assert unsupported_domains(["org.pytorch.aten", "", "custom"]) == ["custom", "org.pytorch.aten"]


# ---------------------------------------------------------------- the agent's refusal

def test_agent_refuses_an_artifact_needing_a_newer_onnxruntime_in_one_line(tmp_path, keypair):
    private, public = keypair
    built = build_artifact(tmp_path / "b", private)
    needs_newer = resign_with_changes(built, tmp_path / "newer.edgepkg", private,
                                      manifest_changes={"model": {**_manifest_model(built),
                                                                  "min_onnxruntime": "99.0.0"}})
    np.save(tmp_path / "x.npy", np.ones((1, 4), np.float32))
    refused = run_cli("edgepack-agent", "predict", "--artifact", str(needs_newer), "--trust", str(public),
                      "--input", str(tmp_path / "x.npy"))
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "scale 1.0.0 needs onnxruntime >= 99.0.0" in lines[0] and f"onnxruntime {ort.__version__}" in lines[0]
    # The same artifact as built (its real minimum) runs.
    ok = run_cli("edgepack-agent", "predict", "--artifact", str(built), "--trust", str(public),
                 "--input", str(tmp_path / "x.npy"), "--json")
    assert ok.returncode == 0, ok.stderr


def _manifest_model(artifact) -> dict:
    import json
    import tarfile

    with tarfile.open(artifact) as tar:
        return json.loads(tar.extractfile("manifest.json").read())["model"]


def test_built_manifest_records_the_real_minimum(tmp_path, keypair):
    private, _ = keypair
    model = _manifest_model(build_artifact(tmp_path, private))
    assert model["min_onnxruntime"] == "1.12.0" and model["opsets"] == {"ai.onnx": 17} and model["opset"] == 17
    assert satisfies(HOST, model["min_onnxruntime"])
