"""Golden streams on real parts: the packager replays an H.264 clip through the real packaged
blob detector with a pipeline fragment and signs the events; the agent replays it at
activation and refuses a model whose events differ, naming the first differing event."""

from __future__ import annotations

import io
import json
import logging
import sys
import tarfile
from pathlib import Path
from typing import Any

import av
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image

from device_agent.config import check_config
from device_agent.daemon import Daemon
from device_agent.errors import GoldenStreamMismatch, PipelineRefused
from device_agent.pipelines.golden import decode_clip, golden_spec
from device_agent.updates.golden_stream import NO_PYAV, check_golden_stream, failure_detail
from edgepack_core.errors import SchemaError
from edgepack_core.golden_stream import (
    MAX_CLIP_BYTES,
    MAX_COUNT,
    EventKey,
    compare,
    events_bytes,
    parse_events,
)
from sdk.errors import BuildError, RecipeError
from sdk.packager.passes.golden import npz_bytes
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.artifacts import resign_with_changes
from tests.stream_models import Path2D, blob_detector, detector_recipe, draw, moving_squares_clip
from tests.test_pipeline_streams import FPS, FRAMES, HEIGHT, PATHS, PIPELINE, WIDTH, expected_events

FRAGMENT = {key: PIPELINE[key] for key in ("stages", "tracker", "rules")}


def _recipe(folder: Path, clip: str = "clip.mp4", fragment: dict | None = None) -> Path:
    recipe = detector_recipe(folder)
    (folder / "val").mkdir(exist_ok=True)
    for index in range(0, FRAMES, 6):
        Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(folder / "val" / f"f{index:03d}.png")
    with recipe.open("a") as handle:
        handle.write("golden_stream: " + json.dumps({"clip": clip, "pipeline": fragment or FRAGMENT}) + "\n")
    return recipe


@pytest.fixture(scope="module")
def golden(tmp_path_factory, keypair) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("golden")
    recipe = _recipe(folder / "build")
    moving_squares_clip(folder / "build" / "clip.mp4", PATHS, FRAMES, width=WIDTH, height=HEIGHT, fps=FPS)
    artifact = folder / "detector.edgepkg"
    result = build(load_recipe(recipe), key_paths=[str(keypair[0])], output=artifact)
    return {"folder": folder, "recipe": recipe, "artifact": artifact, "result": result}


def _daemon(tmp_path: Path, keypair) -> Daemon:
    config = check_config(
        {"device_id": "pi-07", "store": "store", "trust": [str(keypair[1])], "api": {"enabled": False}},
        tmp_path / "agent.yaml",
    )
    return Daemon(config)


def _members(artifact: Path) -> dict[str, bytes]:
    with tarfile.open(artifact) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_a_recipe_with_a_golden_stream_builds_an_artifact_carrying_the_clip_and_its_events(golden):
    manifest = golden["result"].manifest
    section = manifest.golden_stream
    assert section is not None and section.frames == FRAMES
    assert (section.clip, section.events) == ("golden_stream/clip.mp4", "golden_stream/events.json")
    assert {section.clip, section.events} <= set(manifest.files)  # hashed and signed like every member
    members = _members(golden["artifact"])
    assert members[section.clip] == (golden["folder"] / "build" / "clip.mp4").read_bytes()
    keys = parse_events(members[section.events])
    assert sorted((k.frame, k.rule, k.kind, k.label, k.direction) for k in keys) == expected_events()
    assert dict(section.pipeline) == FRAGMENT
    assert golden["result"].report["passes"]["golden_stream"] == {"frames": FRAMES, "events": len(keys)}


def test_the_agent_installs_an_artifact_whose_golden_stream_matches(golden, tmp_path, keypair):
    daemon = _daemon(tmp_path, keypair)
    loaded = daemon.install_artifact(golden["artifact"])
    assert daemon.store.active().version == "1.0.0"
    report = check_golden_stream(loaded)
    assert report.job_detail() == {"golden_stream": {"events": len(expected_events()), "mismatches": 0}}


def _swapped_model(folder: Path) -> bytes:
    """The blob detector reading its red and green channels swapped: it finds the person as a
    car and the car as a person (other boxes, same shapes)."""
    model = onnx.load(blob_detector(folder / "swapped.onnx"))
    for init in model.graph.initializer:
        if init.name in ("idx0", "idx1"):
            init.CopyFrom(onnx.helper.make_tensor(init.name, onnx.TensorProto.INT64, [], [1 - int(init.name[-1])]))
    return model.SerializeToString()


def _golden_outputs_of(model: bytes, members: dict[str, bytes]) -> dict[str, bytes]:
    """Golden outputs recomputed on ``model``: its golden samples reproduce, only its stream differs."""
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    replaced = {}
    for name, data in members.items():
        if name.endswith(".inputs.npz"):
            feed = dict(np.load(io.BytesIO(data)))
            outputs = session.run(None, feed)
            replaced[name.replace(".inputs.", ".outputs.")] = npz_bytes(
                {o.name: v for o, v in zip(session.get_outputs(), outputs, strict=True)}
            )
    return replaced


def test_an_artifact_resigned_with_a_model_that_sees_other_colours_is_refused_at_activation_naming_the_event(
    golden, tmp_path, keypair
):
    swapped = _swapped_model(tmp_path)
    changes = {"model/model.onnx": swapped, **_golden_outputs_of(swapped, _members(golden["artifact"]))}
    bad = resign_with_changes(golden["artifact"], tmp_path / "swapped.edgepkg", keypair[0], replace=changes)
    daemon = _daemon(tmp_path, keypair)
    with pytest.raises(GoldenStreamMismatch) as refused:
        daemon.install_artifact(bad)
    message = str(refused.value)
    assert "golden stream of detector 1.0.0 failed" in message
    expected = set(expected_events())
    seen = {(f, r, k, {"person": "car", "car": "person"}.get(label, label), d) for f, r, k, label, d in expected}
    frame, rule, kind, label, _ = first = sorted(expected ^ seen)[0]
    why = "expected, not seen" if first in expected else "seen, not expected"
    assert message.endswith(f"first: frame {frame} {rule} {kind} {label}: {why}"), message
    assert refused.value.counts == {"events": len(expected), "mismatches": len(expected ^ seen)}
    assert failure_detail(refused.value) == {"golden_stream": refused.value.counts}
    assert daemon.store.active() is None  # nothing activated


def test_a_golden_stream_clip_larger_than_the_bound_is_refused_before_decoding(tmp_path):
    """Garbage bytes: at the bound they pass the size rule and reach the decoder (which refuses
    them); one byte more is refused by size, by the packager's recipe check and by the agent,
    before any decoding."""
    folder = tmp_path / "build"
    folder.mkdir()
    clip = folder / "clip.mp4"
    clip.write_bytes(b"\0" * MAX_CLIP_BYTES)
    load_recipe(_recipe(folder))  # the bound itself passes the recipe check
    with pytest.raises(PipelineRefused, match="cannot decode"):
        decode_clip(clip)
    clip.write_bytes(b"\0" * (MAX_CLIP_BYTES + 1))
    with pytest.raises(RecipeError, match=rf"golden_stream.clip: the golden clip is {MAX_CLIP_BYTES + 1} bytes"):
        load_recipe(folder / "detector-1.0.0.yaml")
    with pytest.raises(PipelineRefused, match=f"over the {MAX_CLIP_BYTES} allowed"):
        decode_clip(clip)


def test_a_stage_naming_another_model_is_refused_by_the_recipe_check(tmp_path):
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "clip.mp4").write_bytes(b"x")
    with pytest.raises(RecipeError, match=r"golden_stream.pipeline.stages\[0\].model: names 'colour'"):
        load_recipe(_recipe(folder, fragment={**FRAGMENT, "stages": [{"model": "colour"}]}))


def test_a_clip_that_yields_no_events_or_no_frames_is_refused_with_one_line(tmp_path, keypair):
    folder = tmp_path / "build"
    folder.mkdir()
    still = (Path2D("bicycle", (40, 190), (0, 0)),)  # never crosses nor enters
    moving_squares_clip(folder / "clip.mp4", still, 12, width=WIDTH, height=HEIGHT, fps=FPS)
    with pytest.raises(BuildError, match=r"gives no event through its pipeline \(12 frames\): nothing to check"):
        build(load_recipe(_recipe(folder)), key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg")
    with av.open(str(folder / "clip.mp4"), "w") as container:  # a header, no frame
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        container.start_encoding()
    with pytest.raises(BuildError) as refused:
        build(load_recipe(folder / "detector-1.0.0.yaml"), key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg")
    assert (
        str(refused.value) == "golden_stream: golden_stream.clip: the golden clip decodes to no frames (no video "
        "stream)"
    )


def test_a_fragment_with_a_source_or_a_bad_rule_is_refused_naming_the_key():
    with pytest.raises(SchemaError, match=r"golden_stream.pipeline.source: not a key"):
        golden_spec({**FRAGMENT, "source": {"file": "x.mp4"}})
    with pytest.raises(SchemaError, match=r"golden_stream.pipeline.rules\[0\]"):
        golden_spec({**FRAGMENT, "rules": [{"zone": "hall", "points": [[0, 0], [1, 1]]}]})


def test_without_pyav_the_golden_stream_is_skipped_with_a_logged_line_and_a_flag(
    golden, tmp_path, keypair, monkeypatch, caplog
):
    daemon = _daemon(tmp_path, keypair)
    loaded = daemon.install_artifact(golden["artifact"])
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with caplog.at_level(logging.WARNING):
        report = check_golden_stream(loaded)
    assert report.job_detail() == {"golden_stream": {"skipped": NO_PYAV}}
    assert "golden stream skipped" in caplog.text


def test_events_compare_as_a_multiset_independent_of_track_ids_and_name_the_first_difference():
    a, b = EventKey(3, "gate", "cross", "person", "in"), EventKey(7, "hall", "enter", "car", None)
    assert compare([a, b], [b, a]).mismatches == 0
    assert compare([a, a], [a]).to_json() == {"events": 2, "mismatches": 1}
    differ = compare([a, b], [b, EventKey(3, "gate", "cross", "person", "out")])
    assert differ.mismatches == 2 and differ.first == "frame 3 gate cross person in: expected, not seen"
    assert parse_events(events_bytes([b, a])) == (a, b)


def test_an_events_member_past_its_bounds_is_refused():
    from edgepack_core.errors import ManifestError
    from edgepack_core.golden_stream import MAX_EVENTS, MAX_FRAMES

    items = [{"frame": MAX_FRAMES - 1, "rule": "r", "kind": "enter", "label": None, "direction": None}]
    assert len(parse_events(json.dumps({"events": items * MAX_EVENTS}).encode())) == MAX_EVENTS
    with pytest.raises(ManifestError, match="at most"):
        parse_events(json.dumps({"events": items * (MAX_EVENTS + 1)}).encode())
    with pytest.raises(ManifestError, match="out of range"):
        parse_events(json.dumps({"events": [{**items[0], "frame": MAX_FRAMES}]}).encode())


@pytest.mark.slow
def test_a_deploy_reports_the_golden_stream_in_the_job_and_a_mismatch_fails_it_naming_the_event(
    golden, tmp_path, keypair, mosquitto_broker
):
    """The update service's test stage: a deploy whose events match ends active with
    ``golden_stream: {events, mismatches: 0}`` in its job detail; the colour-swapped model fails
    (the previous model keeps serving) with the first differing event in its reason."""
    from tests.agent_process import AgentProcess, Observer
    from tests.conftest import run_cli

    key = keypair[0]
    swapped = _swapped_model(tmp_path)
    changes = {"model/model.onnx": swapped, **_golden_outputs_of(swapped, _members(golden["artifact"]))}
    bad = resign_with_changes(
        golden["artifact"], tmp_path / "bad.edgepkg", key, replace=changes, manifest_changes={"version": "1.1.0"}
    )
    good = resign_with_changes(
        golden["artifact"], tmp_path / "good.edgepkg", key, manifest_changes={"version": "1.2.0"}
    )
    agent = AgentProcess(
        tmp_path,
        device="pi-07",
        broker_port=mosquitto_broker.port,
        trust=keypair[1],
        artifact=golden["artifact"],
        health_window_s=0.5,
    ).start()
    observer = Observer(mosquitto_broker.port)
    try:
        for artifact in (bad, good):
            run_cli(
                "edgepack",
                "deploy",
                str(artifact),
                "--device",
                "pi-07",
                "--broker",
                mosquitto_broker.address,
                "--wait",
                "--timeout",
                "60",
            )
        assert observer.wait_for(lambda: len([j for j in observer.jobs("pi-07") if j["final"]]) >= 2)
        failed, passed = [j for j in observer.jobs("pi-07") if j["final"]]
        assert failed["state"] == "failed" and "golden stream of detector 1.1.0 failed" in failed["reason"]
        assert "first: frame" in failed["reason"] and "(the previous model keeps serving)" in failed["reason"]
        assert failed["detail"]["golden_stream"]["mismatches"] > 0
        assert passed["state"] == "active" and passed["version"] == "1.2.0"
        assert passed["detail"]["golden_stream"] == {"events": len(expected_events()), "mismatches": 0}
        assert agent.version() == "1.2.0"
    finally:
        observer.close()
        agent.stop()


def test_a_rollout_wave_failed_by_golden_stream_mismatches_counts_them_in_its_reason():
    """The rollout's failure counts the event mismatches its devices' jobs carry as typed counts
    (parsed once from the job detail); a reason line alone, however it reads, counts nothing."""
    from edgepack_core.golden_stream import Comparison, GoldenCounts, mismatch_problem, mismatch_reason
    from sdk.fleet_server.rollouts import RUNNING, DeviceStatus, Gates, Rollout, next_step

    refused = mismatch_reason("detector 1.1.0", mismatch_problem(Comparison(6, 12, "frame 10 hall enter car")))
    rollout = Rollout(
        id="ro-000000000001",
        state=RUNNING,
        wave=0,
        wave_count=2,
        started_at=0.0,
        wave_started_at=0.0,
        gates=Gates(soak_s=10.0, wave_timeout_s=100.0),
    )
    counted = GoldenCounts(6, 12)
    wave = [
        DeviceStatus("cam-1", 0, "failed", True, refused, golden_stream=counted),
        DeviceStatus("cam-2", 0, "failed", True, "refused", golden_stream=counted),
        DeviceStatus("cam-3", 0, "failed", True, "download failed"),
        DeviceStatus("cam-4", 0, "active", True, golden_stream=GoldenCounts(6, 0)),
    ]
    step = next_step(rollout, wave, 1.0)
    assert step.kind == "fail" and step.reason.endswith("; golden stream: 24 event mismatch(es) on 2 device(s)")
    plain = next_step(rollout, wave[2:], 1.0)
    assert plain.kind == "fail" and "golden stream" not in plain.reason
    only_reason = next_step(rollout, [DeviceStatus("cam-1", 0, "failed", True, refused)], 1.0)
    assert only_reason.kind == "fail" and "event mismatch" not in only_reason.reason


@pytest.mark.parametrize(
    ("golden_stream", "counts"),
    [
        ({"events": 6, "mismatches": 12}, (6, 12)),
        ({"events": 0, "mismatches": MAX_COUNT}, (0, MAX_COUNT)),  # the bound passes
        ({"events": 0, "mismatches": MAX_COUNT + 1}, None),  # one over: no counts
        ({"events": 6, "mismatches": -1}, None),
        ({"events": 6, "mismatches": True}, None),
        ({"events": 6, "mismatches": "12"}, None),
        ({"events": 6}, None),
        ({"skipped": "PyAV is not installed"}, None),
        ("12 mismatches", None),
    ],
)
def test_a_job_events_golden_stream_detail_is_parsed_once_into_typed_counts(golden_stream, counts):
    from edgepack_core.golden_stream import GoldenCounts
    from edgepack_core.protocol.messages import JobEvent, parse_job_event

    sent = JobEvent(
        "cam-1", "job-1", "deploy", "failed", True, 1.0, reason="refused", detail={"golden_stream": golden_stream}
    )
    parsed = parse_job_event("cam-1", sent.encode())
    assert isinstance(parsed, JobEvent)
    assert parsed.golden_stream == (None if counts is None else GoldenCounts(*counts))
    assert parsed.to_json() == sent.to_json()  # the counts are not a second wire field


def test_a_clip_over_its_frame_bound_is_refused_as_it_decodes(golden):
    clip = golden["folder"] / "build" / "clip.mp4"
    assert len(decode_clip(clip, max_frames=FRAMES)) == FRAMES
    with pytest.raises(PipelineRefused, match=f"more than {FRAMES - 1} frames"):
        decode_clip(clip, max_frames=FRAMES - 1)


def test_a_manifest_naming_golden_stream_members_it_does_not_list_is_refused(golden):
    from edgepack_core.errors import ManifestError
    from edgepack_core.manifest import check_manifest

    document = golden["result"].manifest.to_json()
    check_manifest(document)
    del document["files"]["golden_stream/events.json"]
    with pytest.raises(ManifestError, match=r"golden_stream/events\.json is referenced but not listed"):
        check_manifest(document)
