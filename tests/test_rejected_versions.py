"""Rejected versions are remembered (issue 24, item 3, the device side): the incidents, replayed on
a real daemon (real mosquitto, real onnxruntime sessions, the real store), and the pure rules of
``device_agent/updates/rejected.py`` at their bounds.

The unhealthy model is y = sqrt(x): it reproduces its (positive) golden samples, so it passes its
smoke test, and answers NaN to the negative requests a load thread sends during its health window.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from device_agent.config import check_config
from device_agent.daemon import Daemon
from device_agent.store import NO_GOOD_VERSION
from device_agent.telemetry.reporter import AgentStatus, state_document
from device_agent.updates import jobs as J
from device_agent.updates import rejected as R
from device_agent.updates.jobs import Job
from device_agent.updates.service import _Running
from edgepack_core.errors import EdgepackError
from edgepack_core.fsutil import sha256_file
from edgepack_core.protocol.messages import DeviceState, parse_state
from edgepack_core.protocol.payloads import validate_payload
from tests.agent_process import Observer
from tests.artifacts import build_artifact
from tests.fleet_server_process import wait_for

SHA = "a" * 64


def _sqrt_artifact(folder: Path, key: Path, version: str) -> Path:
    """A signed ``scale`` whose model is y = sqrt(x): finite on its golden samples, NaN on negatives."""
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe

    folder.mkdir(parents=True, exist_ok=True)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "sqrt", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "sqrt.onnx")
    samples = np.abs(np.random.default_rng(1).standard_normal((4, 4))).astype(np.float32)
    np.savez(folder / "positive.npz", x=samples)
    (folder / "sqrt.yaml").write_text(
        f"name: scale\nversion: {version}\nmodel: {{path: sqrt.onnx}}\npostprocess: {{kind: raw}}\n"
        "targets: [x86, rpi]\nvalidate: {data: {npz: positive.npz, sample_axis: {x: 0}}}\n"
        "golden: {data: {npz: positive.npz, sample_axis: {x: 0}}}\n"
    )
    return build(
        load_recipe(folder / "sqrt.yaml"), key_paths=[str(key)], output=folder / f"sqrt-{version}.edgepkg"
    ).output


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("rejected")
    key = keypair[0]
    return {
        "1.1.0": build_artifact(folder, key, version="1.1.0"),
        "1.3.0": build_artifact(folder, key, version="1.3.0", factor=3.0),
        "2.0.0": _sqrt_artifact(folder / "sqrt", key, "2.0.0"),
    }


def _config(tmp_path: Path, keypair, artifact: Path, port: int):
    return check_config(
        {
            "device_id": "pi-07",
            "store": "store",
            "trust": [str(keypair[1])],
            "artifact": str(artifact),
            "api": {"enabled": False},
            "mqtt": {"host": "127.0.0.1", "port": port},
            "updates": {"health_window_s": {"default": 1.0, "min": 0.1}, "health_min_requests": 5},
        },
        tmp_path / "agent.yaml",
    )


@pytest.fixture()
def daemon(tmp_path, keypair, mosquitto_broker, arts):
    running = Daemon(_config(tmp_path, keypair, arts["1.1.0"], mosquitto_broker.port)).start()
    yield running
    running.stop()


class NegativeLoad:
    """Requests with negative values through the live service, until stopped: finite answers from
    the scale model, NaN from the sqrt one (counted by the health window)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        feed = {"x": np.array([[-1.0, -2.0, 3.0, 4.0]], dtype=np.float32)}
        while not self.stop.is_set():
            with contextlib.suppress(EdgepackError):  # a NaN answered as an error counts as one too
                self.daemon.service.predict_tensors(feed)
            self.sent += 1

    def __enter__(self) -> NegativeLoad:
        self.thread.start()
        assert wait_for(lambda: self.sent > 0, 10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _deploy(daemon: Daemon, artifact: Path, version: str, job_id: str, **command) -> Job:
    """One deploy job through the real pipeline from where a finished download leaves the file."""
    updates = daemon.updates
    assert updates is not None
    downloaded = updates.downloads / f"{job_id}.edgepkg"
    shutil.copy(artifact, downloaded)
    body = {"type": "deploy", "version": version, "sha256": sha256_file(artifact), **command}
    job = Job(id=job_id, type="deploy", command=body, history=((J.QUEUED, time.time()),))
    job = J.advance(job, J.DOWNLOADING, "fetching", time.time())
    updates.journal.save(job)
    updates._install_downloaded(job, downloaded, _Running(job.id))
    final = updates.journal.get(job.id)
    assert final is not None
    return final


def _rollback(daemon: Daemon, job_id: str) -> Job:
    updates, serving = daemon.updates, daemon.service.model
    assert updates is not None and serving is not None
    body = {"type": "rollback", "from_version": {"name": "scale", "version": serving.manifest.version}}
    job = Job(
        id=job_id,
        type="rollback",
        command=body,
        detail={"from_sha256": serving.manifest.model_sha256},
        history=((J.QUEUED, time.time()),),
    )
    updates.journal.save(job)
    updates._rollback_command(job)
    final = updates.journal.get(job_id)
    assert final is not None
    return final


def _serving(daemon: Daemon) -> str:
    assert daemon.service.model is not None
    return daemon.service.model.manifest.version


def _reject_2_0_0(daemon: Daemon, arts) -> Job:
    with NegativeLoad(daemon):
        job = _deploy(daemon, arts["2.0.0"], "2.0.0", "deploy-2-0-0")
    assert job.state == J.ROLLED_BACK and "non-finite outputs" in job.reason, job
    assert job.reason.endswith("back on scale 1.1.0") and _serving(daemon) == "1.1.0"
    assert job.detail["rejected_at"] == "health_window"
    return job


# ------------------------------------------------------------------ the incidents


def test_rollback_never_brings_back_the_version_the_health_window_rejected(daemon, arts, tmp_path):
    _reject_2_0_0(daemon, arts)
    state = (tmp_path / "store" / "state.json").read_bytes()

    rollback = _rollback(daemon, "rollback-1")
    assert rollback.state == J.FAILED and rollback.final
    assert rollback.reason == f"rollback failed: {NO_GOOD_VERSION}; serving scale 1.1.0"
    assert _serving(daemon) == "1.1.0", "the device serves the rejected model again"
    assert (tmp_path / "store" / "state.json").read_bytes() == state, "a failed rollback changed the store"
    assert json.loads(state)["previous"] is None, "the rejected version stays the rollback target"
    assert [p.name for p in (tmp_path / "store" / "models").iterdir()] == [json.loads(state)["active"]]


def test_a_rejected_version_does_not_block_a_later_release(daemon, arts):
    _reject_2_0_0(daemon, arts)
    later = _deploy(daemon, arts["1.3.0"], "1.3.0", "deploy-1-3-0")
    assert later.state == J.ACTIVE and later.final, later.reason
    assert _serving(daemon) == "1.3.0"
    # the rule still holds against what the device really held: 1.1.0 is refused after 1.3.0
    older = _deploy(daemon, arts["1.1.0"], "1.1.0", "deploy-1-1-0")
    assert older.state == J.REJECTED and older.reason == (
        "scale 1.1.0 is not newer than scale 1.3.0 on this device (a signed command with force_downgrade overrides)"
    )


def test_rerunning_a_failed_update_needs_no_force_downgrade(daemon, arts):
    first = _reject_2_0_0(daemon, arts)
    again = _deploy(daemon, arts["2.0.0"], "2.0.0", "deploy-2-0-0-again")  # no force, no NaN load this time
    states = [s for s, _ in again.history]
    assert J.STAGING in states and J.TESTING in states, "the re-run skipped admission, smoke test or window"
    assert again.state == J.ACTIVE and again.final, again.reason
    assert _serving(daemon) == "2.0.0"
    assert daemon.store.rejected.records() == (), "a version that passed its window is still listed rejected"
    assert first.command["sha256"] == again.command["sha256"]


def test_rejected_versions_survive_an_agent_restart_and_are_in_the_retained_state(
    daemon, arts, tmp_path, keypair, mosquitto_broker
):
    _reject_2_0_0(daemon, arts)
    daemon.stop()
    restarted = Daemon(_config(tmp_path, keypair, arts["1.1.0"], mosquitto_broker.port)).start()
    watch = Observer(mosquitto_broker.port)
    try:
        (found,) = restarted.store.rejected.records()
        assert (found.name, found.version, found.stage) == ("scale", "2.0.0", "health_window")
        assert found.sha256 == sha256_file(arts["2.0.0"]) and "non-finite outputs" in found.reason

        def retained() -> DeviceState | None:
            for doc in watch.of("/dev/pi-07/state"):
                parsed = parse_state("pi-07", json.dumps(doc).encode())
                if isinstance(parsed, DeviceState) and parsed.status == "online" and parsed.rejected:
                    return parsed
            return None

        assert watch.wait_for(lambda: retained() is not None, 30)
        state = retained()
        assert state is not None and [(r.version, r.sha256, r.stage) for r in state.rejected] == [
            ("2.0.0", found.sha256, "health_window")
        ]
        rollback = _rollback(restarted, "rollback-after-restart")
        assert rollback.state == J.FAILED and NO_GOOD_VERSION in rollback.reason and _serving(restarted) == "1.1.0"
    finally:
        watch.close()
        restarted.stop()


def test_a_smoke_test_failure_is_recorded_and_a_downgrade_refusal_is_not(daemon, arts, tmp_path, keypair):
    nan = build_artifact(tmp_path / "nan", keypair[0], version="1.2.0", nan=True)
    failed = _deploy(daemon, nan, "1.2.0", "deploy-nan")
    assert failed.state == J.FAILED and "smoke test" in failed.reason and failed.detail["rejected_at"] == "smoke_test"
    refused = _deploy(daemon, arts["1.1.0"], "1.1.0", "deploy-same")
    assert refused.state == J.REJECTED and "is not newer than scale 1.1.0" in refused.reason
    assert "rejected_at" not in refused.detail
    assert [(r.version, r.stage, r.sha256) for r in daemon.store.rejected.records()] == [
        ("1.2.0", "smoke_test", sha256_file(nan))
    ]


# ------------------------------------------------------------------ the rules, pure


def _rec(
    name: str = "scale", version: str = "1.0.0", ts: float = 1.0, stage: str = "health_window", sha: str = SHA
) -> R.RejectedVersion:
    return R.record(name, version, sha, stage, "unhealthy", ts)


@pytest.mark.parametrize(("added", "kept"), [(R.MAX_PER_NAME, R.MAX_PER_NAME), (R.MAX_PER_NAME + 1, R.MAX_PER_NAME)])
def test_a_model_keeps_its_newest_32_rejected_versions(added, kept):
    records: tuple[R.RejectedVersion, ...] = ()
    for i in range(added):
        records = R.add(records, _rec(version=f"1.0.{i}", ts=float(i)))
    assert len(records) == kept
    assert records[-1].version == f"1.0.{added - 1}"
    assert records[0].version == f"1.0.{added - kept}", "the oldest was not the one dropped"


def test_a_flood_of_refusals_under_other_names_does_not_push_out_a_models_rejection():
    records = R.add((), _rec(version="2.1.0", ts=0.0))
    for i in range(5 * R.MAX_RECORDS):
        records = R.add(records, _rec(name=f"junk{i % 20}", version=f"9.0.{i}", ts=float(i + 1)))
    assert len(records) == R.MAX_RECORDS
    assert R.find(records, "scale", "2.1.0") is not None


def test_the_same_artifact_rejected_twice_is_one_record_and_a_pass_forgets_it():
    records = R.add(R.add((), _rec(ts=1.0)), _rec(ts=2.0))
    assert [r.ts for r in records] == [2.0]
    assert R.forget(records, "scale", "1.0.0") == ()


def test_an_admission_refusal_never_makes_an_installed_version_unfit_to_roll_back_to():
    records = (_rec(stage="admission"),)
    assert R.find(records, "scale", "1.0.0") is None
    assert R.find((*records, _rec(stage="smoke_test", ts=2.0)), "scale", "1.0.0") is not None


def test_a_record_cuts_its_reason_and_refuses_bad_fields():
    assert len(R.record("scale", "1.0.0", SHA, "admission", "r" * 301, 1.0).reason) == R.MAX_REASON_CHARS
    assert len(R.record("scale", "1.0.0", SHA, "admission", "r" * 300, 1.0).reason) == 300
    for bad in [
        ("../x", "1.0.0", SHA, "admission"),
        ("scale", "1.0", SHA, "admission"),
        ("scale", "1.0.0", "A" * 64, "admission"),
        ("scale", "1.0.0", SHA, "download"),
    ]:
        with pytest.raises(ValueError):
            R.record(*bad, "why", 1.0)


@pytest.mark.parametrize(
    "data", [b"", b"garbage", b"[]", b'{"rejected": 3}', b"{" * 100_000, b" " * (R.MAX_FILE_BYTES + 1)]
)
def test_a_damaged_ledger_file_yields_no_records_and_says_why(data):
    records, problem = R.parse(data)
    assert records == () and problem


def test_the_ledger_persists_atomically_and_skips_invalid_entries(tmp_path):
    ledger = R.RejectedLedger(tmp_path / R.FILE_NAME)
    ledger.add(_rec())
    doc = json.loads((tmp_path / R.FILE_NAME).read_text())
    doc["rejected"].append(
        {"name": "scale", "version": "x", "sha256": SHA, "stage": "admission", "reason": "", "ts": 1}
    )
    (tmp_path / R.FILE_NAME).write_text(json.dumps(doc))
    again = R.RejectedLedger(tmp_path / R.FILE_NAME)
    assert again.records() == (_rec(),) and again.problem is None
    assert [p.name for p in tmp_path.iterdir()] == [R.FILE_NAME], "a temporary file was left"


# ------------------------------------------------------------------ the state message


def test_the_state_message_carries_the_rejected_list_and_old_messages_still_parse():
    rejected = R.for_state([_rec(version=f"1.0.{i}", ts=float(i)) for i in range(R.MAX_IN_STATE + 5)])
    doc = state_document("pi-07", True, AgentStatus(rejected=rejected), [], ts=10.0)
    validate_payload("state", doc)
    parsed = parse_state("pi-07", json.dumps(doc).encode())
    assert isinstance(parsed, DeviceState) and len(parsed.rejected) == R.MAX_IN_STATE
    assert parsed.rejected[0].version == f"1.0.{R.MAX_IN_STATE + 4}", "not newest first"
    del doc["rejected"]
    old = parse_state("pi-07", json.dumps(doc).encode())
    assert isinstance(old, DeviceState) and old.rejected == ()


def test_a_forged_rejected_entry_is_dropped_not_the_state():
    good = _rec().to_json()
    doc = state_document("pi-07", True, AgentStatus(), [], ts=10.0)
    doc["rejected"] = [good, {**good, "sha256": "x"}, {**good, "stage": "whim"}, "junk", {**good, "ts": -1}]
    parsed = parse_state("pi-07", json.dumps(doc).encode())
    assert isinstance(parsed, DeviceState) and [r.sha256 for r in parsed.rejected] == [SHA]


# ------------------------------------------------------------------ the store


@pytest.fixture()
def store_with_two(tmp_path, keypair, arts):
    from device_agent.store import ModelStore
    from edgepack_core.signing import TrustStore, load_public_key

    store = ModelStore(tmp_path / "s", TrustStore([load_public_key(keypair[1])]))
    store.install(arts["1.1.0"])
    store.install(arts["1.3.0"])
    return store


def test_a_rejected_previous_version_from_an_older_agent_is_never_the_rollback_target(store_with_two):
    from device_agent.errors import StoreError

    store = store_with_two
    store.rejected.add(R.record("scale", "1.1.0", SHA, "health_window", "unhealthy: NaN", 1.0))
    state = (store.root / "state.json").read_bytes()
    with pytest.raises(
        StoreError,
        match=r"the previous version scale 1\.1\.0 was rejected \(health_window: "
        r"unhealthy: NaN\); no earlier version that passed",
    ):
        store.rollback()
    assert (store.root / "state.json").read_bytes() == state


def test_a_rollback_that_forgets_the_active_version_leaves_no_rollback_target(store_with_two):
    from device_agent.errors import StoreError

    store = store_with_two
    target = store.rollback(forget_active=True)
    assert target.version == "1.1.0" and json.loads((store.root / "state.json").read_text())["previous"] is None
    assert [p.name for p in store.models.iterdir()] == [target.key], "the forgotten version was kept on disk"
    with pytest.raises(StoreError, match=NO_GOOD_VERSION):
        store.rollback_target()


def test_a_damaged_state_is_rebuilt_on_a_version_the_device_did_not_reject(store_with_two):
    store = store_with_two
    store.rejected.add(R.record("scale", "1.3.0", SHA, "health_window", "unhealthy", 1.0))
    (store.root / "state.json").write_bytes(b"garbage")
    active = store.recover()
    assert active is not None and active.version == "1.1.0", "the newest, rejected, version was chosen"


def test_a_ledger_the_medium_refuses_keeps_the_record_in_memory(tmp_path):
    from device_agent.errors import StoreError

    (tmp_path / "file").write_text("not a folder")
    ledger = R.RejectedLedger(tmp_path / "file" / R.FILE_NAME)
    with pytest.raises(StoreError, match="cannot be written"):
        ledger.add(_rec())
    assert ledger.records() == (_rec(),)
