"""A release marked bad fleet-wide: a real `edgepack fleet serve` and real mosquitto. The mark is
audited with its reason, lists what names the artifact, refuses new rollouts and targets naming
it (422), and the driver pauses (never fails) a running rollout carrying it, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.artifacts import build_artifact
from tests.fleet_server_process import FleetServerProcess, edgepack, wait_for
from tools.fleet_sim import Behaviour, SimFleet


@pytest.fixture(scope="module")
def release(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("arts") / "bad", keypair[0], version="2.0.0")


def _upload(server: FleetServerProcess, path: Path) -> str:
    status, stored = server.call(
        "POST", "/api/artifacts", data=path.read_bytes(), headers={"Content-Type": "application/octet-stream"}
    )
    assert status == 201, stored
    assert stored["bad"] is None
    return str(stored["sha256"])


def _audit(server: FleetServerProcess, action: str) -> list[dict]:
    return [e for e in server.get("/api/audit?limit=1000")["entries"] if e["action"] == action]


def test_marking_a_release_bad_is_audited_lists_its_targets_and_refuses_new_targets_and_rollouts(
    tmp_path, mosquitto_broker, server_keys, release
):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        sha = _upload(server, release)
        assert server.call("PUT", "/api/targets/groups/kitchen", {"models": {"scale": sha}})[0] == 200
        assert server.call("PUT", "/api/targets/fleet", {"models": {"scale": sha}})[0] == 200
        path = f"/api/artifacts/{sha}/bad"
        # refusals: unknown sha, not a sha, no reason, a reason one over the limit
        for url, body, code, text in (
            (f"/api/artifacts/{'0' * 64}/bad", {"reason": "x"}, 404, "no artifact"),
            ("/api/artifacts/nope/bad", {"reason": "x"}, 404, "no such artifact"),
            (path, {}, 400, "reason"),
            (path, {"reason": ""}, 400, "reason"),
            (path, {"reason": "r" * 501}, 400, "reason"),
        ):
            status, doc = server.call("POST", url, body)
            assert status == code and text in doc["error"]["message"], (url, body, doc)
        assert server.get(f"/api/artifacts/{sha}")["bad"] is None
        # the limit passes: 500 characters
        status, doc = server.call("POST", path, {"reason": "r" * 500})
        assert status == 200 and doc["artifact"]["bad"]["reason"] == "r" * 500, doc
        status, doc = server.call("POST", path, {"reason": "NaN outputs on cam-02"})
        assert status == 200, doc
        assert doc["artifact"]["bad"]["reason"] == "NaN outputs on cam-02" and doc["artifact"]["bad"]["actor"]
        assert doc["targets"] == [
            {"scope": "fleet", "name": None, "model": "scale"},
            {"scope": "group", "name": "kitchen", "model": "scale"},
        ]
        assert doc["rollouts"] == []
        listed = {a["sha256"]: a for a in server.get("/api/artifacts")["artifacts"]}
        assert listed[sha]["bad"]["reason"] == "NaN outputs on cam-02"
        # new targets and rollouts naming it: 422 naming it
        status, doc = server.call("PUT", "/api/targets/groups/yard", {"models": {"scale": sha}})
        assert (
            status == 422
            and f"models.scale: artifact {sha[:12]} marked bad: NaN outputs on cam-02" in doc["error"]["message"]
        ), doc
        status, doc = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [100], "group": "kitchen"})
        assert status == 422 and f"artifact: artifact {sha[:12]} marked bad" in doc["error"]["message"], doc
        marks = _audit(server, "artifact.bad")
        assert [e["outcome"] for e in marks] == ["ok", "ok"] + ["refused"] * 5
        assert marks[0]["detail"]["reason"] == "NaN outputs on cam-02" and marks[0]["target"] == sha
        assert len(marks[0]["detail"]["targets"]) == 2
        # cleared (audited): the target may be set again
        status, doc = server.call("DELETE", path)
        assert status == 200 and doc["artifact"]["bad"] is None, doc
        good = _audit(server, "artifact.good")
        assert good[0]["outcome"] == "ok" and good[0]["detail"]["cleared"]["reason"] == "NaN outputs on cam-02"
        assert server.call("PUT", "/api/targets/groups/yard", {"models": {"scale": sha}})[0] == 200
        assert server.call("DELETE", f"/api/artifacts/{'0' * 64}/bad")[0] == 404
    finally:
        server.stop()


def test_a_running_rollout_of_a_release_marked_bad_is_paused_with_the_reason_not_failed(
    tmp_path, mosquitto_broker, server_keys, release
):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    env = {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}
    kitchen = SimFleet(
        mosquitto_broker.host,
        mosquitto_broker.port,
        2,
        prefix="k",
        behaviour=Behaviour(groups=("kitchen",), model_name="scale"),
    )
    try:
        with kitchen:
            assert wait_for(lambda: server.get("/api/devices?group=kitchen&online=true")["total"] == 2, 30)
            sha = _upload(server, release)
            status, created = server.call(
                "POST", "/api/rollouts", {"artifact": sha, "waves": [50, 100], "group": "kitchen", "soak_s": 3600}
            )
            assert status == 201, created
            rollout = created["id"]
            assert wait_for(lambda: server.get(f"/api/rollouts/{rollout}")["state"] == "running", 30)
            marked = edgepack("artifact", "bad", sha, "--reason", "NaN outputs on k-0", env=env)
            assert marked.returncode == 0, marked.stderr
            assert rollout in marked.stdout and "NaN outputs on k-0" in marked.stdout
            assert wait_for(lambda: server.get(f"/api/rollouts/{rollout}")["state"] == "paused", 30)
            doc = server.get(f"/api/rollouts/{rollout}")
            assert doc["reason"] == f"artifact {sha[:12]} marked bad: NaN outputs on k-0", doc
            status, refused = server.call("POST", f"/api/rollouts/{rollout}/resume", {})
            assert status == 409 and "marked bad" in refused["error"]["message"], refused
            cleared = edgepack("artifact", "good", sha, env=env)
            assert cleared.returncode == 0, cleared.stderr
            assert server.call("POST", f"/api/rollouts/{rollout}/resume", {})[0] == 200
            assert server.get(f"/api/rollouts/{rollout}")["state"] == "running"
        assert not _audit(server, "rollout.fail")
        pauses = _audit(server, "rollout.pause")
        assert pauses[0]["actor"].startswith("server:") and "NaN outputs on k-0" in pauses[0]["detail"]["reason"]
    finally:
        server.stop()


def test_the_cli_refuses_a_mark_without_a_reason_in_one_line(tmp_path):
    result = edgepack(
        "artifact", "bad", "a" * 64, "--server", "http://127.0.0.1:9", "--token-file", str(tmp_path / "missing")
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
