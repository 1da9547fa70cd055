"""The host CLI as a user meets it: real subprocesses, real files, one clear line per failure."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import run_cli


def _matmul_model(path: Path, opset: int = 17) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], np.linspace(-1, 1, 12, dtype=np.float32).tolist())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture()
def project(tmp_path, keypair) -> Path:
    _matmul_model(tmp_path / "model.onnx")
    (tmp_path / "labels.txt").write_text("cat\ndog\nbird\n")
    # Recipe paths stay inside the recipe's folder: the key is copied next to it (0600).
    (tmp_path / "release.key").write_bytes(keypair[0].read_bytes())
    (tmp_path / "release.key").chmod(0o600)
    # Four samples of x [batch, 4]: a stack along a new leading axis, each of batch 1.
    np.savez(tmp_path / "samples.npz", x=np.random.default_rng(3).standard_normal((4, 1, 4)).astype(np.float32))
    (tmp_path / "recipe.yaml").write_text(
        "name: tiny\nversion: 1.0.0\nmodel: {path: model.onnx}\n"
        "postprocess: {kind: topk, k: 2, labels: labels.txt}\ntargets: [x86, rpi]\n"
        "validate: {data: {npz: samples.npz}}\n"
        "sign: {key: release.key}\noutput: dist/tiny.edgepkg\n"
    )
    return tmp_path


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {result.stderr!r}"
    assert "Traceback" not in result.stderr
    return lines[0]


def test_keygen_cli_writes_0600_and_refuses_overwrite(tmp_path):
    private, public = tmp_path / "a.key", tmp_path / "a.pub"
    first = run_cli("edgepack", "keygen", "--private", str(private), "--public", str(public))
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    before = private.read_bytes()
    again = run_cli("edgepack", "keygen", "--private", str(private), "--public", str(public))
    assert again.returncode == 1
    assert "already exists" in _one_error_line(again)
    assert private.read_bytes() == before
    forced = run_cli("edgepack", "keygen", "--private", str(private), "--public", str(public), "--force")
    assert forced.returncode == 0 and private.read_bytes() != before


def test_build_verify_inspect_round_trip(project, keypair):
    built = run_cli("edgepack", "build", str(project / "recipe.yaml"), cwd=project)
    assert built.returncode == 0, built.stderr
    artifact = project / "dist" / "tiny.edgepkg"
    assert artifact.exists()
    verified = run_cli("edgepack", "verify", str(artifact), "--trust", str(keypair[1]))
    assert verified.returncode == 0 and verified.stdout.startswith("OK")

    shown = run_cli("edgepack", "inspect", str(artifact), "--trust", str(keypair[1]), "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    manifest = view["manifest"]
    assert view["verified"] is True and view["verified_by"] == view["signature_key_ids"][0]
    assert manifest["name"] == "tiny" and manifest["version"] == "1.0.0"
    assert manifest["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    assert manifest["postprocess"]["labels"] == "assets/labels.txt"
    assert set(manifest["targets"]) == {"x86", "rpi"}
    assert len(manifest["golden"]["samples"]) == 4
    assert "golden" in view["report"]["passes"]

    human = run_cli("edgepack", "inspect", str(artifact))
    assert human.returncode == 0
    for needle in ("tiny 1.0.0", "not verified", "model/model.onnx", "x  ", "float32", "golden"):
        assert needle in human.stdout


def test_golden_outputs_match_the_model(project):
    run_cli("edgepack", "build", str(project / "recipe.yaml"), check=True, cwd=project)
    with tarfile.open(project / "dist" / "tiny.edgepkg") as tar:
        model = onnx.load_from_string(tar.extractfile("model/model.onnx").read())
        import io

        inputs = np.load(io.BytesIO(tar.extractfile("golden/000.inputs.npz").read()))
        outputs = np.load(io.BytesIO(tar.extractfile("golden/000.outputs.npz").read()))
    weights = onnx.numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(inputs["x"] @ weights, outputs["y"], rtol=1e-5)


def _tamper(artifact: Path, out: Path) -> Path:
    with tarfile.open(artifact) as src, tarfile.open(out, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name == "model/model.onnx":
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            import io

            dst.addfile(member, io.BytesIO(data))
    return out


def test_verify_refuses_tampered_artifact_with_one_line(project, keypair, tmp_path):
    run_cli("edgepack", "build", str(project / "recipe.yaml"), check=True, cwd=project)
    evil = _tamper(project / "dist" / "tiny.edgepkg", tmp_path / "evil.edgepkg")
    result = run_cli("edgepack", "verify", str(evil), "--trust", str(keypair[1]))
    assert result.returncode == 1
    assert "model/model.onnx: sha256 differs" in _one_error_line(result)


def test_verify_refuses_untrusted_key(project, tmp_path):
    run_cli("edgepack", "build", str(project / "recipe.yaml"), check=True, cwd=project)
    run_cli("edgepack", "keygen", "--private", str(tmp_path / "o.key"), "--public", str(tmp_path / "o.pub"),
            check=True)
    result = run_cli("edgepack", "verify", str(project / "dist" / "tiny.edgepkg"), "--trust", str(tmp_path / "o.pub"))
    assert result.returncode == 1
    assert "untrusted key" in _one_error_line(result)


@pytest.mark.parametrize(
    ("edit", "expected_code", "needle"),
    [
        (lambda t: t.replace("targets:", "colour: red\ntargets:"), 2, "colour: unknown key"),
        (lambda t: t.replace("k: 2", "k: two"), 2, "postprocess.k"),
        (lambda t: t.replace("model.onnx", "missing.onnx"), 2, "model.path: missing.onnx does not exist"),
        (lambda t: t.replace("version: 1.0.0", "version: one"), 2, "version"),
        (lambda t: t.replace("targets: [x86, rpi]", "targets: [x86, toaster]"), 2, "targets[1]"),
    ],
)
def test_build_with_recipe_mistake_fails_with_one_line(project, edit, expected_code, needle):
    recipe = project / "recipe.yaml"
    recipe.write_text(edit(recipe.read_text()))
    result = run_cli("edgepack", "build", str(recipe), cwd=project)
    assert result.returncode == expected_code
    assert needle in _one_error_line(result)
    assert not (project / "dist").exists(), "a failed build must not leave an artifact"


def test_build_with_unsupported_opset_fails_clearly(project):
    _matmul_model(project / "model.onnx", opset=99)
    result = run_cli("edgepack", "build", str(project / "recipe.yaml"), cwd=project)
    assert result.returncode == 1
    assert "model.onnx: opset 99 (ai.onnx) is newer than any onnxruntime Edgepack knows" in _one_error_line(result)


def test_build_with_corrupt_model_fails_clearly(project):
    (project / "model.onnx").write_bytes(b"this is not a protobuf at all \xff\xfe")
    result = run_cli("edgepack", "build", str(project / "recipe.yaml"), cwd=project)
    assert result.returncode == 1
    assert "cannot be loaded as ONNX" in _one_error_line(result)


def test_build_without_key_fails_clearly(project):
    recipe = project / "recipe.yaml"
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines() if not line.startswith("sign:")))
    result = run_cli("edgepack", "build", str(recipe), cwd=project)
    assert result.returncode == 2
    assert "no signing key" in _one_error_line(result)


def test_schema_command_prints_the_recipe_json_schema():
    result = run_cli("edgepack", "schema", "recipe")
    schema = json.loads(result.stdout)
    assert schema["required"] == ["name", "version", "model"]
    assert schema["additionalProperties"] is False


def test_inspect_netron_without_netron_gives_a_clear_hint(project):
    import importlib.util

    run_cli("edgepack", "build", str(project / "recipe.yaml"), check=True, cwd=project)
    result = run_cli("edgepack", "inspect", str(project / "dist" / "tiny.edgepkg"), "--netron")
    assert importlib.util.find_spec("netron") is None, "this test needs an environment without netron (as CI)"
    assert result.returncode == 1
    assert "pip install netron" in _one_error_line(result)
