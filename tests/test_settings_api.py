"""The fleet server's settings and keys API against a real `edgepack fleet serve` and simulated
devices: values refused as the device would refuse them (400 naming the key), scopes, keys of
the wrong kind, retirements that would lock the fleet out (409), the audit, and the CLI."""

from __future__ import annotations

import pytest

from edgepack_core.signing import OPERATOR, RELEASE, generate_private_key, key_id, load_public_key, public_key_pem
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys, wait_for
from tools.fleet_sim import Behaviour, SimFleet


@pytest.fixture(scope="module")
def server(tmp_path_factory, keypair):
    from tests.broker import start_mosquitto

    broker = start_mosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    keys = make_keys(tmp_path_factory.mktemp("keys"), release=keypair)
    process = FleetServerProcess(tmp_path_factory.mktemp("server"), broker=broker.address, keys=keys).start()
    fleet = SimFleet(broker.host, broker.port, 2, rate=1, prefix="st", behaviour=Behaviour(groups=("kitchen",)))
    with fleet:
        assert wait_for(lambda: process.get("/api/devices?online=true")["total"] == 2, 30)
        yield process
    process.stop()
    broker.kill()


def _refused(server: FleetServerProcess, method: str, path: str, body: dict, status: int, says: str) -> None:
    code, doc = server.call(method, path, body)
    assert code == status, (code, doc)
    assert says in doc["error"]["message"] and "\n" not in doc["error"]["message"], doc


def test_settings_are_checked_as_the_device_checks_them(server):
    _refused(
        server,
        "PUT",
        "/api/settings/fleet",
        {"set": {"mqtt.telemetry_intreval": 1}},
        400,
        "mqtt.telemetry_intreval: is not a remote setting",
    )
    _refused(
        server,
        "PUT",
        "/api/settings/fleet",
        {"set": {"api.listen": "0.0.0.0:1"}},
        400,
        "api.listen: can only be changed in agent.yaml on the device",
    )
    _refused(
        server, "PUT", "/api/settings/fleet", {"set": {"mqtt.telemetry_interval": 0.09}}, 400, "mqtt.telemetry_interval"
    )
    _refused(server, "PUT", "/api/settings/fleet", {"set": {"trust": ["x"]}}, 400, "edgepack fleet keys")
    _refused(server, "PUT", "/api/settings/devices/nobody", {"set": {"log_level": "debug"}}, 404, "no device nobody")
    _refused(server, "PUT", "/api/settings/fleet", {"set": {}, "colour": 1}, 400, "colour")
    code, doc = server.call(
        "PUT", "/api/settings/groups/kitchen", {"set": {"mqtt.telemetry_interval": 0.1}, "reason": "faster"}
    )
    assert code == 200, doc
    code, _ = server.call("PUT", "/api/settings/devices/st-00001", {"set": {"mqtt.telemetry_interval": 5}})
    assert code == 200
    view = server.get("/api/devices/st-00001/settings")
    assert view["settings"] == {"mqtt.telemetry_interval": 5} and view["sources"]["mqtt.telemetry_interval"] == "device"
    other = server.get("/api/devices/st-00000/settings")
    assert other["settings"] == {"mqtt.telemetry_interval": 0.1}
    assert other["sources"]["mqtt.telemetry_interval"] == "group kitchen"
    # a simulated device sends no settings report: the server says so and sends the document once
    assert wait_for(lambda: server.get("/api/devices/st-00000/settings")["sent"], 20)
    assert wait_for(
        lambda: "does not report settings" in server.get("/api/devices/st-00000/settings")["decision"]["reason"], 20
    )
    code, _ = server.call("PUT", "/api/settings/devices/st-00001", {"unset": ["mqtt.telemetry_interval"]})
    assert code == 200 and server.get("/api/devices/st-00001/settings")["settings"] == {"mqtt.telemetry_interval": 0.1}
    entries = [e for e in server.get("/api/audit?limit=200")["entries"] if e["action"] == "settings.set"]
    assert entries and entries[0]["actor"] == "admin"
    assert any(e["outcome"] == "refused" for e in entries)


def test_a_pipeline_its_schema_refuses_is_a_400_and_one_whose_parts_do_not_fit_is_a_422(server):
    """The OpenAPI document gives the pipeline schema for each item of ``pipelines`` (it said
    "any array", so schemathesis' ``[null]`` was schema-valid yet refused 400); a pipeline that
    schema accepts but the device's cross-field rules refuse is well-formed, so a 422."""
    body = server.get("/openapi.json")["paths"]["/api/settings/devices/{device_id}"]["put"]["requestBody"]
    items = body["content"]["application/json"]["schema"]["properties"]["set"]["properties"]["pipelines"]["items"]
    assert items["type"] == "object" and {"name", "source", "stages"} <= set(items["required"])
    path = "/api/settings/devices/st-00001"
    good = {"name": "cam", "source": {"file": "clip.mp4"}, "stages": [{"model": "detector"}]}
    _refused(server, "PUT", path, {"set": {"pipelines": [None]}}, 400, "pipelines[0]: expected object, got null")
    _refused(server, "PUT", path, {"set": {"pipelines": [{**good, "colour": 1}]}}, 400, "pipelines[0].colour")
    _refused(server, "PUT", path, {"set": {"pipelines": [{**good, "source": {}}]}}, 422,
             "pipelines[0].source: give exactly one of")
    _refused(server, "PUT", path, {"set": {"pipelines": [good, good]}}, 422,
             "pipelines[0].name: two pipelines are named 'cam'")
    code, doc = server.call("PUT", path, {"set": {"pipelines": [good]}})
    assert code == 200, doc
    assert server.get("/api/devices/st-00001/settings")["settings"]["pipelines"] == [good]
    code, doc = server.call("PUT", path, {"unset": ["pipelines"]})
    assert code == 200 and "pipelines" not in server.get("/api/devices/st-00001/settings")["settings"], doc


def test_keys_of_the_wrong_kind_and_lockout_retirements_are_refused(server, keypair):
    operator_pem = public_key_pem(generate_private_key(), OPERATOR).decode()
    _refused(
        server,
        "POST",
        "/api/keys",
        {"kind": RELEASE, "pem": operator_pem},
        422,
        "is an operator key, but a release key is needed",
    )
    _refused(server, "POST", "/api/keys", {"kind": RELEASE, "pem": "-----BEGIN PRIVATE KEY-----\nx\n"}, 422, "key")
    release = keypair[1].read_text()
    code, row = server.call("POST", "/api/keys", {"kind": RELEASE, "pem": release})
    assert code == 201 and row["key_id"] == key_id(load_public_key(keypair[1])) and row["in_use"]
    code, again = server.call("POST", "/api/keys", {"kind": RELEASE, "pem": release})
    assert code == 201 and again["key_id"] == row["key_id"]
    _refused(server, "DELETE", f"/api/keys/{row['key_id']}", None, 409, "is the last release key in use")
    code, op_row = server.call("POST", "/api/keys", {"kind": OPERATOR, "pem": operator_pem})
    assert code == 201
    server_op = server.keys.operator_pub.read_text()
    code, _ = server.call("POST", "/api/keys", {"kind": OPERATOR, "pem": server_op})
    assert code == 201
    signer = key_id(load_public_key(server.keys.operator_pub))
    _refused(server, "DELETE", f"/api/keys/{signer}", None, 409, "leaves no operator key this server signs with")
    code, retired = server.call("DELETE", f"/api/keys/{op_row['key_id']}")
    assert code == 200 and not retired["in_use"]
    _refused(server, "POST", "/api/keys", {"kind": OPERATOR, "pem": operator_pem}, 409, "retired")
    _refused(server, "DELETE", "/api/keys/0000000000000000", None, 404, "no key")
    view = server.get("/api/devices/st-00000/settings")
    assert view["settings"]["operator_keys"] == [signer] and view["settings"]["trust"] == [row["key_id"]]
    listed = edgepack("fleet", "keys", "list", "--server", server.url, "--token-file", str(server.keys.token_file))
    assert listed.returncode == 0 and f"{op_row['key_id']} operator  retired" in listed.stdout
    bad = edgepack(
        "fleet",
        "settings",
        "set",
        "--fleet",
        "--group",
        "g",
        "log_level=debug",
        "--server",
        server.url,
        "--token-file",
        str(server.keys.token_file),
    )
    assert bad.returncode == 2 and "exactly one of --device D, --group G or --fleet" in bad.stderr
    wrong = edgepack(
        "fleet",
        "settings",
        "set",
        "--fleet",
        "updates.max_error_rate=2",
        "--server",
        server.url,
        "--token-file",
        str(server.keys.token_file),
    )
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert "updates.max_error_rate: 2.0 is above the maximum 1" in wrong.stderr
