"""The camera examples of docs/agent.md ("Cameras on a Raspberry Pi and on a Jetson") are what
`edgepack-agent pipeline check` accepts: each agent.yaml is taken from the doc as written, only
its store, trust and artifact paths pointed at a real store holding a packaged detector and a
crop classifier (tests/stream_models.py) under the names the examples use."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli
from tests.stream_models import classifier_recipe, detector_recipe, draw
from tests.test_pipeline_streams import HEIGHT, PATHS, WIDTH

DOCS = Path(__file__).resolve().parents[1] / "docs" / "agent.md"


def examples() -> list[dict[str, Any]]:
    docs = DOCS.read_text()
    section = docs[docs.index("\n### Cameras on a Raspberry Pi and on a Jetson\n"):]
    section = section[:section.index("\n### ", 1)]
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, flags=re.S)]


@pytest.fixture(scope="module")
def store(tmp_path_factory, keypair) -> Path:
    """A store with `detector` and `colour` installed in their slots (as the agent installs them)."""
    folder = tmp_path_factory.mktemp("doc-store")
    recipes = {"detector": detector_recipe(folder / "build"), "colour": classifier_recipe(folder / "build")}
    (folder / "build" / "val").mkdir()
    for index in (0, 6):
        Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(folder / "build" / "val" / f"f{index:03d}.png")
    root = folder / "store"
    for name, recipe in recipes.items():
        artifact = folder / f"{name}.edgepkg"
        build(load_recipe(recipe), key_paths=[str(keypair[0])], output=artifact)
        run_cli("edgepack-agent", "install", "--store", str(root / "slots" / name), "--artifact", str(artifact),
                "--trust", str(keypair[1]), check=True)
    return root


def test_the_docs_show_a_raspberry_pi_and_a_jetson_camera():
    pi, jetson = examples()
    (door,) = pi["pipelines"]
    assert pi["profile"] == "rpi" and door["source"] == {"camera": "picamera2", "policy": "latest", "max_fps": 5}
    (gate,) = jetson["pipelines"]
    assert jetson["profile"] == "jetson" and gate["source"]["url"].startswith("rtsp://")
    assert gate["source"]["transport"] == "tcp" and gate["stages"][1]["crop"]["from"] == "detector"


@pytest.mark.parametrize("index", [0, 1], ids=["raspberry-pi", "jetson"])
def test_each_camera_example_of_the_docs_passes_pipeline_check(tmp_path, store, keypair, index):
    document = examples()[index]
    document["store"], document["trust"] = str(store), [str(keypair[1])]
    for model in document["models"]:
        model["artifact"] = str(tmp_path / f"{model['name']}.edgepkg")
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(document))
    result = run_cli("edgepack-agent", "pipeline", "check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    (name,) = [p["name"] for p in document["pipelines"]]
    assert result.stdout.startswith(f"{name}: ok ("), result.stdout


def test_the_check_refuses_the_pi_example_with_a_label_its_detector_lacks(tmp_path, store, keypair):
    document = examples()[0]
    document["store"], document["trust"] = str(store), [str(keypair[1])]
    document["pipelines"][0]["rules"][0]["classes"] = ["parcel"]
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(document))
    result = run_cli("edgepack-agent", "pipeline", "check", "--config", str(config))
    assert result.returncode == 1 and "rules[0].classes: 'parcel' is not a label" in result.stderr
