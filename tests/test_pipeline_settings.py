"""Pipelines in the desired state: a signed settings document from the fleet server starts a
pipeline on a running agent (no restart, no edit on the device), the held document keeps it
across a restart, and a pipeline the installed models cannot run is refused with its reason
while the running one goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from edgepack_core.command_auth import sign_command
from sdk.keys import load_operator_key, write_operator_keypair
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.agent_process import AgentProcess, Observer
from tests.broker import wait_until
from tests.stream_models import detector_recipe, draw, moving_squares_clip
from tests.test_pipeline_streams import FPS, FRAMES, HEIGHT, PATHS, PIPELINE, WIDTH, as_tuples, expected_events
from tests.test_settings_attacks import DEVICE, final_event, send, settings_command


@pytest.fixture(scope="module")
def detector(tmp_path_factory, keypair) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("remote-pipeline")
    recipe = detector_recipe(folder / "build")
    (folder / "build" / "val").mkdir()
    for index in range(0, FRAMES, 6):
        Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(folder / "build" / "val" / f"f{index:03d}.png")
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=folder / "detector.edgepkg")
    write_operator_keypair(folder / "op.key", folder / "op.pub")
    clip = moving_squares_clip(folder / "clip.mp4", PATHS, FRAMES, width=WIDTH, height=HEIGHT, fps=FPS)
    return {"artifact": folder / "detector.edgepkg", "op.key": folder / "op.key", "op.pub": folder / "op.pub",
            "clip": clip}


def events_in(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_pipeline_sent_in_the_settings_starts_on_a_running_agent_and_survives_a_restart(
        tmp_path, mosquitto_broker, keypair, detector):
    observer = Observer(mosquitto_broker.port)
    agent = AgentProcess(tmp_path, device=DEVICE, broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=detector["artifact"], operator_keys=[detector["op.pub"]])
    operator = load_operator_key(detector["op.key"])
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    pipeline = json.loads(json.dumps(PIPELINE).replace("CLIP", str(detector["clip"])))
    try:
        agent.start()
        assert "pipelines" not in agent.health()
        applied = final_event(observer, send(observer, sign_command(settings_command(
            1, {"pipelines": [{**pipeline, "sinks": [{"file": str(first)}]}]}), operator)))
        assert applied["state"] == "done" and applied["detail"]["results"]["pipelines"] == "applied", applied
        assert wait_until(lambda: len(as_tuples(events_in(first))) >= len(expected_events()), timeout=60)
        assert as_tuples(events_in(first)) == expected_events()

        wrong = {**pipeline, "name": "other", "stages": [{"model": "not-installed"}]}
        refused = final_event(observer, send(observer, sign_command(settings_command(
            2, {"pipelines": [wrong]}), operator)))
        assert refused["detail"]["results"]["pipelines"].startswith(
            "refused: pipelines[0].stages[0].model: no installed model 'not-installed'"), refused

        pid = agent.proc.pid
        agent.stop()
        first.unlink()
        agent.start()  # the held document (generation 1's pipeline, kept) wins over agent.yaml
        assert agent.proc.pid != pid
        assert wait_until(lambda: len(as_tuples(events_in(first))) >= len(expected_events()), timeout=60)
        assert as_tuples(events_in(first)) == expected_events()
        assert not second.exists()
    finally:
        agent.stop()
        observer.close()


def test_the_server_refuses_a_pipeline_by_the_devices_rule_naming_the_key():
    from edgepack_core.errors import SchemaError
    from edgepack_core.settings_doc import check_value

    with pytest.raises(SchemaError, match=r"pipelines\[0\].source"):
        check_value("pipelines", [{"name": "cam", "source": {"url": "rtsp://x/y", "file": "a.mp4"},
                                   "stages": [{"model": "detector"}]}])
    assert check_value("pipelines", []) == []
