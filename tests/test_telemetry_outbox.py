"""The on-disk outbox: order, bounds and drop policy, accounting, crash safety, draining over MQTT."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from device_agent.telemetry.outbox import CACHE_KIB, Forwarder, MessageTooLargeError, Outbox
from edgepack_core.errors import UsageError
from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.topics import Topics
from tests.broker import Broker, start_mosquitto, wait_until

ROOT = Path(__file__).resolve().parent.parent
TOPICS = Topics()


def assert_accounting(outbox: Outbox) -> dict:
    counters = outbox.counters()
    assert counters["produced"] == counters["delivered"] + counters["dropped"] + counters["queued"], counters
    assert counters["dropped"] == sum(counters["dropped_by_kind"].values()), counters
    assert counters["queued"] == len(outbox)
    return counters


def test_messages_come_out_in_order_and_ack_counts_them_delivered(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    seqs = [outbox.put(TOPICS.telemetry("d1"), f"m{i}".encode(), 1, "telemetry") for i in range(10)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 10
    peeked = outbox.peek(4)
    assert [m.payload for m in peeked] == [b"m0", b"m1", b"m2", b"m3"]
    assert [m.payload for m in outbox.peek(3, after=peeked[-1].seq)] == [b"m4", b"m5", b"m6"]
    assert outbox.ack(seqs[0]) and outbox.ack(seqs[1])
    assert not outbox.ack(seqs[0])  # a second ack of the same message changes nothing
    assert outbox.refuse(seqs[2])
    counters = assert_accounting(outbox)
    assert (counters["produced"], counters["delivered"], counters["dropped"], counters["queued"]) == (10, 2, 1, 7)
    assert counters["refused"] == 1 and counters["dropped_by_kind"]["telemetry"] == 1
    assert outbox.peek(1)[0].payload == b"m3"
    with pytest.raises(UsageError):
        outbox.put("t", b"x", 1, "bogus")  # type: ignore[arg-type]


def test_pipeline_events_go_after_telemetry_and_before_state(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db", max_messages=3)
    outbox.put("s", b"state-0", 1, "state", retain=True)
    outbox.put("e", b"event-0", 1, "events")
    outbox.put("t", b"tel-0", 1, "telemetry")
    outbox.put("e", b"event-1", 1, "events")  # full: the telemetry goes first
    assert [m.payload for m in outbox.peek(10)] == [b"state-0", b"event-0", b"event-1"]
    outbox.put("e", b"event-2", 1, "events")  # no telemetry left: the oldest event, not the state
    assert [m.payload for m in outbox.peek(10)] == [b"state-0", b"event-1", b"event-2"]
    assert assert_accounting(outbox)["dropped_by_kind"] == {"telemetry": 1, "job": 0, "state": 0, "events": 1}


def test_bound_drops_oldest_telemetry_first_and_never_job_events(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db", max_messages=5, job_max_messages=8)
    outbox.put("j", b"job-0", 1, "job")
    outbox.put("s", b"state-0", 1, "state", retain=True)
    for i in range(6):
        outbox.put("t", f"tel-{i}".encode(), 1, "telemetry")
    # 8 produced, bound 5: the three oldest telemetry messages went; the job event and state stayed.
    assert [m.payload for m in outbox.peek(10)] == [b"job-0", b"state-0", b"tel-3", b"tel-4", b"tel-5"]
    counters = assert_accounting(outbox)
    assert counters["dropped_by_kind"] == {"telemetry": 3, "job": 0, "state": 0, "events": 0}

    # Job events push everything else out and then grow past the soft bound, up to the hard cap.
    for i in range(1, 8):
        outbox.put("j", f"job-{i}".encode(), 1, "job")
    assert [m.payload for m in outbox.peek(20)] == [f"job-{i}".encode() for i in range(8)]
    counters = assert_accounting(outbox)
    assert counters["dropped_by_kind"] == {"telemetry": 6, "job": 0, "state": 1, "events": 0}  # state after telemetry

    outbox.put("t", b"late telemetry", 1, "telemetry")  # no room for it while jobs fill the queue
    assert b"late telemetry" not in [m.payload for m in outbox.peek(20)]
    outbox.put("j", b"job-8", 1, "job")  # over the hard cap: the oldest job event goes, and is counted
    assert [m.payload for m in outbox.peek(20)] == [f"job-{i}".encode() for i in range(1, 9)]
    counters = assert_accounting(outbox)
    assert counters["dropped_by_kind"] == {"telemetry": 7, "job": 1, "state": 1, "events": 0}
    assert counters["produced"] == 17


def test_byte_bound_and_oversized_messages(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db", max_bytes=1000, job_max_bytes=1500)
    for _ in range(5):
        outbox.put("t", b"x" * 300, 1, "telemetry")
    counters = assert_accounting(outbox)
    assert counters["queued_bytes"] <= 1000 and counters["queued"] == 3
    with pytest.raises(MessageTooLargeError):
        outbox.put("t", b"x" * 1001, 1, "telemetry")
    outbox.put("j", b"y" * 1200, 1, "job")  # a job event may use the larger job bound
    assert [m.kind for m in outbox.peek(10)] == ["job"]
    assert_accounting(outbox)
    with pytest.raises(UsageError):
        Outbox(tmp_path / "other.db", max_messages=10, job_max_messages=5)


def test_counters_and_sequence_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    outbox = Outbox(path, max_messages=3)
    for i in range(5):
        outbox.put("t", f"{i}".encode(), 1, "telemetry")
    for message in outbox.peek(10):
        outbox.ack(message.seq)
    last = outbox.put("t", b"last", 1, "telemetry")
    before = assert_accounting(outbox)
    outbox.close()
    reopened = Outbox(path, max_messages=3)
    assert reopened.counters() == before
    assert (before["produced"], before["delivered"], before["dropped"], before["queued"]) == (6, 3, 2, 1)
    assert reopened.put("t", b"next", 1, "telemetry") > last  # sequence numbers are never reused
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_concurrent_producers_keep_the_accounting_exact(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db", max_messages=150)

    def produce(thread: int) -> None:
        for i in range(100):
            outbox.put("t", f"{thread}-{i}".encode(), 1, "job" if i % 10 == 0 else "telemetry")

    def consume() -> None:
        for _ in range(50):
            for message in outbox.peek(5):
                outbox.ack(message.seq)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(4)] + [threading.Thread(target=consume)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counters = assert_accounting(outbox)
    assert counters["produced"] == 400 and counters["dropped_by_kind"]["job"] == 0
    seqs = [m.seq for m in outbox.peek(1000)]
    assert seqs == sorted(seqs)


def test_the_sqlite_page_cache_is_bounded_also_after_a_recovery(tmp_path: Path) -> None:
    """Issue 25 item 10: SQLite's default cache (about 2 MiB) filled during an outage's backlog
    stayed resident after it drained; every connection the outbox makes is held to CACHE_KIB."""
    outbox = Outbox(tmp_path / "outbox.db")
    assert outbox._db.execute("PRAGMA cache_size").fetchone()[0] == -CACHE_KIB == -256
    (tmp_path / "garbage.db").write_bytes(b"this is not a sqlite database" * 100)
    recovered = Outbox(tmp_path / "garbage.db")
    assert recovered.recovered_from is not None
    assert recovered._db.execute("PRAGMA cache_size").fetchone()[0] == -CACHE_KIB


def test_garbage_outbox_file_is_moved_aside_and_recreated(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    garbage = b"this is not a sqlite database" * 100
    path.write_bytes(garbage)
    outbox = Outbox(path)
    assert outbox.recovered_from is not None and outbox.recovered_from.read_bytes() == garbage
    assert outbox.recovered_from.parent == tmp_path and outbox.degraded is None
    outbox.put("edgepack/v1/dev/d1/telemetry", b"after", 1, "telemetry")
    outbox.close()
    reopened = Outbox(path)  # the new file is a sound outbox that keeps what was queued
    assert [m.payload for m in reopened.peek()] == [b"after"] and reopened.recovered_from is None
    assert_accounting(reopened)


def test_outbox_with_damaged_pages_is_moved_aside_and_recreated(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    outbox = Outbox(path)
    for i in range(400):
        outbox.put("edgepack/v1/dev/d1/telemetry", b"x" * 200 + str(i).encode(), 1, "telemetry")
    outbox._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    outbox.close()
    raw = bytearray(path.read_bytes())
    assert len(raw) > 8 * 4096
    raw[2 * 4096:6 * 4096] = b"\xa5" * (4 * 4096)  # an SD card's bad sectors, past the header
    path.write_bytes(bytes(raw))
    recovered = Outbox(path)
    assert recovered.recovered_from is not None and recovered.recovered_from.exists()
    assert len(recovered) == 0 and recovered.counters()["produced"] == 0
    recovered.put("edgepack/v1/dev/d1/job", b"still works", 1, "job")
    assert [m.payload for m in recovered.peek()] == [b"still works"]


WRITER = textwrap.dedent("""
    import sys
    from device_agent.telemetry.outbox import Outbox
    outbox = Outbox(sys.argv[1], max_messages=100_000)
    i = 0
    while True:
        outbox.put("edgepack/v1/dev/d1/job", b"event-%d" % i, 1, "job" if i % 3 == 0 else "telemetry")
        i += 1
        print(i, flush=True)
""")


def test_power_cut_of_the_writer_kill_9_loses_no_committed_message(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, env=env)
    committed = 0
    try:
        assert writer.stdout is not None
        while committed < 300:
            line = writer.stdout.readline()
            assert line, "writer died"
            committed = int(line)
        writer.send_signal(signal.SIGKILL)  # mid-write, no chance to close or checkpoint
        writer.wait(5)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    outbox = Outbox(path, max_messages=100_000)
    counters = assert_accounting(outbox)
    assert len(outbox) >= committed  # every put that returned is still there
    assert counters["produced"] == len(outbox)  # and no half-written message or counter
    messages = outbox.peek(100_000)
    assert [m.payload for m in messages] == [b"event-%d" % i for i in range(len(messages))]


def test_broker_restart_outbox_drains_in_order_after_the_outage(tmp_path: Path) -> None:
    broker = start_mosquitto(workdir=tmp_path / "broker", persistence=True)
    try:
        _drain_across_an_outage(broker, tmp_path)
    finally:
        broker.kill()


def _drain_across_an_outage(broker: Broker, tmp_path: Path) -> None:
    received: list[bytes] = []
    lock = threading.Lock()

    def collect(message: Incoming) -> None:
        with lock:
            received.append(message.payload)

    # The fleet consumer keeps a persistent session, so the broker holds what arrives for it
    # while it is itself reconnecting after the restart.
    consumer = MqttTransport(broker.settings(client_id="fleet", session_expiry=600))
    consumer.subscribe(TOPICS.everything(), 1, collect)
    consumer.start()
    device = MqttTransport(broker.settings(client_id="d1"))
    outbox = Outbox(tmp_path / "outbox.db")
    forwarder = Forwarder(outbox, device, window=4)
    device.start()
    forwarder.start()
    try:
        assert wait_until(lambda: consumer.is_subscribed(TOPICS.everything()) and device.connected)
        for i in range(5):
            outbox.put(TOPICS.telemetry("d1"), b"m%d" % i, 1, "telemetry")
        assert wait_until(lambda: outbox.counters()["delivered"] == 5)

        broker.stop()  # saves the consumer's session to the persistence file
        assert wait_until(lambda: not device.connected)
        for i in range(5, 25):
            kind = "job" if i % 4 == 0 else "telemetry"
            topic = TOPICS.job("d1") if kind == "job" else TOPICS.telemetry("d1")
            outbox.put(topic, b"m%d" % i, 1, kind)
        counters = assert_accounting(outbox)
        assert counters["delivered"] == 5 and counters["queued"] == 20  # nothing is lost, nothing is sent

        broker.start()  # same port, same config
        assert wait_until(lambda: outbox.counters()["queued"] == 0, timeout=15), outbox.counters()
        counters = assert_accounting(outbox)
        assert (counters["produced"], counters["delivered"], counters["dropped"]) == (25, 25, 0)
        assert wait_until(lambda: len(received) >= 25, timeout=10), received
        assert received == [b"m%d" % i for i in range(25)]  # in order, each once
    finally:
        forwarder.stop()
        device.close()
        consumer.close()


def test_a_message_mqtt_cannot_carry_is_dropped_not_retried_forever(mosquitto_broker: Broker, tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    with pytest.raises(UsageError):
        outbox.put("edgepack/v1/dev/+/telemetry", b"x", 1, "telemetry")  # wildcards are refused at once
    outbox.put("edgepack/v1/" + "x" * 70_000, b"topic too long for MQTT", 1, "telemetry")
    outbox.put(TOPICS.telemetry("d1"), b"fine", 1, "telemetry")
    device = MqttTransport(mosquitto_broker.settings(client_id="d1"))
    forwarder = Forwarder(outbox, device)
    device.start()
    forwarder.start()
    try:
        assert wait_until(lambda: outbox.counters()["queued"] == 0), outbox.counters()
        counters = assert_accounting(outbox)
        assert (counters["delivered"], counters["refused"]) == (1, 1)
    finally:
        forwarder.stop()
        device.close()
