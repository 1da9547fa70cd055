"""The update-path attacks of issue 12, replayed against a real agent subprocess and a real
mosquitto: each test is named after the attack and asserts the agent refuses it with a clear
event while the device keeps serving its model.

Commands are published the way an attacker (or an operator) would: JSON on ``dev/{d}/cmd``.
The agent runs with ``operator_keys``, so state-changing commands must be signed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import tarfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from edgepack_core.command_auth import sign_command
from edgepack_core.signing import generate_private_key, load_private_key
from sdk.artifact_writer import write_artifact
from sdk.keys import load_operator_key, write_operator_keypair
from tests.agent_process import AgentProcess, LoadGenerator, Observer
from tests.artifacts import build_artifact, resign_with_changes, scale_model

pytestmark = pytest.mark.slow

DEVICE = "pi-07"
CMD_TOPIC = f"edgepack/v1/dev/{DEVICE}/cmd"
BANNER = b"SSH-2.0-OpenSSH_9.6 edgepack-secret-banner\r\n"


# ------------------------------------------------------------------ a hostile artifact origin


class HostileOrigin:
    """A raw TCP server on loopback standing in for a URL origin the agent allows, serving good
    artifacts and every hostile answer of the issue: cross-origin and non-HTTP redirects, an SSH
    banner instead of HTTP, and a slow-loris body (one byte every half second)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.origin = f"http://127.0.0.1:{self.port}"
        self.closing = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, path: str) -> str:
        return f"{self.origin}/{path}"

    def _serve(self) -> None:
        while not self.closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request and len(request) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ")[1].decode()
            with contextlib.suppress(OSError):  # the agent hung up (deadline, cancel): that is the point
                self._answer(conn, path)

    def _answer(self, conn: socket.socket, path: str) -> None:
        if path.startswith("/artifact/"):
            data = self.files[path.rsplit("/", 1)[1]].read_bytes()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
        elif path == "/redirect-cross":
            conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.2:9/x\r\nContent-Length: 0\r\n\r\n")
        elif path == "/redirect-ftp":
            conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: ftp://127.0.0.1/x\r\nContent-Length: 0\r\n\r\n")
        elif path == "/banner":
            conn.sendall(BANNER)
        elif path == "/slow":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not self.closing.wait(0.5):
                conn.sendall(b"x")

    def close(self) -> None:
        self.closing.set()
        self.sock.close()


# ------------------------------------------------------------------ fixtures


def _without_golden(artifact: Path, out: Path, key: Path, version: str) -> Path:
    """The same model re-signed with no golden samples (its smoke test has nothing to run)."""
    with tarfile.open(artifact) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        golden = {s[k] for s in manifest.get("golden", {}).get("samples", []) for k in ("inputs", "outputs")}
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()
                 if m.isfile() and m.name not in ("manifest.json", "manifest.sig") and m.name not in golden}
    manifest["files"] = {name: entry for name, entry in manifest["files"].items() if name not in golden}
    manifest["golden"] = {"samples": []}
    manifest["version"] = version
    write_artifact(out, manifest, files, [load_private_key(key)])
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("attacks")
    key = keypair[0]
    out = {
        "v1": build_artifact(folder, key, version="1.0.0", factor=2.0),
        "v2": build_artifact(folder, key, version="1.1.0", factor=3.0),
        "v3": build_artifact(folder, key, version="1.2.0", factor=4.0),
    }
    out["other"] = resign_with_changes(out["v2"], folder / "other.edgepkg", key,
                                       manifest_changes={"name": "othermodel", "version": "9.0.0"})
    out["silent"] = _without_golden(out["v2"], folder / "silent.edgepkg", key, "1.4.0")
    wide = scale_model(folder / "wide.onnx", 3.0, width=8)
    (folder / "wide.yaml").write_text(f"name: scale\nversion: 2.0.0\nmodel: {{path: {wide.name}}}\n"
                                      "postprocess: {kind: raw}\ntargets: [x86]\nvalidate: {data: synthetic}\n")
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe

    build(load_recipe(folder / "wide.yaml"), key_paths=[str(key)], output=folder / "wide.edgepkg")
    out["wide"] = folder / "wide.edgepkg"
    return out


@pytest.fixture(scope="module")
def operator(tmp_path_factory):
    folder = tmp_path_factory.mktemp("operator")
    write_operator_keypair(folder / "op.key", folder / "op.pub")
    return load_operator_key(folder / "op.key"), folder / "op.pub"


@pytest.fixture()
def origin(arts):
    server = HostileOrigin({path.name: path for path in arts.values()})
    yield server
    server.close()


@pytest.fixture()
def observer(mosquitto_broker):
    watch = Observer(mosquitto_broker.port)
    yield watch
    watch.close()


def start_agent(tmp_path, broker, keypair, operator, origin, arts, **updates) -> AgentProcess:
    settings = {"health_window_s": {"default": 1.0, "min": 0.5, "max": 30}, "allowed_origins": [origin.origin],
                "download_deadline_s": 120, "min_rate_bytes_s": 1, **updates}
    return AgentProcess(tmp_path, device=DEVICE, broker_port=broker.port, trust=keypair[1], artifact=arts["v1"],
                        groups=["kitchen"], operator_keys=[operator[1]], updates=settings).start()


@pytest.fixture()
def agent(tmp_path, mosquitto_broker, keypair, operator, origin, arts):
    process = start_agent(tmp_path, mosquitto_broker, keypair, operator, origin, arts)
    yield process
    process.stop()


# ------------------------------------------------------------------ commands


def command(kind: str, **fields) -> dict:
    now = time.time()
    return {"schema": "edgepack.cmd/1", "id": f"{kind}-{uuid.uuid4().hex[:10]}", "type": kind,
            "issued_at": round(now, 3), "expires_at": round(now + 600, 3), "target": {"device": DEVICE}, **fields}


def rollback_from(version: str, name: str = "scale") -> dict:
    """A rollback bound to the model it undoes (``from_version``)."""
    return command("rollback", from_version={"name": name, "version": version})


def deploy_of(artifact: Path, origin: HostileOrigin, *, url: str | None = None, **fields) -> dict:
    data = artifact.read_bytes()
    with tarfile.open(artifact) as tar:
        manifest_version = json.loads(tar.extractfile("manifest.json").read())["version"]
    return command("deploy", artifact={"url": url or origin.url(f"artifact/{artifact.name}")},
                   version=manifest_version, size=len(data), sha256=hashlib.sha256(data).hexdigest(), **fields)


def send(observer: Observer, document: dict | bytes) -> str:
    payload = document if isinstance(document, bytes) else json.dumps(document)
    observer.publish(CMD_TOPIC, payload)
    return "" if isinstance(document, bytes) else document["id"]


def final_event(observer: Observer, job_id: str, timeout: float = 60) -> dict:
    assert observer.wait_for(lambda: any(e.get("final") for e in observer.jobs(DEVICE, job_id)), timeout), \
        observer.jobs(DEVICE, job_id)
    return [e for e in observer.jobs(DEVICE, job_id) if e.get("final")][-1]


def signed(document: dict, operator) -> dict:
    return sign_command(document, operator[0])


# ------------------------------------------------------------------ the attacks


def test_unsigned_force_downgrade_is_refused(agent, observer, arts, origin, operator):
    unsigned = deploy_of(arts["v2"], origin, force_downgrade=True)
    event = final_event(observer, send(observer, unsigned))
    assert event["state"] == "rejected" and "must be signed by an operator key" in event["reason"]

    stranger = sign_command(deploy_of(arts["v2"], origin), generate_private_key())
    event = final_event(observer, send(observer, stranger))
    assert event["state"] == "rejected" and "not an operator key" in event["reason"]

    elsewhere = signed({**deploy_of(arts["v2"], origin), "target": {"device": "pi-08"}}, operator)
    event = final_event(observer, send(observer, elsewhere))
    assert event["state"] == "rejected" and "not for this device" in event["reason"]

    tampered = signed(deploy_of(arts["v2"], origin), operator)
    tampered["force_downgrade"] = True
    event = final_event(observer, send(observer, tampered))
    assert event["state"] == "rejected" and "does not match the command" in event["reason"]
    assert agent.version() == "1.0.0"
    log = agent.log.read_text()
    assert "must be signed by one of 1 operator key(s)" in log and "no operator_keys" not in log


def test_health_window_0_or_nan_is_refused(agent, observer, arts, origin, operator):
    for value in (0, 0.49, 30.01):
        event = final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin, health_window_s=value),
                                                            operator)))
        assert event["state"] == "rejected" and "outside this device's range [0.5, 30]" in event["reason"]
    huge = final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin, health_window_s=1e9), operator)))
    assert huge["state"] == "rejected" and "health_window_s" in huge["reason"]
    nan = json.dumps(deploy_of(arts["v2"], origin, health_window_s=1.0)).replace('"health_window_s": 1.0',
                                                                                 '"health_window_s": NaN')
    send(observer, nan.encode())
    assert observer.wait_for(lambda: any("NaN" in e.get("reason", "") and e["state"] == "rejected"
                                         for e in observer.jobs(DEVICE)), 20), observer.jobs(DEVICE)
    assert agent.version() == "1.0.0"


def test_rollback_from_anyone_is_refused(agent, observer, arts, origin, operator):
    event = final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin), operator)))
    assert event["state"] == "active", event
    refused = final_event(observer, send(observer, rollback_from("1.1.0")))
    assert refused["state"] == "rejected" and "must be signed" in refused["reason"]
    assert agent.version() == "1.1.0"
    other_group = signed({**rollback_from("1.1.0"), "target": {"group": "garage"}}, operator)
    observer.publish("edgepack/v1/grp/kitchen/cmd", json.dumps(other_group))
    refused = final_event(observer, other_group["id"])
    assert refused["state"] == "rejected" and "not for this device" in refused["reason"]
    assert agent.version() == "1.1.0"
    by_group = signed({**rollback_from("1.1.0"), "target": {"group": "kitchen"}}, operator)
    observer.publish("edgepack/v1/grp/kitchen/cmd", json.dumps(by_group))
    done = final_event(observer, by_group["id"])
    assert done["state"] == "done" and "rolled back to scale 1.0.0" in done["reason"]
    assert agent.version() == "1.0.0"


def test_cross_name_upgrade_othermodel_9_is_refused(agent, observer, arts, origin, operator):
    event = final_event(observer, send(observer, signed(deploy_of(arts["other"], origin, name="othermodel"),
                                                        operator)))
    assert event["state"] == "rejected" and "'othermodel' is not allowed on this device" in event["reason"]
    assert agent.version() == "1.0.0"


def test_ssrf_redirect_and_banner_echo_are_refused(agent, observer, arts, origin, operator, mosquitto_broker):
    def fetch(url: str) -> dict:
        return final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin, url=url), operator)))

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    # an origin that is not allowed: an open port (the broker) and a closed one answer alike
    open_port = fetch(f"http://127.0.0.1:{mosquitto_broker.port}/x")
    closed_port_event = fetch(f"http://127.0.0.1:{closed_port}/x")
    assert open_port["state"] == closed_port_event["state"] == "failed"
    assert open_port["reason"] == closed_port_event["reason"] == \
        "the artifact URL is not on an origin this device allows"
    for path in ("redirect-cross", "redirect-ftp"):
        event = fetch(origin.url(path))
        assert event["state"] == "failed" and "redirected to another origin or scheme" in event["reason"], event
    banner = fetch(origin.url("banner"))
    assert banner["state"] == "failed"
    assert "SSH" not in json.dumps(banner) and "secret" not in json.dumps(banner)
    assert banner["reason"] == "download failed: could not fetch from the server", banner
    assert agent.version() == "1.0.0"


def test_slow_loris_download_is_cut_off(tmp_path, mosquitto_broker, keypair, operator, origin, arts, observer):
    agent = start_agent(tmp_path, mosquitto_broker, keypair, operator, origin, arts, download_deadline_s=3)
    try:
        started = time.monotonic()
        event = final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin, url=origin.url("slow")),
                                                            operator)), timeout=30)
        assert event["state"] == "failed" and "deadline of 3 s passed" in event["reason"], event
        assert time.monotonic() - started < 15
        assert agent.predict([1, 1, 1, 1])[0] == 200 and agent.version() == "1.0.0"
    finally:
        agent.stop()


def test_stuck_job_blocking_rollback_is_impossible(agent, observer, arts, origin, operator):
    assert final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin), operator)))["state"] == "active"
    stuck = send(observer, signed(deploy_of(arts["wide"], origin, url=origin.url("slow")), operator))
    assert observer.wait_for(lambda: any(e["state"] == "downloading" for e in observer.jobs(DEVICE, stuck)))
    started = time.monotonic()
    rollback = final_event(observer, send(observer, signed(rollback_from("1.1.0"), operator)), timeout=30)
    assert rollback["state"] == "done" and time.monotonic() - started < 10, rollback
    assert agent.version() == "1.0.0"
    superseded = final_event(observer, stuck, timeout=30)
    assert superseded["state"] == "cancelled" and "superseded by rollback" in superseded["reason"]

    second = send(observer, signed(deploy_of(arts["wide"], origin, url=origin.url("slow")), operator))
    assert observer.wait_for(lambda: any(e["state"] == "downloading" for e in observer.jobs(DEVICE, second)))
    cancel = final_event(observer, send(observer, signed(command("cancel", job=second), operator)))
    assert cancel["state"] == "done" and f"stopping deploy {second}" in cancel["reason"]
    assert final_event(observer, second, timeout=30)["state"] == "cancelled"
    assert agent.version() == "1.0.0"

    third = send(observer, signed(deploy_of(arts["wide"], origin, url=origin.url("slow")), operator))
    assert observer.wait_for(lambda: any(e["state"] == "downloading" for e in observer.jobs(DEVICE, third)))
    newer = final_event(observer, send(observer, signed(deploy_of(arts["v3"], origin), operator)))
    assert newer["state"] == "active", newer
    superseded = final_event(observer, third)
    assert superseded["state"] == "cancelled" and "superseded by deploy" in superseded["reason"]
    assert agent.version() == "1.2.0"


def test_failed_rollback_is_reported_failed_naming_what_serves(agent, observer, arts, origin, operator):
    assert final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin), operator)))["state"] == "active"
    models = agent.folder / f"{DEVICE}-store" / "models"
    (previous,) = [p for p in models.iterdir() if p.name.startswith("scale-1.0.0-")]
    with open(previous / "model" / "model.onnx", "ab") as handle:
        handle.write(b"bit rot")
    state_before = (agent.folder / f"{DEVICE}-store" / "state.json").read_bytes()
    event = final_event(observer, send(observer, signed(rollback_from("1.1.0"), operator)))
    assert event["state"] == "failed" and "rollback failed" in event["reason"], event
    assert event["reason"].endswith("serving scale 1.1.0")
    assert agent.version() == "1.1.0" and agent.predict([1, 1, 1, 1])[0] == 200
    assert (agent.folder / f"{DEVICE}-store" / "state.json").read_bytes() == state_before


def test_contract_change_audio_onto_image_device_is_refused(agent, observer, arts, origin, operator):
    """A model with another input contract (here x of width 8 where clients send width 4, as
    an audio model would land on an image device) is refused before install, and the device
    keeps serving with 0 failed requests; forced through, health sees the 4xx and rolls back."""
    with LoadGenerator(agent) as load:
        event = final_event(observer, send(observer, signed(deploy_of(arts["wide"], origin), operator)))
    assert event["state"] == "rejected" and "I/O contract changes: input 'x' dim 1 is 8, was 4" in event["reason"]
    assert load.failures == [] and load.ok > 0
    assert agent.version() == "1.0.0"

    # forced through, the 4xx from 3 distinct clients (contract_error_min_clients) roll it back
    with LoadGenerator(agent, sources=["127.0.0.1", "127.0.0.2", "127.0.0.3"]) as load:
        forced = final_event(observer, send(observer, signed(
            deploy_of(arts["wide"], origin, allow_contract_change=True, health_window_s=2), operator)))
    assert forced["state"] == "rolled_back" and "from 3 clients: the I/O contract broke" in forced["reason"], forced
    assert agent.version() == "1.0.0"


def test_two_wrong_shape_requests_from_one_local_client_do_not_roll_back_a_healthy_release(agent, observer, arts,
                                                                                             origin, operator):
    job = send(observer, signed(deploy_of(arts["v2"], origin, health_window_s=3), operator))
    assert observer.wait_for(lambda: any(e["state"] == "active" and not e["final"] for e in observer.jobs(DEVICE, job)))
    assert [agent.predict([1, 2, 3, 4, 5, 6, 7, 8])[0] for _ in range(2)] == [400, 400]  # wrong shape
    event = final_event(observer, job)
    assert event["state"] == "active" and "health window passed" in event["reason"], event
    assert "2 client errors from 1 client(s) not counted" in event["reason"]
    assert agent.version() == "1.1.0"


def test_zero_traffic_health_pass_is_impossible(agent, observer, arts, origin, operator):
    quiet = final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin), operator)))
    with tarfile.open(arts["v2"]) as tar:
        samples = len(json.loads(tar.extractfile("manifest.json").read())["golden"]["samples"])
    assert samples > 0
    assert quiet["state"] == "active" and f"0 live requests and {samples} probes" in quiet["reason"], quiet
    silent = final_event(observer, send(observer, signed(deploy_of(arts["silent"], origin), operator)))
    assert silent["state"] == "rolled_back" and "no evidence the model works" in silent["reason"], silent
    assert agent.version() == "1.1.0"


def _post(agent: AgentProcess, body: bytes) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{agent.port}/predict", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_forged_health_failures_by_nested_json_and_nan_inputs_are_ignored(agent, observer, arts, origin, operator):
    forged = [b'{"inputs": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
              b'{"inputs": {"x": [[NaN, 1, 2, 3]]}}', b'{"inputs": {"x": [[Infinity, 1, 2, 3]]}}']
    statuses: list[int] = []
    stop = threading.Event()

    def attack() -> None:
        while not stop.is_set():
            statuses.extend(_post(agent, body) for body in forged)

    thread = threading.Thread(target=attack)
    thread.start()
    try:
        event = final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin, health_window_s=3),
                                                            operator)))
    finally:
        stop.set()
        thread.join(30)
    assert len(statuses) >= 6 and set(statuses) == {400}, statuses[:10]
    assert event["state"] == "active" and "health window passed" in event["reason"], event
    assert agent.version() == "1.1.0"


def test_rollback_or_cancel_during_the_health_window_does_not_wait_for_it(agent, observer, arts, origin, operator):
    def watching(job_id: str) -> bool:
        return any(e["state"] == "active" and not e["final"] for e in observer.jobs(DEVICE, job_id))

    first = send(observer, signed(deploy_of(arts["v2"], origin, health_window_s=30), operator))
    assert observer.wait_for(lambda: watching(first))
    started = time.monotonic()
    rollback = final_event(observer, send(observer, signed(rollback_from("1.1.0"), operator)))
    assert rollback["state"] == "done" and "rolled back to scale 1.0.0" in rollback["reason"], rollback
    deploy = final_event(observer, first)
    assert deploy["state"] == "rolled_back" and f"rolled back by command {rollback['job']}" in deploy["reason"]
    assert time.monotonic() - started < 15 and agent.version() == "1.0.0"

    second = send(observer, signed(deploy_of(arts["v3"], origin, health_window_s=30), operator))
    assert observer.wait_for(lambda: watching(second))
    cancel = final_event(observer, send(observer, signed(command("cancel", job=second), operator)))
    assert cancel["state"] == "done" and "rolling it back" in cancel["reason"]
    ended = final_event(observer, second)
    assert ended["state"] == "rolled_back" and "cancelled by command" in ended["reason"], ended
    assert agent.version() == "1.0.0"


def test_full_disk_is_degraded_health_and_commands_fail_with_no_space(tmp_path, mosquitto_broker, keypair, operator,
                                                                     origin, arts, observer):
    """A store filesystem under ``updates.min_free_bytes`` (here: a floor no disk reaches): the
    device says so on /healthz and answers deploy, rollback and ping ``failed: no space`` from
    memory, journaling nothing and recording no command id."""
    agent = start_agent(tmp_path, mosquitto_broker, keypair, operator, origin, arts, min_free_bytes=2**50)
    try:
        health = agent.health()
        assert health["status"] == "degraded" and health["model"]["version"] == "1.0.0", health
        assert health["degraded"][0].startswith("no space: ") and f"updates.min_free_bytes ({2**50})" in \
            health["degraded"][0]
        for document in (signed(deploy_of(arts["v2"], origin), operator), signed(rollback_from("1.1.0"), operator),
                         command("ping")):
            event = final_event(observer, send(observer, document))
            assert event["state"] == "failed" and event["reason"].startswith("no space: "), event
        store = agent.folder / f"{DEVICE}-store"
        assert list((store / "jobs").glob("*")) == [] and not (store / "command-ids.json").exists()
        assert agent.version() == "1.0.0" and agent.predict([1, 1, 1, 1])[0] == 200
    finally:
        agent.stop()


def test_a_delayed_signed_rollback_for_v2_delivered_after_a_deploy_of_v3_is_refused(agent, observer, arts, origin,
                                                                                    operator):
    assert final_event(observer, send(observer, signed(deploy_of(arts["v2"], origin), operator)))["state"] == "active"
    delayed = signed(rollback_from("1.1.0"), operator)  # signed for v2, held back by the broker
    assert final_event(observer, send(observer, signed(deploy_of(arts["v3"], origin), operator)))["state"] == "active"
    refused = final_event(observer, send(observer, delayed))
    assert refused["state"] == "rejected", refused
    assert refused["reason"] == "the device has moved on: this rollback is from scale 1.1.0, the device serves " \
                                "scale 1.2.0"
    assert agent.version() == "1.2.0" and agent.predict([1, 1, 1, 1])[0] == 200
    send(observer, delayed)  # its id is spent: no later replay either
    events = lambda: observer.jobs(DEVICE, delayed["id"])  # noqa: E731
    assert observer.wait_for(lambda: any("already used" in e["reason"] for e in events())), events()
    bound = final_event(observer, send(observer, signed(rollback_from("1.2.0"), operator)))
    assert bound["state"] == "done" and "rolled back to scale 1.1.0" in bound["reason"], bound
    assert agent.version() == "1.1.0"
