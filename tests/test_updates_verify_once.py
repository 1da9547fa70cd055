"""An update is verified once (device_agent/updates/service.py): one pass over the downloaded
artifact checks the signature, runs admission on the signed manifest before any member is read,
and hashes every member as it is extracted into the store. A real daemon on a real broker; the
artifact reader is only counted, never replaced."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import edgepack_core.artifact as artifact_module
from device_agent.config import check_config
from device_agent.daemon import Daemon
from device_agent.updates import jobs as J
from device_agent.updates.jobs import Job
from device_agent.updates.service import _Running
from tests.artifacts import build_artifact


@pytest.fixture()
def daemon(tmp_path, keypair, mosquitto_broker):
    v1 = build_artifact(tmp_path / "a", keypair[0], version="1.0.0")
    config = check_config({
        "device_id": "pi-07", "store": "store", "trust": [str(keypair[1])], "artifact": str(v1),
        "api": {"enabled": False}, "mqtt": {"host": "127.0.0.1", "port": mosquitto_broker.port},
        "updates": {"health_window_s": {"default": 0.2, "min": 0.1}, "health_min_requests": 0},
    }, tmp_path / "agent.yaml")
    running = Daemon(config).start()
    yield running
    running.stop()


@pytest.fixture()
def walks(monkeypatch):
    """Every pass over an artifact file (path), and every member hashed."""
    seen: dict[str, list[str]] = {"walks": [], "hashed": []}
    real_walk, real_copy = artifact_module._walk, artifact_module._copy_hashed

    def walk(path, *args, **kwargs):
        seen["walks"].append(str(path))
        return real_walk(path, *args, **kwargs)

    def copy(pieces, sink):
        seen["hashed"].append(getattr(sink, "name", ""))
        return real_copy(pieces, sink)

    monkeypatch.setattr(artifact_module, "_walk", walk)
    monkeypatch.setattr(artifact_module, "_copy_hashed", copy)
    return seen


def _downloaded(tmp_path: Path, daemon: Daemon, artifact: Path) -> Path:
    """The artifact where a finished download leaves it."""
    assert daemon.updates is not None
    target = daemon.updates.downloads / "job.edgepkg"
    shutil.copy(artifact, target)
    return target


def _deploy_job(version: str) -> Job:
    job = Job(id=f"deploy-{version}", type="deploy", command={"type": "deploy", "version": version},
              history=((J.QUEUED, time.time()),))
    return J.advance(job, J.DOWNLOADING, "fetching", time.time())


def test_an_update_reads_and_hashes_the_artifact_once(tmp_path, keypair, daemon, walks):
    v2 = build_artifact(tmp_path / "a", keypair[0], version="1.1.0", factor=3.0)
    members = len(artifact_module.verify_artifact(v2, daemon.trust).manifest.files)
    walks["walks"].clear()
    walks["hashed"].clear()
    artifact = _downloaded(tmp_path, daemon, v2)
    job = _deploy_job("1.1.0")
    assert daemon.updates is not None
    daemon.updates._install_downloaded(job, artifact, _Running(job.id))
    final = daemon.updates.journal.get(job.id)
    assert final is not None and final.state == J.ACTIVE and final.final, final
    states = [s for s, _ in final.history]
    assert [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s] == [
        J.QUEUED, J.DOWNLOADING, J.VERIFYING, J.STAGING, J.TESTING, J.ACTIVE]
    assert daemon.service.model is not None and daemon.service.model.manifest.version == "1.1.0"
    assert walks["walks"] == [str(artifact)], "the artifact was walked more than once"
    assert len(walks["hashed"]) == members and all(walks["hashed"]), "each member hashed once, as it was written"


def test_a_refused_update_is_judged_before_any_member_is_read(tmp_path, keypair, daemon, walks):
    v2 = build_artifact(tmp_path / "a", keypair[0], version="1.1.0", factor=3.0)
    artifact = _downloaded(tmp_path, daemon, v2)
    models = sorted(p.name for p in (daemon.config.store / "models").iterdir())
    job = _deploy_job("1.2.0")  # the command announced another version: admission refuses
    assert daemon.updates is not None
    daemon.updates._install_downloaded(job, artifact, _Running(job.id))
    final = daemon.updates.journal.get(job.id)
    assert final is not None and final.state == J.REJECTED
    assert final.reason == "artifact is scale 1.1.0, the command announced scale 1.2.0"
    assert walks["walks"] == [str(artifact)] and walks["hashed"] == [], "a member was read before admission"
    assert sorted(p.name for p in (daemon.config.store / "models").iterdir()) == models, "something was left staged"
    assert daemon.service.model is not None and daemon.service.model.manifest.version == "1.0.0"


def test_a_member_that_does_not_match_its_hash_is_rejected_and_nothing_stays_staged(tmp_path, keypair, daemon):
    import io
    import tarfile

    v2 = build_artifact(tmp_path / "a", keypair[0], version="1.1.0", factor=3.0)
    tampered = tmp_path / "tampered.edgepkg"
    with tarfile.open(v2) as source, tarfile.open(tampered, "w:gz", format=tarfile.PAX_FORMAT) as out:
        for member in source.getmembers():
            data = source.extractfile(member).read()
            if member.name.endswith(".onnx"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            out.addfile(member, io.BytesIO(data))
    artifact = _downloaded(tmp_path, daemon, tampered)
    models = sorted(p.name for p in (daemon.config.store / "models").iterdir())
    job = _deploy_job("1.1.0")
    assert daemon.updates is not None
    daemon.updates._install_downloaded(job, artifact, _Running(job.id))
    final = daemon.updates.journal.get(job.id)
    assert final is not None and final.state == J.REJECTED, final
    assert "sha256 differs from the signed manifest" in final.reason, final.reason
    assert sorted(p.name for p in (daemon.config.store / "models").iterdir()) == models
    assert daemon.service.model is not None and daemon.service.model.manifest.version == "1.0.0"
