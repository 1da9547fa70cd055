"""States ordered by the connection they belong to: a will always beats the birth it follows.

Incident (issue 24, "Power loss is not offline"): after kill -9 the broker held the device's last
will, but a server that heard it as a retained message ordered it by the will's ts (the
connection time, before the birth) and kept showing the device online.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from device_agent.telemetry.session import ConnectionCounter
from edgepack_core.protocol.messages import SessionMark, parse_state
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.ingest import Writer
from sdk.fleet_server.liveness import HeardState, supersedes

E, OTHER = "00112233aabbccdd", "ffeeddcc99887766"


def _heard(n: int | None, status: str, heard: float, epoch: str = E) -> HeardState:
    return HeardState(None if n is None else SessionMark(epoch, n), status, heard)


def test_the_will_of_a_connection_beats_its_birth_even_when_heard_first():
    assert supersedes(_heard(3, "offline", heard=10.0), _heard(3, "online", heard=20.0))
    assert not supersedes(_heard(3, "online", heard=30.0), _heard(3, "offline", heard=20.0))


def test_a_later_connection_beats_an_earlier_one_whatever_the_arrival_order():
    assert supersedes(_heard(4, "online", heard=10.0), _heard(3, "offline", heard=20.0))
    assert not supersedes(_heard(3, "offline", heard=30.0), _heard(4, "online", heard=20.0))


def test_unmarked_or_other_epoch_states_are_ordered_by_when_they_were_heard():
    for new, old in ((_heard(None, "online", 10.0), _heard(9, "offline", 20.0)),
                     (_heard(9, "offline", 10.0, OTHER), _heard(1, "online", 20.0))):
        assert not supersedes(new, old)
        assert supersedes(HeardState(new.session, new.status, 20.0), old)  # equal heard: the newer write wins


def test_the_same_connection_and_status_falls_back_to_heard():
    """A birth republished when the model changes: same connection, later wins."""
    assert supersedes(_heard(5, "online", 21.0), _heard(5, "online", 20.0))
    assert not supersedes(_heard(5, "online", 19.0), _heard(5, "online", 20.0))


@pytest.mark.parametrize("doc, expected", [
    ({"epoch": E, "n": 7}, SessionMark(E, 7)),
    ({"epoch": E, "n": 0}, SessionMark(E, 0)),
    ({"epoch": E, "n": -1}, None),
    ({"epoch": E, "n": 2**62}, None),
    ({"epoch": E, "n": True}, None),
    ({"epoch": "ABCDEF0123456789", "n": 1}, None),  # upper case is not the agent's hex
    ({"epoch": "0011223", "n": 1}, None),  # 7 hex digits: too short
    ({"epoch": "0" * 33, "n": 1}, None),
    ([E, 1], None),
])
def test_a_session_mark_is_parsed_strictly_or_ignored(doc, expected):
    payload = json.dumps({"schema": "edgepack.state/1", "device": "d1", "status": "online", "ts": 1.0,
                          "session": doc}).encode()
    state = parse_state("d1", payload)
    assert not isinstance(state, str) and state.session == expected  # a bad mark never refuses the state


# ----------------------------------------------------------------------------- the database


@pytest.fixture()
def database(tmp_path: Path):
    opened = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    yield opened
    opened.dispose()


def _state(status: str, ts: float, n: int | None, reason: str = "") -> bytes:
    doc = {"schema": "edgepack.state/1", "device": "d1", "status": status, "ts": ts, "groups": ["g"],
           "model": {"name": "m", "version": "1.0.0"}, "reason": reason}
    if n is not None:
        doc["session"] = {"epoch": E, "n": n}
    return json.dumps(doc).encode()


def _apply(database: Database, payload: bytes, heard: float) -> None:
    with database.write() as connection:
        Writer(database).states(connection, [(parse_state("d1", payload), heard)])


def _status(database: Database) -> tuple[str, str]:
    with database.read() as connection:
        row = connection.execute(select(tables.devices).where(tables.devices.c.id == "d1")).mappings().one()
    return row["status"], row["status_reason"]


def test_power_loss_is_offline_when_the_server_hears_the_will_late_as_retained(database: Database):
    """The birth of connection 3 heard live at t=20; the server away when the broker published the
    will, which it then hears retained, at the will's own ts (10: the connection time)."""
    _apply(database, _state("online", 12.0, 3), heard=20.0)
    _apply(database, _state("offline", 10.0, 3, "connection lost (last will)"), heard=10.0)
    assert _status(database) == ("offline", "connection lost (last will)")


def test_an_old_connections_will_published_after_the_reconnect_does_not_mark_it_offline(database: Database):
    _apply(database, _state("online", 30.0, 4), heard=30.0)
    _apply(database, _state("offline", 10.0, 3, "connection lost (last will)"), heard=31.0)
    assert _status(database) == ("online", "")


def test_states_in_one_batch_are_ordered_by_connection(database: Database):
    with database.write() as connection:
        Writer(database).states(connection, [(parse_state("d1", _state("offline", 5.0, 2, "stopped")), 5.0),
                                             (parse_state("d1", _state("online", 6.0, 2)), 6.0)])
    assert _status(database) == ("offline", "stopped")


def test_unmarked_states_keep_the_old_order(database: Database):
    _apply(database, _state("online", 12.0, None), heard=20.0)
    _apply(database, _state("offline", 10.0, None, "connection lost (last will)"), heard=10.0)
    assert _status(database) == ("online", "")


# ----------------------------------------------------------------------------- the agent's counter


def test_the_connection_counter_only_grows_across_restarts(tmp_path: Path):
    path = tmp_path / "mqtt_session.json"
    first = ConnectionCounter(path)
    marks = [first.advance() for _ in range(3)]
    assert [m.n for m in marks] == [1, 2, 3] and first.current == marks[-1]
    assert (path.stat().st_mode & 0o777) == 0o600
    again = ConnectionCounter(path)
    assert again.current == marks[-1] and again.advance() == SessionMark(marks[0].epoch, 4)


@pytest.mark.parametrize("content", [b"", b"{", b'{"epoch": "zz", "n": 1}', b'{"epoch": "00112233", "n": -4}',
                                     b"[1, 2]", b" " * 5000])
def test_a_lost_or_corrupt_counter_file_starts_a_new_epoch(tmp_path: Path, content: bytes):
    path = tmp_path / "mqtt_session.json"
    path.write_bytes(content)
    counter = ConnectionCounter(path)
    assert counter.current.n == 0 and counter.advance().n == 1
    assert json.loads(path.read_bytes())["epoch"] == counter.current.epoch


def test_a_counter_that_cannot_be_written_moves_to_a_fresh_epoch(tmp_path: Path):
    path = tmp_path / "mqtt_session.json"
    counter = ConnectionCounter(path)
    first = counter.advance()
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()  # the replace fails (as on a full or read-only disk), also for root
    after = counter.advance()
    assert after.epoch != first.epoch and after.n == 1
    path.rmdir()
    path.write_bytes(saved)
    restarted = ConnectionCounter(path)
    assert restarted.current == first and restarted.advance() == SessionMark(first.epoch, 2)
