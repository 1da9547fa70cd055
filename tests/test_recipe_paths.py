"""Recipes that cannot leak the host: every path stays in the recipe's folder (symlinks
resolved) unless the build allows external paths; build never replaces a file that is not an
artifact without --force, and warns about a private key others can read."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from sdk.errors import RecipeError
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe, recipe_from_dict
from tests.conftest import run_cli


def _model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


@pytest.fixture()
def project(tmp_path, keypair) -> Path:
    folder = tmp_path / "project"
    _model(folder / "model.onnx")
    (folder / "release.key").write_bytes(keypair[0].read_bytes())
    (folder / "release.key").chmod(0o600)
    (folder / "labels.txt").write_text("a\nb\nc\n")
    return folder


def _recipe(folder: Path, **extra: object) -> dict:
    return {"name": "p", "version": "1.0.0", "model": {"path": "model.onnx"}, "validate": {"data": "synthetic"},
            "targets": ["x86"], **extra}


def _one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_labels_etc_passwd_is_refused_naming_the_key(project):
    with pytest.raises(RecipeError, match=r"postprocess\.labels: /etc/passwd resolves to /etc/passwd, outside the "
                                          r"recipe's folder"):
        recipe_from_dict(_recipe(project, postprocess={"kind": "topk", "k": 1, "labels": "/etc/passwd"}), project)


def test_output_dotdot_elsewhere_file_is_refused_naming_the_key(project):
    victim = project.parent / "elsewhere" / "file"
    victim.parent.mkdir()
    victim.write_text("precious")
    with pytest.raises(RecipeError, match=r"^.*output: \.\./elsewhere/file resolves to .*outside the recipe's folder"):
        recipe_from_dict(_recipe(project, output="../elsewhere/file"), project)
    assert victim.read_text() == "precious"


def test_labels_etc_passwd_through_the_cli_is_one_line_exit_2_and_no_artifact(project):
    (project / "r.yaml").write_text("name: p\nversion: 1.0.0\nmodel: {path: model.onnx}\n"
                                    "postprocess: {kind: topk, k: 1, labels: /etc/passwd}\n"
                                    "validate: {data: synthetic}\noutput: out.edgepkg\n")
    result = run_cli("edgepack", "build", str(project / "r.yaml"), "--key", str(project / "release.key"))
    assert result.returncode == 2
    assert "postprocess.labels" in _one_line(result) and "--allow-external-paths" in result.stderr
    assert not (project / "out.edgepkg").exists()


def test_symlinked_model_escaping_the_folder_is_refused(project, tmp_path):
    outside = _model(tmp_path / "secret" / "model.onnx")
    (project / "link.onnx").symlink_to(outside)
    with pytest.raises(RecipeError, match=r"model\.path: link\.onnx resolves to .*secret/model\.onnx, outside"):
        recipe_from_dict(_recipe(project, model={"path": "link.onnx"}), project)


def test_symlinked_folder_escaping_the_folder_is_refused(project, tmp_path):
    (tmp_path / "host-data").mkdir()
    np.savez(tmp_path / "host-data" / "d.npz", x=np.zeros((1, 3), np.float32))
    (project / "data").symlink_to(tmp_path / "host-data", target_is_directory=True)
    with pytest.raises(RecipeError, match=r"validate\.data\.npz: data/d\.npz resolves to .*host-data/d\.npz"):
        recipe_from_dict(_recipe(project, validate={"data": {"npz": "data/d.npz"}}), project)


def test_symlinked_file_inside_an_image_folder_escaping_it_is_refused(project, tmp_path, keypair):
    from PIL import Image

    images = project / "images"
    images.mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "host.png")
    (images / "a.png").symlink_to(tmp_path / "host.png")
    model = _image_model(project / "image.onnx")
    document = _recipe(project, model={"path": model.name}, validate={"data": {"images": "images"}},
                       preprocess={"kind": "image", "resize": {"size": [4, 4]}})
    with pytest.raises(RecipeError, match=r"validate\.data\.images: .*a\.png resolves to .*host\.png, outside"):
        build(recipe_from_dict(document, project), key_paths=[str(keypair[0])], output=project / "a.edgepkg")


def _image_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_symlinked_test_data_tensor_escaping_the_folder_is_refused(project, tmp_path, keypair):
    from onnx import numpy_helper

    (tmp_path / "host.pb").write_bytes(numpy_helper.from_array(np.zeros((1, 3), np.float32), "x").SerializeToString())
    data_set = project / "cases" / "test_data_set_0"
    data_set.mkdir(parents=True)
    (data_set / "input_0.pb").symlink_to(tmp_path / "host.pb")
    recipe = recipe_from_dict(_recipe(project, validate={"data": {"test_data": "cases"}}), project)
    with pytest.raises(RecipeError, match=r"validate\.data\.test_data: .*input_0\.pb resolves to .*host\.pb"):
        build(recipe, key_paths=[str(keypair[0])], output=project / "a.edgepkg")


def test_test_data_tensor_with_external_data_pointing_at_etc_passwd_is_refused(project, keypair):
    from onnx import TensorProto

    tensor = TensorProto(name="x", data_type=TensorProto.UINT8, dims=[16], data_location=TensorProto.EXTERNAL)
    tensor.external_data.add(key="location", value="/etc/passwd")
    data_set = project / "cases" / "test_data_set_0"
    data_set.mkdir(parents=True)
    (data_set / "input_0.pb").write_bytes(tensor.SerializeToString())
    recipe = recipe_from_dict(_recipe(project, validate={"data": {"test_data": "cases"}}), project)
    with pytest.raises(RecipeError, match=r"input_0\.pb: stores its values in an external file"):
        build(recipe, key_paths=[str(keypair[0])], output=project / "a.edgepkg")
    assert not (project / "a.edgepkg").exists()


def test_allow_external_paths_lets_the_recipe_reach_out(project, tmp_path, keypair):
    outside = tmp_path / "shared" / "labels.txt"
    outside.parent.mkdir()
    outside.write_text("x\ny\nz\n")
    document = _recipe(project, postprocess={"kind": "topk", "k": 1, "labels": str(outside)})
    with pytest.raises(RecipeError):
        recipe_from_dict(document, project)
    recipe = recipe_from_dict(document, project, allow_external_paths=True)
    assert recipe.root is None and recipe.data["postprocess"]["labels"] == str(outside)
    result = build(recipe, key_paths=[str(keypair[0])], output=project / "a.edgepkg")
    assert result.output.exists()


def test_paths_inside_the_folder_resolve_and_build(project, keypair):
    (project / "sub").mkdir()
    np.savez(project / "sub" / "d.npz", x=np.ones((2, 1, 3), np.float32))
    recipe = recipe_from_dict(_recipe(project, validate={"data": {"npz": "sub/../sub/d.npz"}}), project)
    assert recipe.root == project.resolve()
    assert build(recipe, key_paths=[str(keypair[0])], output=project / "a.edgepkg").output.exists()


def _write_recipe(project: Path, output: str = "out.edgepkg") -> Path:
    (project / "r.yaml").write_text(f"name: p\nversion: 1.0.0\nmodel: {{path: model.onnx}}\n"
                                    f"validate: {{data: synthetic}}\nsign: {{key: release.key}}\noutput: {output}\n")
    return project / "r.yaml"


def test_build_refuses_to_overwrite_a_file_that_is_not_an_artifact_without_force(project):
    recipe = _write_recipe(project, "notes.txt")
    (project / "notes.txt").write_text("my notes")
    refused = run_cli("edgepack", "build", str(recipe))
    assert refused.returncode == 2
    assert "not an Edgepack artifact" in _one_line(refused) and "--force" in refused.stderr
    assert (project / "notes.txt").read_text() == "my notes"
    forced = run_cli("edgepack", "build", str(recipe), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (project / "notes.txt").read_bytes()[:2] == b"\x1f\x8b"


def test_build_replaces_an_existing_artifact_without_force(project):
    recipe = _write_recipe(project)
    assert run_cli("edgepack", "build", str(recipe)).returncode == 0
    again = run_cli("edgepack", "build", str(recipe))
    assert again.returncode == 0, again.stderr


def test_a_private_key_readable_by_group_or_others_gets_a_warning(project):
    recipe = _write_recipe(project)
    quiet = run_cli("edgepack", "build", str(recipe))
    assert quiet.returncode == 0 and "readable by group or others" not in quiet.stderr
    os.chmod(project / "release.key", 0o640)
    loud = run_cli("edgepack", "build", str(recipe))
    assert loud.returncode == 0
    assert "warning: private key" in loud.stderr and "mode 0640" in loud.stderr


def test_the_recipe_file_loader_applies_the_same_rule(project):
    (project / "r.yaml").write_text("name: p\nversion: 1.0.0\nmodel: {path: ../model.onnx}\n"
                                    "validate: {data: synthetic}\n")
    _model(project.parent / "model.onnx")
    with pytest.raises(RecipeError, match=r"model\.path: \.\./model\.onnx resolves to"):
        load_recipe(project / "r.yaml")
    assert load_recipe(project / "r.yaml", allow_external_paths=True).data["model"]["path"].endswith("model.onnx")
