"""The store survives its medium: a damaged state.json never deletes models, a read-only store
still serves, and nothing from the network becomes a path outside the store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from device_agent.errors import StoreError
from device_agent.runtime import load_model
from device_agent.store import ModelStore, parse_state
from edgepack_core.signing import TrustStore, load_public_key
from tests.artifacts import build_artifact
from tests.conftest import cli

SYNTHETIC = "validate: {data: synthetic}\n"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("medium-artifacts")
    return {version: build_artifact(folder, keypair[0], version=version, factor=factor, extra=SYNTHETIC)
            for version, factor in (("1.0.0", 2.0), ("1.1.0", 3.0), ("1.2.0", 4.0))}


@pytest.fixture()
def trust(keypair):
    return TrustStore([load_public_key(keypair[1])])


def _smoke(model):
    load_model(model.directory, model.verified.manifest)


def _two_installed(root: Path, artifacts, trust) -> ModelStore:
    store = ModelStore(root, trust)
    store.install(artifacts["1.0.0"], smoke_test=_smoke)
    store.install(artifacts["1.1.0"], smoke_test=_smoke)
    return store


DAMAGED = {
    "garbage": b"\x00\xff{not json",
    "empty": b"",
    "list_valued": b'["scale-1.1.0-abc", null]',
    "traversal_valued": b'{"active": "../../etc", "previous": null}',
    "wrong_types": b'{"active": 7, "previous": {"x": 1}}',
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_damaged_state_never_deletes_models(damage, tmp_path, artifacts, trust):
    root = tmp_path / "store"
    _two_installed(root, artifacts, trust)
    before = sorted(p.name for p in (root / "models").iterdir())
    (root / "state.json").write_bytes(DAMAGED[damage])

    store = ModelStore(root, trust)
    with pytest.raises(StoreError, match="run recovery"):
        store.prune()  # nothing acts on a damaged state but recovery
    active = store.recover()

    assert sorted(p.name for p in (root / "models").iterdir()) == before, "models were deleted"
    assert active is not None and active.version == "1.1.0", "the newest verified model is chosen"
    state = json.loads((root / "state.json").read_text())
    assert state["active"] == active.key and state["previous"].startswith("scale-1.0.0-")
    assert "recovered: scale 1.1.0 is active" in store.state_note
    assert store.status()["state_note"] == store.state_note
    assert store.active().version == "1.1.0" and store.previous().version == "1.0.0"


def test_unreadable_state_file_is_recovered(tmp_path, artifacts, trust):
    root = tmp_path / "store"
    _two_installed(root, artifacts, trust)
    (root / "state.json").unlink()
    (root / "state.json").mkdir()  # read() fails with EISDIR, as on a bad sector
    store = ModelStore(root, trust)
    assert "unreadable" in store.status()["state_note"]
    active = store.recover()  # the state cannot be rewritten while a directory sits there
    assert active is not None and active.version == "1.1.0"
    assert "serving scale 1.1.0 (state not rewritten" in store.state_note
    assert store.active().version == "1.1.0", "the choice is served from memory"
    assert len(list((root / "models").iterdir())) == 2


def test_damaged_newest_model_is_skipped_when_rebuilding_state(tmp_path, artifacts, trust):
    root = tmp_path / "store"
    store = _two_installed(root, artifacts, trust)
    newest = store.active()
    (newest.directory / newest.verified.manifest.model_path).write_bytes(b"bit rot")
    (root / "state.json").write_bytes(b"garbage")
    active = ModelStore(root, trust).recover()
    assert active is not None and active.version == "1.0.0"
    assert newest.directory.exists(), "a model that fails verification is kept for inspection, not deleted"


def test_parse_state_boundaries():
    assert parse_state(b'{"active": "a-1", "previous": null}') == ({"active": "a-1", "previous": None}, None)
    assert parse_state(b'{"active": null}')[1] is None
    for bad in (b"", b"[]", b"1", b'{"active": ".hidden"}', b'{"active": "a/b"}', b'{"active": ""}',
                b'{"previous": ".."}', b"{" + b" " * 70_000 + b"}"):
        state, problem = parse_state(bad)
        assert problem is not None and state == {"active": None, "previous": None}, bad


def test_state_naming_a_directory_outside_models_is_never_opened(tmp_path, artifacts, trust):
    root = tmp_path / "store"
    _two_installed(root, artifacts, trust)
    outside = tmp_path / "outside"
    shutil.copytree(next((root / "models").iterdir()), outside)
    (root / "state.json").write_text(json.dumps({"active": "../../outside", "previous": None}))
    store = ModelStore(root, trust)
    active = store.recover()
    assert active is not None and active.directory.parent == root / "models"
    assert outside.exists()


# --------------------------------------------------------------------------- read-only medium


_READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'


def _on_read_only_store(store: Path, *args: str) -> subprocess.CompletedProcess:
    """Run an agent command with ``store`` mounted read-only (EROFS, as an SD card that went
    read-only), in a private mount namespace of its own: nothing is left mounted afterwards."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(["unshare", "-rm", "sh", "-c", _READ_ONLY, "sh", str(store), cli(args[0]), *args[1:]],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)


def test_read_only_store_still_serves_and_refuses_updates(tmp_path, artifacts, keypair, trust):
    root = tmp_path / "store"
    _two_installed(root, artifacts, trust)
    state_before = (root / "state.json").read_bytes()
    public = str(keypair[1])

    status = _on_read_only_store(root, "edgepack-agent", "status", "--store", str(root), "--trust", public, "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["writable"] is False and "Read-only file system" in doc["read_only_reason"]
    assert doc["active"]["version"] == "1.1.0", "the active model still verifies and serves"

    refused = _on_read_only_store(root, "edgepack-agent", "install", "--store", str(root),
                                  "--artifact", str(artifacts["1.2.0"]), "--trust", public)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "cannot be written (Read-only file system); updates are refused" in refused.stderr
    assert (root / "state.json").read_bytes() == state_before
    assert ModelStore(root, trust).writable, "the store itself was never changed"


# --------------------------------------------------------------------------- journal: ids are never paths

from device_agent.updates.jobs import Job  # noqa: E402
from device_agent.updates.journal import (  # noqa: E402
    MAX_REJECTION_REASONS,
    Journal,
    JournalError,
    job_file_name,
)


def _files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


@pytest.mark.parametrize("hostile", ["../state", "../../x", "a/b", "..", ".", "\U0001f600" * 128, "x" * 65, "",
                                     "-leading-dash", "_" + "0" * 64])
def test_hostile_job_id_stays_inside_the_journal(tmp_path, hostile):
    store = tmp_path / "store"
    (store / "jobs").mkdir(parents=True)
    (store / "state.json").write_text('{"active": "m-1", "previous": null}')
    before = _files_under(tmp_path)
    journal = Journal(store / "jobs")
    journal.save(Job(id=hostile, type="ping", state="rejected", final=True))
    added = _files_under(tmp_path) - before
    assert len(added) == 1 and next(iter(added)).parent == store / "jobs", added
    assert next(iter(added)).name.startswith("_") and len(next(iter(added)).name) == 1 + 64 + 5
    assert (store / "state.json").read_text() == '{"active": "m-1", "previous": null}'
    assert journal.get(hostile).id == hostile
    assert [job.id for job in journal.all()] == [hostile]


def test_valid_job_id_names_its_file():
    assert job_file_name("deploy-42.a_b") == "deploy-42.a_b.json"
    assert job_file_name("../state") != "../state.json" and "/" not in job_file_name("../state")


def test_job_that_cannot_be_written_raises_a_journal_error_naming_the_cause(tmp_path):
    journal = Journal(tmp_path / "jobs")
    (tmp_path / "jobs").rmdir()
    (tmp_path / "jobs").write_text("a file where the folder was")
    with pytest.raises(JournalError, match="cannot write the job journal: Not a directory"):
        journal.save(Job(id="deploy-1", type="deploy"))


def test_rejected_commands_are_counted_not_written(tmp_path):
    journal = Journal(tmp_path / "jobs")
    for i in range(3000):
        journal.count_rejected(f"invalid command {i}: id must match the pattern")
    for i in range(100):
        journal.count_rejected(f"reason-{i}")
    assert list((tmp_path / "jobs").iterdir()) == []
    assert journal.rejected == 3100
    assert len(journal.rejected_by_reason) <= MAX_REJECTION_REASONS + 1
    assert sum(journal.rejected_by_reason.values()) == 3100


def test_unreadable_job_files_are_skipped(tmp_path):
    journal = Journal(tmp_path / "jobs")
    journal.save(Job(id="deploy-1", type="deploy"))
    (tmp_path / "jobs" / "deploy-2.json").write_text("[1, 2]")
    (tmp_path / "jobs" / "deploy-3.json").write_bytes(b"\xff\xfe")
    assert [job.id for job in journal.all()] == ["deploy-1"]
    assert journal.get("deploy-2") is None


# --------------------------------------------------------------------------- a running agent on a read-only store

from tests.agent_process import AgentProcess, Observer  # noqa: E402


def test_agent_on_read_only_store_serves_and_says_updates_are_refused(tmp_path, artifacts, keypair,
                                                                        mosquitto_broker):
    agent = AgentProcess(tmp_path, device="ro1", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=artifacts["1.0.0"])
    agent.start()  # a first, normal run: the store, its journal and its outbox exist as in the field
    agent.stop()
    store = tmp_path / "ro1-store"
    state_before = (store / "state.json").read_bytes()
    observer = Observer(mosquitto_broker.port)
    try:
        with open(agent.log, "ab") as log:
            agent.proc = subprocess.Popen(
                ["unshare", "-rm", "sh", "-c", _READ_ONLY, "sh", str(store), cli("edgepack-agent"), "run",
                 "--config", str(agent.config)], stdout=log, stderr=log, env={**os.environ})
        assert observer.wait_for(lambda: _healthy(agent), timeout=60), agent.log.read_text()[-2000:]
        health = agent.health()
        assert health["model"]["version"] == "1.0.0"
        assert health["store"]["writable"] is False
        assert health["updates"].startswith("refused: the store") and "Read-only file system" in health["updates"]
        status, answer = agent.predict([1.0, 2.0, 3.0, 4.0])
        assert (status, answer["outputs"]) == (200, {"y": [[2.0, 4.0, 6.0, 8.0]]}), "it still serves"
        assert observer.wait_for(lambda: any("Read-only file system" in s.get("updates", "")
                                             for s in observer.of("/dev/ro1/state")), timeout=30), \
            "the published state says why updates are refused"
        # A command that must be recorded (replay ledger, journal) cannot be: its final event names
        # the cause (the replay ledger refuses it first; the journal would fail it).
        from edgepack_core.protocol.commands import build_command, encode_command

        command = build_command("set-telemetry-interval", device="ro1", command_id="interval-ro", seconds=5)
        observer.publish("edgepack/v1/dev/ro1/cmd", encode_command(command))
        assert observer.wait_for(lambda: any(e.get("final") for e in observer.jobs("ro1", "interval-ro")),
                                 timeout=30), observer.jobs("ro1")
        final = next(e for e in observer.jobs("ro1", "interval-ro") if e.get("final"))
        assert final["state"] in ("failed", "rejected") and "Read-only file system" in final["reason"], final
    finally:
        agent.stop()
        observer.close()
    assert (store / "state.json").read_bytes() == state_before


def _healthy(agent: AgentProcess) -> bool:
    if agent.proc.poll() is not None:
        raise AssertionError(f"agent exited with {agent.proc.returncode}: {agent.log.read_text()[-2000:]}")
    try:
        return agent.health().get("status") == "ok"
    except OSError:
        return False


def test_rejected_command_ids_never_become_paths_on_a_running_agent(tmp_path, artifacts, keypair, mosquitto_broker):
    agent = AgentProcess(tmp_path, device="ids1", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=artifacts["1.0.0"])
    observer = Observer(mosquitto_broker.port)
    try:
        agent.start()
        store = tmp_path / "ids1-store"
        state_before = (store / "state.json").read_bytes()
        outside_before = sorted(p.name for p in tmp_path.iterdir())
        jobs_before = sorted(p.name for p in (store / "jobs").iterdir())
        hostile = ["../state", "../../x", "a/b", "\U0001f600" * 128, "..", "/etc/passwd"]
        for command_id in hostile:
            observer.publish("edgepack/v1/dev/ids1/cmd", json.dumps({"id": command_id, "type": "ping"}))
        for i in range(300):  # a flood of garbage: counted, never one file each
            observer.publish("edgepack/v1/dev/ids1/cmd", json.dumps({"id": f"../flood-{i}", "type": "ping"}))
        rejected = lambda: [e for e in observer.jobs("ids1") if e.get("state") == "rejected"]  # noqa: E731
        assert observer.wait_for(lambda: len(rejected()) >= len(hostile) + 300, timeout=60), len(rejected())
        assert all("/" not in event["job"] and ".." not in event["job"] for event in rejected())
        assert (store / "state.json").read_bytes() == state_before
        assert sorted(p.name for p in tmp_path.iterdir()) == outside_before, "a file appeared outside the store"
        assert sorted(p.name for p in (store / "jobs").iterdir()) == jobs_before, "rejected commands were written"
        assert agent.health()["model"]["version"] == "1.0.0"
    finally:
        agent.stop()
        observer.close()
    restarted = ModelStore(tmp_path / "ids1-store", TrustStore([load_public_key(keypair[1])]))
    assert restarted.recover().version == "1.0.0", "after a restart the model is still there"


def test_journal_counts_the_attempts_of_a_job(tmp_path):
    from device_agent.updates import jobs as J

    journal = Journal(tmp_path / "jobs")
    assert journal.attempts("deploy-1") == 0
    job = Job(id="deploy-1", type="deploy", history=((J.QUEUED, 1.0),))
    journal.save(job)
    assert journal.attempts("deploy-1") == 1
    for restart in range(2):
        job = J.advance(J.advance(job, J.DOWNLOADING, "fetching", 2.0), J.QUEUED, "resumed", 3.0)
        journal.save(job)
        assert journal.attempts("deploy-1") == 2 + restart
    verifying = J.advance(J.advance(job, J.DOWNLOADING, "fetching", 4.0), J.VERIFYING, "checking", 5.0,
                          verify_started=True)
    journal.save(verifying)
    assert J.on_restart(journal.get("deploy-1"), active_is_job_version=False, now=6.0) == J.FAIL


def test_parse_state_refusals_exactly():
    from device_agent.store import MAX_STATE_BYTES

    big = b'{"active": null, "previous": null}'
    exact = big + b" " * (MAX_STATE_BYTES - len(big))
    assert parse_state(exact) == ({"active": None, "previous": None}, None)
    assert parse_state(exact + b" ")[1] == f"state.json is larger than {MAX_STATE_BYTES} bytes"
    assert parse_state(b" \n")[1] == "state.json is empty"
    assert parse_state(b"x")[1] == "state.json is not JSON"
    assert parse_state(b"[]")[1] == "state.json holds a list, not an object"
    long_name = "a/" + "b" * 100
    assert parse_state(json.dumps({"previous": long_name}).encode())[1] == (
        f"state.json: previous {long_name[:80]!r} is not a model directory name")


def test_entry_names_boundaries():
    from device_agent.store import is_entry_name

    assert is_entry_name("a") and is_entry_name("a" * 255)
    for bad in ("", "a" * 256, "a\\b", "a\0b", "a/b", ".a", 7, None):
        assert not is_entry_name(bad), bad


def test_old_command_id_is_still_refused_after_500_newer_jobs(tmp_path):
    from device_agent.updates.journal import MAX_JOBS_KEPT
    from device_agent.updates.replay import ReplayError, ReplayGuard

    journal, ledger = Journal(tmp_path / "jobs"), ReplayGuard(tmp_path / "replay.json")
    now = 1_000_000.0
    signed = {"sender": "3f2a9c0d11e2b7a4", "kind": "deploy"}  # signed ids are kept across restarts
    ledger.remember("deploy-old", now + 3600, now, **signed)
    journal.save(Job(id="deploy-old", type="deploy", state="active", final=True))
    for index in range(MAX_JOBS_KEPT + 10):
        ledger.remember(f"deploy-{index}", now + 3600, now, **signed)
        journal.save(Job(id=f"deploy-{index}", type="deploy", state="active", final=True))
        os.utime(journal.folder / f"deploy-{index}.json", (now + index, now + index))
    os.utime(journal.folder / "deploy-old.json", (now - 1, now - 1))
    journal.prune()
    assert journal.get("deploy-old") is None, "the journal itself stays bounded"
    assert len(list(journal.folder.iterdir())) == MAX_JOBS_KEPT
    reopened = ReplayGuard(tmp_path / "replay.json")  # after a restart too
    with pytest.raises(ReplayError, match="already used"):
        reopened.remember("deploy-old", now + 3600, now + 10, **signed)
