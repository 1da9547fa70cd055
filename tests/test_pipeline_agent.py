"""`edgepack-agent run` with a pipeline: the golden clip's events, exactly, in the file sink,
over MQTT (a real mosquitto) and in a webhook on loopback; /healthz shows the pipeline."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import paho.mqtt.client as mqtt
import yaml
from PIL import Image

from device_agent.telemetry.metrics import TELEMETRY_SCHEMA
from edgepack_core.schema import validate
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.agent_process import free_port
from tests.broker import wait_until
from tests.conftest import cli
from tests.stream_models import detector_recipe, draw, moving_squares_clip
from tests.test_pipeline_streams import FPS, FRAMES, HEIGHT, PATHS, PIPELINE, WIDTH, as_tuples, expected_events


class Receiver(BaseHTTPRequestHandler):
    events: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.events.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


def test_the_golden_clip_through_edgepack_agent_run_gives_its_events_in_every_sink(tmp_path, keypair,
                                                                                  mosquitto_broker):
    build_dir = tmp_path / "build"
    recipe = detector_recipe(build_dir)
    (build_dir / "val").mkdir()
    for index in range(0, FRAMES, 6):
        Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(build_dir / "val" / f"f{index:03d}.png")
    artifact = tmp_path / "detector.edgepkg"
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=artifact)
    clip = moving_squares_clip(tmp_path / "clip.mp4", PATHS, FRAMES, width=WIDTH, height=HEIGHT, fps=FPS)

    Receiver.events = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    got_mqtt: list[dict] = []
    observer = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    observer.on_message = lambda _c, _u, message: got_mqtt.append(json.loads(message.payload))
    observer.connect("127.0.0.1", mosquitto_broker.port)
    observer.subscribe("edgepack/v1/dev/pi-07/events", qos=1)
    telemetry: list[dict] = []
    observer.message_callback_add("edgepack/v1/dev/pi-07/telemetry",
                                  lambda _c, _u, message: telemetry.append(json.loads(message.payload)))
    observer.subscribe("edgepack/v1/dev/pi-07/telemetry", qos=1)
    observer.loop_start()

    pipeline = json.loads(json.dumps(PIPELINE).replace("CLIP", str(clip)))
    pipeline["sinks"] = [{"file": str(tmp_path / "events.jsonl")}, {"mqtt": True},
                         {"webhook": f"http://127.0.0.1:{server.server_port}/events"}]
    port = free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "device_id": "pi-07", "store": str(tmp_path / "store"), "trust": [str(keypair[1])],
        "models": [{"name": "detector", "artifact": str(artifact)}],
        "api": {"listen": f"127.0.0.1:{port}"},
        "mqtt": {"host": "127.0.0.1", "port": mosquitto_broker.port, "telemetry_interval": 1},
        "pipelines": [pipeline]}))
    expected = expected_events()
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen([cli("edgepack-agent"), "run", "--config", str(config)], stdout=out, stderr=out)
    try:
        events_file = tmp_path / "events.jsonl"

        def lines() -> list[dict]:
            return [json.loads(x) for x in events_file.read_text().splitlines()] if events_file.exists() else []

        assert wait_until(lambda: len(as_tuples(lines())) >= len(expected), timeout=90), log.read_text()[-3000:]
        assert as_tuples(lines()) == expected
        assert wait_until(lambda: len(as_tuples(got_mqtt)) >= len(expected) and
                          len(as_tuples(Receiver.events)) >= len(expected), timeout=30)
        assert as_tuples(got_mqtt) == expected
        assert as_tuples(Receiver.events) == expected

        def pipeline_health() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
                return json.load(answer)["pipelines"]["door-cam"]

        assert wait_until(lambda: pipeline_health()["state"] == "finished", timeout=30)
        health = pipeline_health()
        assert (health["frames"], health["dropped"], health["stage_errors"]) == (FRAMES, 0, 0)
        (stage,) = health["stages"]  # where the time goes, per stage and end to end
        assert (stage["name"], stage["model"], stage["count"], health["end_to_end"]["count"]) == (
            "detector", "detector", FRAMES, FRAMES)
        assert 0 < stage["p50_ms"] <= stage["p95_ms"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            metrics = answer.read().decode()
        assert f'edgepack_pipeline_frames_total{{pipeline="door-cam"}} {FRAMES}' in metrics
        assert 'edgepack_pipeline_events_total{pipeline="door-cam",rule="gate",kind="cross"} 2' in metrics
        assert f'edgepack_pipeline_stage_seconds_bucket{{pipeline="door-cam",stage="detector",le="+Inf"}} {FRAMES}' \
            in metrics
        assert f'edgepack_pipeline_end_to_end_seconds_count{{pipeline="door-cam"}} {FRAMES}' in metrics

        def finished_sample() -> dict | None:
            return next((t for t in telemetry[::-1] if t.get("pipelines", [{}])[0].get("state") == "finished"), None)

        assert wait_until(lambda: finished_sample() is not None, timeout=30)
        sample = finished_sample()
        assert sample is not None
        validate(sample, TELEMETRY_SCHEMA, document="telemetry")
        section = sample["pipelines"][0]
        assert (section["frames"], section["dropped"], section["source"]["frames"]) == (FRAMES, 0, FRAMES)
        assert section["events"]["gate"] == {"cross": 2}
        assert [(s["name"], s["count"]) for s in section["stages"]] == [("detector", FRAMES)]
    finally:
        agent.terminate()
        agent.wait(30)
        observer.loop_stop()
        server.shutdown()
    assert "Traceback" not in log.read_text()
