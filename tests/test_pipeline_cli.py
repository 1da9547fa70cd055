"""`edgepack-agent pipeline check` and `pipeline schema`: a real store with a real installed
artifact, checked as the agent would before starting a pipeline; mistakes are one line, exit 1
(a document that does not parse is bad usage: exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.artifacts import build_artifact
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def store(tmp_path_factory, keypair) -> Path:
    folder = tmp_path_factory.mktemp("pipeline-store")
    artifact = build_artifact(folder / "build", keypair[0], name="scale")
    root = folder / "store"
    run_cli("edgepack-agent", "install", "--store", str(root), "--artifact", str(artifact), "--trust",
            str(keypair[1]), check=True)
    return root


def config(tmp_path: Path, store: Path, keypair, pipelines: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(f"device_id: pi-07\nstore: {store}\ntrust: [{keypair[1]}]\npipelines:\n{pipelines}")
    return path


def test_a_pipeline_the_installed_model_can_run_checks_ok(tmp_path, store, keypair):
    path = config(tmp_path, store, keypair, "  - name: feed\n    source: {push: true}\n    stages: [{model: scale}]\n")
    result = run_cli("edgepack-agent", "pipeline", "check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "feed: ok (push source, scale, 0 rules, 0 sinks)"


def test_a_video_source_into_a_tensor_model_is_one_line_exit_1(tmp_path, store, keypair):
    path = config(tmp_path, store, keypair,
                  "  - name: cam\n    source: {file: clip.mp4}\n    stages: [{model: scale}]\n")
    result = run_cli("edgepack-agent", "pipeline", "check", "--config", str(path))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "edgepack-agent: error: pipelines[0].stages[0].model: scale takes tensor input; a file source gives image"]


def test_a_model_that_is_not_installed_is_named_with_what_is(tmp_path, store, keypair):
    path = config(tmp_path, store, keypair, "  - name: cam\n    source: {push: true}\n    stages: [{model: yolo}]\n")
    result = run_cli("edgepack-agent", "pipeline", "check", "--config", str(path))
    assert result.returncode == 1 and "no installed model 'yolo' (installed: scale)" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_key_is_bad_usage_naming_it(tmp_path, store, keypair):
    path = config(tmp_path, store, keypair,
                  "  - name: cam\n    source: {push: true, polcy: every}\n    stages: [{model: scale}]\n")
    result = run_cli("edgepack-agent", "pipeline", "check", "--config", str(path))
    assert result.returncode == 2 and "pipelines[0].source" in result.stderr and "polcy" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_schema_command_prints_the_published_schema():
    result = run_cli("edgepack-agent", "pipeline", "schema", check=True)
    published = Path(__file__).resolve().parents[1] / "schemas" / "pipeline.schema.json"
    assert json.loads(result.stdout) == json.loads(published.read_text())
