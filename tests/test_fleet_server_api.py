"""The fleet server's REST API against a real `edgepack fleet serve`, a real mosquitto and simulated
devices: authentication, bounded and validated input, attacks on paths and uploads, the one error
shape, the audit table, the OpenAPI description, metrics, and `fleet status --server`."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sdk.keys import write_keypair
from tests.artifacts import build_artifact, resign_with_changes
from tests.broker import start_mosquitto
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys, wait_for
from tools.fleet_sim import Behaviour, SimFleet

MAX_UPLOAD = 64 * 1024


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    started = start_mosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    yield started
    started.kill()


@pytest.fixture(scope="module")
def keys(tmp_path_factory, keypair):
    return make_keys(tmp_path_factory.mktemp("keys"), release=keypair)


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("arts")
    good = build_artifact(folder, keypair[0], version="1.1.0")
    stranger = folder / "stranger.key"
    write_keypair(stranger, folder / "stranger.pub")
    return {"good": good, "untrusted": resign_with_changes(good, folder / "untrusted.edgepkg", stranger,
                                                           manifest_changes={"version": "1.2.0"})}


@pytest.fixture(scope="module")
def server(tmp_path_factory, broker, keys):
    process = FleetServerProcess(tmp_path_factory.mktemp("server"), broker=broker.address, keys=keys,
                                 extra=("--max-upload", str(MAX_UPLOAD)))
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def fleet(broker, server):
    """8 simulated devices: 5 in group 'kitchen', 3 in 'yard', telemetry at 5 Hz."""
    kitchen = SimFleet(broker.host, broker.port, 5, rate=5, prefix="k", behaviour=Behaviour(groups=("kitchen",)))
    yard = SimFleet(broker.host, broker.port, 3, rate=5, prefix="y",
                    behaviour=Behaviour(groups=("yard",), model_version="0.9.0"))
    with kitchen, yard:
        assert wait_for(lambda: server.get("/api/devices")["counts"]["online"] == 8, 30)
        assert wait_for(lambda: all(d["latency_ms"]["p50"] is not None for d in server.get("/api/devices")["devices"]),
                        30)
        yield kitchen, yard


def _error(status: int, doc: dict, code: str) -> None:
    assert set(doc) == {"error"} and set(doc["error"]) == {"status", "code", "message"}, doc
    assert doc["error"]["status"] == status and doc["error"]["code"] == code, doc
    assert "\n" not in doc["error"]["message"]


def _audit(server: FleetServerProcess, action: str) -> list[dict]:
    return [e for e in server.get("/api/audit?limit=1000")["entries"] if e["action"] == action]


# ------------------------------------------------------------------ authentication

PROTECTED = [("GET", "/api/devices"), ("GET", "/api/devices/k-00000"), ("GET", "/api/devices/k-00000/telemetry"),
             ("GET", "/api/artifacts"), ("POST", "/api/artifacts"), ("GET", "/api/rollouts"),
             ("POST", "/api/rollouts"), ("POST", "/api/rollouts/ro-1/pause"), ("GET", "/api/audit"),
             ("GET", "/api/status"), ("GET", "/metrics"), ("GET", "/api/dead-letters"),
             ("PUT", "/api/devices/k-00000/groups")]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_missing_or_wrong_token_is_401(server, method, path):
    for token in (None, "0" * 48, f"{server.keys.token}x", server.keys.token[:-1]):
        status, doc = server.call(method, path, token=token, data=b"{}" if method == "POST" else None)
        assert status == 401, (token, status, doc)
        _error(401, doc, "unauthorized")


def test_a_401_names_the_scheme_and_a_basic_header_does_not_pass(server):
    request = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    request.request("GET", "/api/devices", headers={"Authorization": f"Basic {server.keys.token}"})
    answer = request.getresponse()
    assert answer.status == 401 and answer.getheader("WWW-Authenticate", "").startswith("Bearer")
    assert answer.getheader("X-Content-Type-Options") == "nosniff"
    assert "default-src 'self'" in answer.getheader("Content-Security-Policy", "")


def test_health_openapi_and_the_ui_shell_need_no_token(server):
    assert server.call("GET", "/healthz", token=None) == (200, {"status": "ok"})
    status, doc = server.call("GET", "/openapi.json", token=None)
    assert status == 200 and doc["openapi"].startswith("3.")
    status, _page = server.call("GET", "/ui/", token=None)
    assert status == 200


# ------------------------------------------------------------------ uploads


def _upload(server: FleetServerProcess, data: bytes) -> tuple[int, dict]:
    return server.call("POST", "/api/artifacts", data=data, headers={"Content-Type": "application/octet-stream"})


def _stored_files(server: FleetServerProcess) -> list[str]:
    store = server.artifacts
    return sorted(p.name for p in store.iterdir() if p.is_file()) + \
        sorted(p.name for p in (store / ".incoming").iterdir())


def test_upload_verifies_stores_once_and_serves_with_range(server, arts):
    data = arts["good"].read_bytes()
    status, doc = _upload(server, data)
    assert status in (200, 201), doc
    assert (doc["name"], doc["version"], doc["size"]) == ("scale", "1.1.0", len(data))
    assert doc["url"] == f"{server.url}/artifacts/{doc['sha256']}.edgepkg"
    again, same = _upload(server, data)
    assert again == 200 and same["sha256"] == doc["sha256"]
    assert f"{doc['sha256']}.edgepkg" in _stored_files(server)
    status, whole = server.call("GET", f"/artifacts/{doc['sha256']}.edgepkg", token=None)
    assert status == 200 and whole == data
    status, part = server.call("GET", f"/artifacts/{doc['sha256']}.edgepkg", token=None,
                               headers={"Range": "bytes=10-19"})
    assert status == 206 and part == data[10:20]
    status, tail = server.call("GET", f"/artifacts/{doc['sha256']}.edgepkg", token=None,
                               headers={"Range": "bytes=-5"})
    assert status == 206 and tail == data[-5:]
    status, _ = server.call("GET", f"/artifacts/{doc['sha256']}.edgepkg", token=None,
                            headers={"Range": f"bytes={len(data)}-"})
    assert status == 416
    entries = _audit(server, "artifact.upload")
    assert [e["detail"]["new"] for e in entries if e["target"] == doc["sha256"]][-2:] == [False, True]


def test_upload_signed_by_an_untrusted_key_is_refused_and_not_stored(server, arts):
    data = arts["untrusted"].read_bytes()
    status, doc = _upload(server, data)
    assert status == 422
    _error(422, doc, "refused")
    assert "untrusted key" in doc["error"]["message"]
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    assert not any(name.startswith(sha) for name in _stored_files(server))
    assert not any(name.startswith("upload-") for name in _stored_files(server))
    assert server.call("GET", f"/api/artifacts/{sha}")[0] == 404
    assert server.call("GET", f"/artifacts/{sha}.edgepkg", token=None)[0] == 404
    refused = [e for e in _audit(server, "artifact.upload") if e["outcome"] == "refused"]
    assert refused and "untrusted key" in refused[0]["detail"]["reason"]


def test_upload_size_limit_at_the_boundary(server):
    at_limit, doc = _upload(server, b"\x1f\x8b" + b"\0" * (MAX_UPLOAD - 2))
    assert at_limit == 422, doc  # read whole, then refused by verification: not by size
    over, doc = _upload(server, b"\0" * (MAX_UPLOAD + 1))
    assert over == 413
    _error(413, doc, "too_large")
    assert not any(name.startswith("upload-") for name in _stored_files(server))


def test_upload_bomb_without_content_length_is_cut_at_the_limit(server):
    """A chunked upload never says its size: the server counts and stops at the limit."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"\0" * 16384 for _ in range(64))  # 1 MiB, far over the 64 KiB limit
    connection.request("POST", "/api/artifacts", body=chunks, encode_chunked=True,
                       headers={"Authorization": f"Bearer {server.keys.token}", "Transfer-Encoding": "chunked"})
    answer = connection.getresponse()
    assert answer.status == 413
    _error(413, json.loads(answer.read()), "too_large")
    assert not any(name.startswith("upload-") for name in _stored_files(server))


def test_upload_claiming_a_huge_content_length_is_refused_before_reading(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("POST", "/api/artifacts")
    connection.putheader("Authorization", f"Bearer {server.keys.token}")
    connection.putheader("Content-Length", str(10**12))
    connection.endheaders()
    answer = connection.getresponse()  # nothing sent: the answer comes from the header alone
    assert answer.status == 413


# ------------------------------------------------------------------ paths and parameters


@pytest.mark.parametrize("name", [
    "..%2F..%2F..%2Fetc%2Fpasswd", "..", ".incoming", "fleet.db", "%2e%2e%2ffleet.db",
    "A" * 64 + ".edgepkg", "0" * 63 + ".edgepkg", "0" * 64 + ".edgepkg.tmp", "0" * 64, "0" * 64 + ".edgepkg%00",
])
def test_path_traversal_on_artifact_downloads_finds_nothing(server, name):
    status, doc = server.call("GET", f"/artifacts/{name}", token=None)
    assert status == 404
    assert isinstance(doc, dict) and doc["error"]["status"] == 404


@pytest.mark.parametrize("device", ["..%2F..%2Fetc", "a%00b", "d" * 65, "-lead", "a%2Fb", "%2e%2e"])
def test_device_id_injection_in_paths_is_404(server, device):
    status, doc = server.call("GET", f"/api/devices/{device}")
    assert status == 404
    _error(404, doc, "not_found")


@pytest.mark.parametrize("query", ["?colour=red", "?limit=0", "?limit=10001", "?online=yes", "?offset=-1",
                                   "?group=a/b", "?limit=1&limit=2", "?limit=" + "9" * 30])
def test_bad_query_parameters_are_400(server, query):
    status, doc = server.call("GET", f"/api/devices{query}")
    assert status == 400, query
    _error(400, doc, "invalid")


def test_query_bounds_accept_their_limits(server):
    assert server.call("GET", "/api/devices?limit=10000&offset=0")[0] == 200
    assert server.call("GET", "/api/devices?limit=1")[0] == 200


def test_telemetry_requests_are_bounded_in_points(server, fleet):
    now = time.time()
    assert server.call("GET", f"/api/devices/k-00000/telemetry?since={now - 5000}&until={now}&step=1")[0] == 200
    status, doc = server.call("GET", f"/api/devices/k-00000/telemetry?since={now - 5001}&until={now}&step=1")
    assert status == 422 and "at most 5000" in doc["error"]["message"]  # how values relate: no schema says it
    assert server.call("GET", f"/api/devices/k-00000/telemetry?since={now}&until={now - 1}")[0] == 422
    for query in ("since=nan", "since=-1", "step=0"):
        assert server.call("GET", f"/api/devices/k-00000/telemetry?{query}")[0] == 400, query


def test_unknown_routes_and_methods_share_the_error_shape(server):
    status, doc = server.call("GET", "/api/nothing-here")
    _error(404, doc, "not_found")
    status, doc = server.call("DELETE", "/api/devices")
    assert status == 405
    _error(405, doc, "method_not_allowed")


def test_a_405_names_every_method_the_path_allows(server):
    """RFC 9110: a 405 carries Allow. GET and POST of /api/rollouts are two routes; both are named."""
    for method, path, allowed in (("DELETE", "/api/devices", "GET, HEAD"), ("PUT", "/api/rollouts", "GET, HEAD, POST"),
                                  ("POST", "/healthz", "GET, HEAD"), ("DELETE", "/ui/index.html", "GET, HEAD")):
        request = urllib.request.Request(server.url + path, method=method,
                                         headers={"Authorization": f"Bearer {server.keys.token}"})
        try:
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as err:
            assert err.code == 405 and err.headers["Allow"] == allowed, (path, err.code, err.headers["Allow"])
        else:
            raise AssertionError(f"{method} {path} was accepted")


def test_the_openapi_document_does_not_echo_the_host_header(server):
    status, document = server.call("GET", "/openapi.json", token=None, headers={"Host": "attacker.example"})
    assert status == 200 and document["servers"] == [{"url": "/"}]
    assert "attacker.example" not in json.dumps(document)


# ------------------------------------------------------------------ JSON bodies


@pytest.mark.parametrize(("body", "problem"), [
    (b"[1, 2]", "must be a JSON object"),
    (b'{"artifact": NaN}', "not JSON"),
    (b"{", "not JSON"),
    (b"[" * 100000 + b"]" * 100000, "not JSON"),
    (json.dumps({"artifact": "0" * 64, "waves": [100], "colour": "red"}).encode(), "colour"),
    (json.dumps({"artifact": "0" * 64, "waves": [100]}).encode(), "exactly one of group or devices"),
    (json.dumps({"artifact": "0" * 64, "waves": [100], "group": "g", "devices": ["a"]}).encode(), "exactly one"),
    (json.dumps({"artifact": "../etc", "waves": [100], "group": "g"}).encode(), "artifact"),
    (json.dumps({"artifact": "0" * 64, "waves": [100], "devices": ["a/b"]}).encode(), "devices"),
    (json.dumps({"artifact": "0" * 64, "waves": [100], "group": "kitchen", "soak_s": -1}).encode(), "soak_s"),
])
def test_rollout_requests_are_validated_naming_the_problem(server, body, problem):
    status, doc = server.call("POST", "/api/rollouts", data=body, headers={"Content-Type": "application/json"})
    assert status == 400, doc
    _error(400, doc, "invalid")
    assert problem in doc["error"]["message"]


def test_rollout_bodies_over_the_limit_are_413(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("POST", "/api/rollouts")
    connection.putheader("Authorization", f"Bearer {server.keys.token}")
    connection.putheader("Content-Length", str(8 * 1024 * 1024 + 1))
    connection.endheaders()
    assert connection.getresponse().status == 413


def test_rollouts_of_unknown_artifacts_groups_or_devices_are_refused(server, fleet, arts):
    status, doc = server.call("POST", "/api/rollouts", {"artifact": "0" * 64, "waves": [100], "group": "kitchen"})
    assert status == 404 and "upload it first" in doc["error"]["message"]
    sha = _upload(server, arts["good"].read_bytes())[1]["sha256"]
    status, doc = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [100], "group": "garage"})
    assert status == 422 and "no online device" in doc["error"]["message"]
    status, doc = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [100],
                                                        "devices": ["k-00000", "ghost-1"]})
    assert status == 422 and "unknown device(s): ghost-1" in doc["error"]["message"]
    status, doc = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [50, 40, 100], "group": "kitchen"})
    assert status == 422 and "does not grow" in doc["error"]["message"]
    refused = [e for e in _audit(server, "rollout.create") if e["outcome"] == "refused"]
    assert len(refused) >= 4


def test_a_health_window_a_device_would_refuse_is_refused_at_creation_naming_the_bound(server, fleet, arts):
    """The rollout API's bound on health_window_s is the deploy command schema's (0..86400): the
    limit is accepted, one past it is a 400 naming the maximum, before anything is planned."""
    sha = _upload(server, arts["good"].read_bytes())[1]["sha256"]
    for window in (86400.001, 100000, -0.5):
        status, doc = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [100], "group": "yard",
                                                            "health_window_s": window})
        _error(400, doc, "invalid")
        assert "health_window_s" in doc["error"]["message"]
        assert ("maximum 86400" if window > 0 else "minimum 0") in doc["error"]["message"], doc
    for window in (86400, 0):
        status, created = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [100], "group": "yard",
                                                                "health_window_s": window})
        assert status == 201 and created["options"]["health_window_s"] == window, created
        assert server.call("POST", f"/api/rollouts/{created['id']}/abort", {})[0] == 200


def test_actions_on_a_missing_rollout_and_invalid_transitions(server, fleet, arts):
    status, doc = server.call("POST", "/api/rollouts/ro-000000000000/pause", {})
    _error(404, doc, "not_found")
    sha = _upload(server, arts["good"].read_bytes())[1]["sha256"]
    status, created = server.call("POST", "/api/rollouts", {"artifact": sha, "waves": [100], "group": "yard",
                                                            "wave_timeout_s": 60})
    assert status == 201, created
    status, doc = server.call("POST", f"/api/rollouts/{created['id']}/abort", {"reason": "changed my mind"})
    assert status == 200 and doc["state"] == "aborted" and doc["reason"] == "changed my mind"
    status, doc = server.call("POST", f"/api/rollouts/{created['id']}/resume", {})
    assert status == 409
    _error(409, doc, "conflict")
    assert "cannot resume a rollout that is aborted" in doc["error"]["message"]
    status, doc = server.call("POST", f"/api/rollouts/{created['id']}/pause", {"reason": 5})
    assert status == 400
    actions = {(e["action"], e["outcome"]) for e in server.get("/api/audit?limit=1000")["entries"]
               if e["target"] == created["id"]}
    assert actions >= {("rollout.create", "ok"), ("rollout.abort", "ok"), ("rollout.resume", "refused"),
                       ("rollout.pause", "refused")}


# ------------------------------------------------------------------ reads


def test_device_list_filters_and_fields(server, fleet):
    everything = server.get("/api/devices")
    assert everything["total"] == 8 and everything["counts"]["by_version"] == {"1.0.0": 5, "0.9.0": 3}
    assert everything["counts"]["by_provider"] == {"CPUExecutionProvider": 8}
    kitchen = server.get("/api/devices?group=kitchen")
    assert [d["id"] for d in kitchen["devices"]] == [f"k-{i:05d}" for i in range(5)]
    assert [d["id"] for d in server.get("/api/devices?version=0.9.0")["devices"]] == ["y-00000", "y-00001", "y-00002"]
    assert server.get("/api/devices?online=false")["total"] == 0
    page = server.get("/api/devices?limit=3&offset=6")
    assert [d["id"] for d in page["devices"]] == ["y-00001", "y-00002"] and page["total"] == 8
    device = kitchen["devices"][0]
    assert device["online"] is True and device["groups"] == ["kitchen"] and device["version"] == "1.0.0"
    assert device["provider"] == "CPUExecutionProvider" and device["profile"] == "x86"
    assert device["latency_ms"]["p50"] > 0 and device["error_rate"] == 0.0 and device["last_seen"] > time.time() - 20
    one = server.get("/api/devices/k-00000")
    assert one["capabilities"]["simulated"] is True
    assert server.call("GET", "/api/devices/nobody")[0] == 404


def test_device_telemetry_points(server, fleet):
    doc = wait_for(lambda: (lambda d: d if sum(p["samples"] for p in d["points"]) >= 10 else None)(
        server.get(f"/api/devices/k-00001/telemetry?since={time.time() - 60}&step=1")), 20)
    assert doc is not None and doc["step"] == 1
    point = doc["points"][-2]
    assert point["samples"] >= 3 and point["inferences"] == 10 * point["samples"] and point["error_rate"] == 0.0
    assert point["latency_p50_ms"] > 0 and point["latency_p99_ms"] >= point["latency_p50_ms"]


def _online_lines(server: FleetServerProcess) -> set[str]:
    """The devices-online gauge lines the device list implies right now (an earlier test's
    rollout to 'yard' may have updated some of those devices before it was aborted)."""
    counts: dict[tuple[str, str], int] = {}
    for device in server.get("/api/devices")["devices"]:
        if device["online"]:
            key = (device["version"], device["provider"])
            counts[key] = counts.get(key, 0) + 1
    return {f'edgepack_fleet_devices_online{{version="{v}",provider="{p}"}} {n}' for (v, p), n in counts.items()}


def test_metrics_in_prometheus_format(server, fleet):
    def consistent() -> str | None:
        text = server.call("GET", "/metrics")[1].decode()
        gauge = {line for line in text.splitlines() if line.startswith("edgepack_fleet_devices_online{")}
        return text if gauge == _online_lines(server) else None

    text = wait_for(consistent, 20)
    assert text is not None
    online = [line for line in text.splitlines() if line.startswith("edgepack_fleet_devices_online{")]
    assert sum(int(line.split()[-1]) for line in online) == 8
    assert all('provider="CPUExecutionProvider"' in line for line in online)
    assert 'edgepack_fleet_rollouts{state="running"}' in text
    assert "# TYPE edgepack_fleet_ingest_stored_total counter" in text
    stored = next(line for line in text.splitlines()
                  if line.startswith('edgepack_fleet_ingest_stored_total{kind="telemetry"}'))
    assert float(stored.split()[-1]) > 0
    assert "edgepack_fleet_ingest_lag_seconds" in text and "edgepack_fleet_ingest_rate" in text
    for line in text.splitlines():
        assert line.startswith("#") or " " in line, line


def test_refused_tokens_are_counted_in_the_metrics(server):
    def failures() -> float:
        text = server.call("GET", "/metrics")[1].decode()
        return float(next(line for line in text.splitlines()
                          if line.startswith("edgepack_fleet_api_auth_failures_total")).split()[-1])

    before = failures()
    for token in (None, "wrong-token-wrong-token"):
        assert server.call("GET", "/api/devices", token=token)[0] == 401
    assert failures() == before + 2


def test_status_reports_leadership_and_ingest(server, fleet):
    status = server.get("/api/status")
    assert status["leader"] is True and status["lease"]["holder"] == status["server_id"]
    assert status["ingest"]["stored"]["telemetry"] > 0 and status["ingest"]["control_connected"] is True


def test_fleet_status_reads_the_server(server, fleet):
    env = {"EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}
    table = edgepack("fleet", "status", "--server", server.url, "--group", "yard", env=env)
    assert table.returncode == 0, table.stderr
    assert "y-00002" in table.stdout and "k-00000" not in table.stdout and "3 device(s), 3 online" in table.stdout
    as_json = edgepack("fleet", "status", "--server", server.url, "--json", env=env)
    assert json.loads(as_json.stdout)["total"] == 8


def test_fleet_status_errors_are_one_line(server, tmp_path: Path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-right-token-at-all\n")
    refused = edgepack("fleet", "status", "--server", server.url, "--token-file", str(wrong))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "401 unauthorized" in refused.stderr
    gone = edgepack("fleet", "status", "--server", "http://127.0.0.1:1", "--token-file", str(wrong))
    assert gone.returncode == 1 and "cannot reach the fleet server" in gone.stderr and "Traceback" not in gone.stderr
    missing = edgepack("fleet", "status", "--server", server.url)
    assert missing.returncode == 2 and "--token-file" in missing.stderr


def test_openapi_describes_exactly_the_routes_the_server_has(tmp_path: Path, keypair):
    from starlette.routing import Mount, Route

    from edgepack_core.signing import TrustStore
    from sdk.fleet_server.api import ApiContext, build_app
    from sdk.fleet_server.artifacts import ArtifactStore
    from sdk.fleet_server.auth import TokenCheck, parse_tokens
    from sdk.fleet_server.db import open_database
    from sdk.fleet_server.openapi import describe
    from sdk.fleet_server.retention import RetentionPolicy

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        context = ApiContext(database=database, tokens=TokenCheck(parse_tokens("a:0123456789abcdef")),
                             store=ArtifactStore(tmp_path / "store", TrustStore.from_paths([keypair[1]])),
                             retention=RetentionPolicy(), artifact_url=lambda sha: sha)
        app = build_app(context)
    finally:
        database.dispose()
    served = {(method.lower(), route.path) for route in app.routes if isinstance(route, Route)
              and route.include_in_schema for method in route.methods if method != "HEAD"}
    assert [route.path for route in app.routes if isinstance(route, Mount)] == ["/ui"]
    document = describe()
    described = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert served == described
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert operation["summary"] and "default" in operation["responses"], (method, path)
            names = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert names == set(part[1:-1] for part in path.split("/") if part.startswith("{")), path
    schemas = document["components"]["schemas"]
    refs = {ref.split("/")[-1] for ref in _refs(document)}
    assert refs <= set(schemas)


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [*([node["$ref"]] if "$ref" in node else []), *(r for v in node.values() for r in _refs(v))]
    if isinstance(node, list):
        return [r for item in node for r in _refs(item)]
    return []


def test_a_write_the_driver_acts_on_is_answered_before_the_driver_wakes():
    """A server that dies in the round a write starts (a crash point, a kill) has already told
    the caller its change was stored: the answer's bytes go out first, then the driver wakes."""
    import asyncio

    from sdk.fleet_server.api import ApiContext

    events: list[str] = []
    context = ApiContext(database=None, tokens=None, store=None, retention=None,  # type: ignore[arg-type]
                         artifact_url=lambda sha: sha, wake_driver=lambda: events.append("wake"))
    response = context.answer_then_wake({"stored": True}, 201)

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        events.append(str(message["type"]))

    asyncio.run(response({"type": "http", "method": "PUT", "path": "/", "headers": []}, receive, send))
    assert events == ["http.response.start", "http.response.body", "wake"]
    assert response.status_code == 201 and json.loads(response.body) == {"stored": True}
