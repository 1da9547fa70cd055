"""Alerts (issue 25 item 7): the pure rules at their boundaries, the config file, the webhook sink
against a real HTTP receiver on loopback that fails the first N times, and the MQTT sink through
a real mosquitto. The end-to-end `fleet serve --alerts` run is in test_fleet_server_disk.py."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import queue
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from sqlalchemy import insert

from edgepack_core.mqtt_transport import MqttTransport
from sdk.errors import ServerConfigError
from sdk.fleet_server import alerts as rules
from sdk.fleet_server import audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.alert_config import (
    ALERTS_SCHEMA,
    Delivery,
    ErrorRateRule,
    FailedUpdateRule,
    OfflineRule,
    RolloutRule,
    load_alerts,
    parse_alerts,
)
from sdk.fleet_server.alert_runner import AlertRunner, listing, start_alerts
from sdk.fleet_server.alert_sinks import SIGNATURE_HEADER, Outgoing, Sink, WebhookOutlet, backoff_delay, signature
from sdk.fleet_server.db import Database, open_database
from tests.broker import wait_until
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0


# ------------------------------------------------------------------ a real receiver


class Receiver:
    """An HTTP server on loopback that answers 500 to the first ``fail_first`` POSTs, then 204;
    every body it took (and the signature header) lands in ``received``."""

    def __init__(self, fail_first: int = 0, *, hold: threading.Event | None = None) -> None:
        self.fail_first = fail_first
        self.hold = hold
        self.attempts = 0
        self.received: queue.Queue[tuple[dict, str | None]] = queue.Queue()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if outer.hold is not None:
                    outer.hold.wait(10)
                outer.attempts += 1
                if outer.attempts <= outer.fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.received.put((json.loads(body), self.headers.get(SIGNATURE_HEADER), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def next(self, timeout: float = 10.0) -> tuple:
        return self.received.get(timeout=timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver(fail_first=2)
    yield found
    found.close()


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    found = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    yield found
    found.close()


FAST = Delivery(max_attempts=5, backoff_s=0.01, max_backoff_s=0.02, queue=10, timeout_s=5)


def _device(database: Database, device: str, last_seen: float) -> None:
    with database.write() as connection:
        connection.execute(
            insert(tables.devices).values(
                id=device, status="online", status_reason="", first_seen=last_seen, last_seen=last_seen
            )
        )


def _heard(database: Database, device: str, at: float) -> None:
    with database.write() as connection:
        connection.execute(tables.devices.update().where(tables.devices.c.id == device).values(last_seen=at))


def _audit(database: Database, action: str) -> list[dict]:
    return audit.entries(database, action=action)


# ------------------------------------------------------------------ pure rules


def test_offline_at_the_threshold_is_no_alert_and_just_past_it_is_one():
    rule = OfflineRule(after_s=300.0)
    at_limit = rules.offline(rule, [rules.Seen("cam-1", NOW - 300.0)], NOW)
    past = rules.offline(rule, [rules.Seen("cam-1", NOW - 300.001)], NOW)
    assert at_limit == []
    assert [c.key for c in past] == ["offline:cam-1"]
    assert rules.offline(None, [rules.Seen("cam-1", 0.0)], NOW) == []


def test_an_error_rate_equal_to_the_limit_is_no_alert_and_above_it_is_one():
    rule = ErrorRateRule(above=0.1, window_s=60, min_inferences=10)
    assert rules.error_rate(rule, [rules.Errors("a", 100, 10)]) == []
    assert [c.key for c in rules.error_rate(rule, [rules.Errors("a", 100, 11)])] == ["error_rate:a"]
    # too few inferences judge nothing: 9 is under min_inferences, 10 is enough
    assert rules.error_rate(rule, [rules.Errors("b", 9, 9)]) == []
    assert [c.subject for c in rules.error_rate(rule, [rules.Errors("b", 10, 9)])] == ["b"]


def test_a_failed_update_is_the_newest_final_deploy_that_failed_or_rolled_back():
    rule = FailedUpdateRule()
    jobs = [
        rules.FinalJob("a", "j1", "deploy", "failed", "smoke test failed"),
        rules.FinalJob("b", "j2", "deploy", "rolled_back", ""),
        rules.FinalJob("c", "j3", "deploy", "active", ""),
        rules.FinalJob("d", "j4", "rollback", "rolled_back", ""),
        rules.FinalJob("e", "j5", "deploy", "rejected", ""),
    ]
    assert [c.subject for c in rules.failed_update(rule, jobs)] == ["a", "b", "e"]


def test_only_rollout_state_changes_into_the_chosen_states_are_notices():
    changes = [
        rules.Change(1, "r1", "start", "pending", "running", 1, "", NOW),
        rules.Change(2, "r1", "advance", "running", "running", 2, "", NOW),
        rules.Change(3, "r1", "fail", "running", "failed", 2, "wave 2 missed its gates", NOW),
    ]
    notices = rules.rollout_notices(RolloutRule(), changes)
    assert [(n.key, n.source_id) for n in notices] == [("rollout:r1:3", 3)]
    assert "wave 2 missed its gates" in notices[0].summary


def test_plan_fires_only_what_is_not_open_and_resolves_what_is_no_longer_true():
    a, b = rules.Condition("offline", "a", "a"), rules.Condition("offline", "b", "b")
    decided = rules.plan({"offline:a", "offline:c"}, [a, b, b])
    assert decided.fire == (b,)
    assert decided.resolve == ("offline:c",)


def test_backoff_doubles_from_its_base_and_never_passes_its_cap():
    assert [backoff_delay(n, 1.0, 10.0) for n in range(0, 7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_delay(10_000, 1.0, 300.0) == 300.0  # no overflow on a long outage


# ------------------------------------------------------------------ config


def test_an_unknown_key_in_the_alerts_file_is_refused_naming_it(tmp_path: Path):
    path = tmp_path / "alerts.yaml"
    path.write_text("offline:\n  after: 60\n")
    with pytest.raises(ServerConfigError, match=r"offline\.after: unknown key \(known keys: after_s\)"):
        load_alerts(path)
    path.write_text("webhooks:\n  - url: ftp://example/\n")
    with pytest.raises(ServerConfigError, match=r"webhooks\[0\]\.url"):
        load_alerts(path)


def test_a_webhook_secret_file_others_can_read_is_refused(tmp_path: Path):
    secret = tmp_path / "hook.secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    document = {"webhooks": [{"url": "http://127.0.0.1:9/x", "secret_file": "hook.secret"}]}
    with pytest.raises(ServerConfigError, match="readable by others"):
        parse_alerts(document, base=tmp_path)
    secret.chmod(0o600)
    assert parse_alerts(document, base=tmp_path).secrets == (b"s3cret",)


def test_fleet_serve_refuses_a_bad_alerts_file_in_one_line_before_it_starts(tmp_path: Path):
    path = tmp_path / "alerts.yaml"
    path.write_text("ofline: {}\n")
    run = run_cli(
        "edgepack",
        "fleet",
        "serve",
        "--broker",
        "127.0.0.1:1",
        "--trust",
        str(path),
        "--token-file",
        str(path),
        "--operator-key",
        str(path),
        "--alerts",
        str(path),
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().count("\n") == 0 and "ofline: unknown key" in run.stderr


def test_the_shipped_alerts_schema_is_the_generated_one_and_edgepack_prints_it():
    published = json.loads((REPO / "schemas" / "alerts.schema.json").read_text())
    assert published == json.loads(json.dumps(ALERTS_SCHEMA)), (
        "run `edgepack schema alerts > schemas/alerts.schema.json`"
    )
    run = run_cli("edgepack", "schema", "alerts")
    assert run.returncode == 0 and json.loads(run.stdout) == published


def test_every_alerts_key_is_documented():
    docs = (REPO / "docs" / "fleet-server.md").read_text()

    def keys(schema: dict, prefix: str = "") -> Iterator[str]:
        for name, sub in schema.get("properties", {}).items():
            yield prefix + name
            yield from keys(sub.get("items", sub), f"{prefix}{name}{'[]' if 'items' in sub else ''}.")

    missing = [key for key in keys(ALERTS_SCHEMA) if f"`{key}`" not in docs]
    assert missing == [], "docs/fleet-server.md, Alerts, does not name these keys"


# ------------------------------------------------------------------ the webhook sink


def test_a_webhook_that_fails_twice_gets_the_alert_on_the_third_try_signed_with_bounded_backoff(
    database: Database, receiver: Receiver
):
    config = parse_alerts(
        {
            "offline": {"after_s": 60},
            "webhooks": [{"url": receiver.url}],
            "delivery": {"max_attempts": 5, "backoff_s": 0.01, "max_backoff_s": 0.015},
        }
    )
    secret = b"shared-secret"
    config = dataclasses.replace(config, secrets=(secret,))
    runner = start_alerts(database, config, None, server_id="s1")
    try:
        _device(database, "cam-1", NOW - 61)
        assert [item.event for item in runner.run_once(NOW)] == ["fired"]
        document, header, body = receiver.next()
        assert document["event"] == "fired" and document["key"] == "offline:cam-1"
        assert header == signature(secret, body) == "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()
        assert receiver.attempts == 3
        assert wait_until(lambda: _audit(database, "alert.sent"))
        sink = runner.sinks[0]
        assert sink.waits == [0.01, 0.015]  # 0.01 doubled is 0.02, capped at max_backoff_s
        (entry,) = _audit(database, "alert.sent")
        assert entry["target"] == "offline:cam-1" and entry["detail"]["attempts"] == 3
    finally:
        runner.stop()


def test_one_incident_is_one_alert_and_it_fires_again_only_after_it_resolved(database: Database):
    hook = Receiver()
    config = parse_alerts({"offline": {"after_s": 60}, "webhooks": [{"url": hook.url}]})
    runner = start_alerts(database, config, None, server_id="s1")
    try:
        _device(database, "cam-1", NOW - 100)
        assert len(runner.run_once(NOW)) == 1
        assert runner.run_once(NOW + 10) == []  # still offline: the same incident, no second alert
        assert hook.next()[0]["event"] == "fired"
        _heard(database, "cam-1", NOW + 20)
        assert [o.event for o in runner.run_once(NOW + 21)] == ["resolved"]
        resolved = hook.next()[0]
        assert resolved["event"] == "resolved" and resolved["resolved_at"] == NOW + 21
        assert [o.event for o in runner.run_once(NOW + 200)] == ["fired"]  # silent again: a new incident
        assert hook.next()[0]["event"] == "fired"
        doc = listing(database)
        assert [a["key"] for a in doc["open"]] == ["offline:cam-1"]
        assert [a["state"] for a in doc["recent"]] == ["open", "resolved"]
    finally:
        runner.stop()
        hook.close()


def test_a_second_runner_on_the_same_database_does_not_fire_an_open_incident_again(database: Database):
    _device(database, "cam-1", NOW - 100)
    config = parse_alerts({"offline": {"after_s": 60}})
    assert len(AlertRunner(database, config, [], server_id="s1").run_once(NOW)) == 1
    assert AlertRunner(database, config, [], server_id="s2").run_once(NOW + 1) == []  # a restart, another leader


def test_a_receiver_that_never_answers_2xx_is_given_up_and_audited(database: Database):
    hook = Receiver(fail_first=1000)
    runner = AlertRunner(database, parse_alerts({}), [], server_id="s1")
    sink = Sink(
        WebhookOutlet(hook.url, secret=None, timeout_s=5),
        Delivery(max_attempts=3, backoff_s=0.01, max_backoff_s=0.01),
        runner.record_outcome,
    )
    try:
        sink.enqueue(Outgoing("offline:x", "fired", b"{}"))
        assert wait_until(lambda: _audit(database, "alert.given_up"))
        (entry,) = _audit(database, "alert.given_up")
        assert entry["detail"]["attempts"] == 3 and "HTTP 500" in entry["detail"]["reason"]
        assert hook.attempts == 3
    finally:
        sink.stop()
        hook.close()


def test_a_hanging_receiver_never_blocks_the_server_the_queue_is_bounded(database: Database):
    release = threading.Event()
    hook = Receiver(hold=release)
    runner = AlertRunner(database, parse_alerts({}), [], server_id="s1")
    sink = Sink(WebhookOutlet(hook.url, secret=None, timeout_s=30), Delivery(queue=1), runner.record_outcome)
    try:
        assert sink.enqueue(Outgoing("a", "fired", b"{}"))
        assert wait_until(lambda: sink.depth == 0)  # taken by the sending thread, which hangs on the receiver
        assert sink.enqueue(Outgoing("b", "fired", b"{}"))  # the one place in the queue
        assert not sink.enqueue(Outgoing("c", "fired", b"{}"))  # full: given up at once, the caller not held
        (entry,) = _audit(database, "alert.given_up")
        assert entry["target"] == "c" and "queue of 1" in entry["detail"]["reason"]
        release.set()
        assert wait_until(lambda: len(_audit(database, "alert.sent")) == 2)
    finally:
        release.set()
        sink.stop()
        hook.close()


def test_alerts_still_queued_when_the_server_stops_are_audited_as_given_up(database: Database):
    release = threading.Event()
    hook = Receiver(hold=release)
    runner = AlertRunner(database, parse_alerts({}), [], server_id="s1")
    sink = Sink(WebhookOutlet(hook.url, secret=None, timeout_s=30), Delivery(), runner.record_outcome)
    try:
        sink.enqueue(Outgoing("a", "fired", b"{}"))
        assert wait_until(lambda: sink.depth == 0)  # in flight, held by the receiver
        sink.enqueue(Outgoing("b", "fired", b"{}"))
        sink.stop(timeout_s=0.01)
        (entry,) = _audit(database, "alert.given_up")
        assert entry["target"] == "b" and "server stopped" in entry["detail"]["reason"]
    finally:
        release.set()
        hook.close()


# ------------------------------------------------------------------ rules read from the database


def stored_rollout(
    connection, rollout_id: str, state: str, moves: list[tuple[str, str, str, str]], sha256: str = "a" * 64
) -> None:
    """An artifact, a one-wave rollout in ``state`` and its transitions (event, from, to, reason)."""
    connection.execute(
        insert(tables.artifacts).values(
            sha256=sha256, name="m", version="1.0.0", size=1, key_id="k", targets="[]", created_at=NOW, created_by="t"
        )
    )
    connection.execute(
        insert(tables.rollouts).values(
            id=rollout_id,
            artifact_sha256=sha256,
            name="m",
            version="1.0.0",
            state=state,
            wave=0,
            waves="[100]",
            wave_count=1,
            min_success_share=1.0,
            soak_s=0,
            wave_timeout_s=60,
            rollback_on_failure=False,
            force_downgrade=False,
            allow_contract_change=False,
            created_at=NOW,
            created_by="t",
            updated_at=NOW,
            revision=len(moves),
        )
    )
    connection.execute(
        insert(tables.rollout_transitions),
        [
            {
                "rollout_id": rollout_id,
                "at": NOW + n,
                "event": event,
                "from_state": before,
                "to_state": after,
                "wave": 1,
                "actor": "server:s1",
                "reason": reason,
            }
            for n, (event, before, after, reason) in enumerate(moves)
        ],
    )


def test_error_rate_and_failed_update_and_rollout_notices_come_from_the_stored_rows(database: Database):
    config = parse_alerts(
        {
            "error_rate": {"above": 0.1, "window_s": 60, "min_inferences": 10},
            "failed_update": {},
            "rollout": {"states": ["failed"]},
        }
    )
    runner = AlertRunner(database, config, [], server_id="s1")
    assert runner.run_once(NOW) == []  # the first round starts at the newest transition: no history replayed
    with database.write() as c:
        c.execute(
            insert(tables.telemetry_raw),
            [
                {"device": "a", "ts": NOW - 30, "inferences": 50, "errors": 6},
                {"device": "a", "ts": NOW - 10, "inferences": 50, "errors": 6},  # 12 of 100 in the window
                {"device": "b", "ts": NOW - 120, "inferences": 100, "errors": 100},
            ],
        )  # outside the window
        c.execute(
            insert(tables.job_events),
            [
                {
                    "device": "c",
                    "job": "j1",
                    "type": "deploy",
                    "state": "failed",
                    "final": True,
                    "reason": "smoke",
                    "ts": 1.0,
                    "received_at": NOW,
                },
                {
                    "device": "d",
                    "job": "j2",
                    "type": "deploy",
                    "state": "failed",
                    "final": True,
                    "reason": "",
                    "ts": 1.0,
                    "received_at": NOW,
                },
                {
                    "device": "d",
                    "job": "j3",
                    "type": "deploy",
                    "state": "active",
                    "final": True,
                    "reason": "",
                    "ts": 2.0,
                    "received_at": NOW,
                },
            ],
        )  # d's newest update succeeded
        stored_rollout(
            c,
            "r1",
            "failed",
            [("start", "pending", "running", ""), ("fail", "running", "failed", "wave 1 missed its gates")],
        )
    keys = sorted(item.key for item in runner.run_once(NOW))
    assert keys[:2] == ["error_rate:a", "failed_update:c"] and keys[2].startswith("rollout:r1:")
    assert len(keys) == 3
    assert runner.run_once(NOW + 1) == []  # each once


# ------------------------------------------------------------------ the MQTT sink


def test_an_alert_is_published_on_the_mqtt_topic_a_real_subscriber_reads(database: Database, mosquitto_broker):
    got: queue.Queue[tuple[str, dict]] = queue.Queue()
    subscriber = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="alerts-reader")
    subscriber.on_message = lambda _c, _u, message: got.put((message.topic, json.loads(message.payload)))
    subscribed = threading.Event()
    subscriber.on_subscribe = lambda *_args: subscribed.set()
    subscriber.on_connect = lambda client, *_args: client.subscribe("edgepack/v1/fleet/alerts", qos=1)
    subscriber.connect("127.0.0.1", mosquitto_broker.port)
    subscriber.loop_start()
    transport = MqttTransport(mosquitto_broker.settings(client_id="fleet-alerts"))
    transport.start()
    runner = start_alerts(database, parse_alerts({"offline": {"after_s": 5}, "mqtt": {}}), transport, server_id="s1")
    try:
        assert subscribed.wait(10) and wait_until(lambda: transport.connected, 10)
        _device(database, "cam-9", time.time() - 60)
        runner.run_once(time.time())
        topic, document = got.get(timeout=10)
        assert topic == "edgepack/v1/fleet/alerts"
        assert document["key"] == "offline:cam-9" and document["schema"] == rules.SCHEMA
        assert wait_until(lambda: _audit(database, "alert.sent"))
        assert _audit(database, "alert.sent")[0]["detail"]["sink"] == "mqtt:edgepack/v1/fleet/alerts"
    finally:
        runner.stop()
        transport.close()
        subscriber.loop_stop()
        subscriber.disconnect()
