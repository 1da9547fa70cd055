"""The model store: verified installs in versioned directories, an atomic switch of the
active model, the previous version kept for rollback, and recovery after a crash.

Layout under the store root::

    models/<name>-<version>-<sha12>/   one verified, extracted artifact per directory
    models/.<dir>.partial-*/           an extraction in progress (removed by recover())
    state.json                         {"active": dir, "previous": dir | null}: the commit point

Every change of the active model is one atomic rename of a new state.json (written to a temp
file in the same directory and fsynced first). A kill -9 at any point therefore leaves
either the old state or the new one; ``recover`` removes whatever a crash left half-done
(partial extractions, directories no state refers to) and re-verifies the active model's
signature and hashes, falling back to the previous model if the active one is damaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_agent.errors import StoreError
from edgepack_core.artifact import Limits, VerifiedArtifact, extract_artifact, read_extracted
from edgepack_core.errors import ArtifactError
from edgepack_core.signing import TrustStore
from edgepack_core.versions import check_upgrade

log = logging.getLogger("edgepack.agent.store")

STATE_FILE = "state.json"
TEST_CRASH_ENV = "EDGEPACK_TEST_CRASH_AT"


def simulate_power_cut_if_testing(name: str) -> None:
    """TEST ONLY: if EDGEPACK_TEST_CRASH_AT names this point, die at once with SIGKILL, as a
    power cut would. Lets the crash-safety tests kill a real process at exact points."""
    if os.environ.get(TEST_CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same dir, fsync, rename, fsync dir."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class InstalledModel:
    """A verified model directory in the store."""

    directory: Path
    verified: VerifiedArtifact

    @property
    def name(self) -> str:
        return self.verified.manifest.name

    @property
    def version(self) -> str:
        return self.verified.manifest.version

    @property
    def key(self) -> str:
        return self.directory.name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "directory": str(self.directory),
                "sha256": self.verified.manifest.model_sha256, "signed_by": self.verified.key_id}


class ModelStore:
    """Install, activate, roll back and recover models under one directory."""

    def __init__(self, root: Path, trust: TrustStore, limits: Limits | None = None) -> None:
        self.root = Path(root)
        self.models = self.root / "models"
        self.trust = trust
        self.limits = limits or Limits()
        self.models.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- state

    def _read_state(self) -> dict[str, str | None]:
        try:
            state = json.loads((self.root / STATE_FILE).read_text())
        except FileNotFoundError:
            return {"active": None, "previous": None}
        except (OSError, ValueError) as err:
            raise StoreError(f"{self.root / STATE_FILE} is unreadable: {err}") from None
        return {"active": state.get("active"), "previous": state.get("previous")}

    def _write_state(self, active: str | None, previous: str | None) -> None:
        atomic_write(self.root / STATE_FILE, json.dumps({"active": active, "previous": previous}).encode() + b"\n")

    def _open(self, key: str | None) -> InstalledModel | None:
        if not key:
            return None
        directory = self.models / key
        return InstalledModel(directory, read_extracted(directory, self.trust))

    def active(self) -> InstalledModel | None:
        """The active model, re-verified (signature and every file's hash)."""
        return self._open(self._read_state()["active"])

    def previous(self) -> InstalledModel | None:
        return self._open(self._read_state()["previous"])

    def active_version(self) -> str | None:
        key = self._read_state()["active"]
        if not key:
            return None
        try:
            return json.loads((self.models / key / "manifest.json").read_bytes())["version"]
        except (OSError, ValueError, KeyError):
            return None

    # ---------------------------------------------------------------- install steps

    def stage(self, artifact: Path, *, force: bool = False) -> InstalledModel:
        """Verify and extract ``artifact`` into its own directory; refuse a downgrade unless
        forced. Does not change what is active."""
        tmp = Path(tempfile.mkdtemp(prefix=".stage-", dir=self.models))
        try:
            verified = extract_artifact(artifact, tmp / "x", self.trust, self.limits)
            check_upgrade(verified.manifest.version, self.active_version(), force=force, artifact=str(artifact))
            key = f"{verified.manifest.name}-{verified.manifest.version}-{verified.manifest.model_sha256[:12]}"
            target = self.models / key
            state = self._read_state()
            if target.exists():
                if key == state["active"]:
                    raise StoreError(f"{key} is already the active model")
                if key == state["previous"]:
                    # The same signed build is kept for rollback: reuse it (re-verified) rather
                    # than hold two copies.
                    return InstalledModel(target, read_extracted(target, self.trust))
                shutil.rmtree(target)  # a leftover nobody refers to
            os.rename(tmp / "x", target)
            simulate_power_cut_if_testing("after-extract")
            return InstalledModel(target, VerifiedArtifact(verified.path, verified.manifest, verified.manifest_bytes,
                                                           verified.key_id, target))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def activate(self, model: InstalledModel) -> None:
        """Make ``model`` active (one atomic state write); the old active becomes previous."""
        state = self._read_state()
        simulate_power_cut_if_testing("before-switch")
        self._write_state(model.key, state["active"] if state["active"] != model.key else state["previous"])
        simulate_power_cut_if_testing("after-switch")
        self.prune()

    def install(self, artifact: Path, *, force: bool = False,
                smoke_test: Callable[[InstalledModel], Any] | None = None) -> InstalledModel:
        """stage -> smoke test -> activate. A model that fails its smoke test is removed and
        the active model stays as it was."""
        model = self.stage(artifact, force=force)
        if smoke_test is not None:
            try:
                smoke_test(model)
            except BaseException:
                self.discard(model)
                raise
        simulate_power_cut_if_testing("after-smoke")
        self.activate(model)
        return model

    def discard(self, model: InstalledModel) -> None:
        """Remove a staged model that never became active (one the state still refers to,
        such as a reused previous model, is kept)."""
        state = self._read_state()
        if model.key not in (state["active"], state["previous"]):
            shutil.rmtree(model.directory, ignore_errors=True)

    def rollback(self) -> InstalledModel:
        """Swap active and previous. Raises StoreError when there is no previous model."""
        state = self._read_state()
        if not state["previous"]:
            raise StoreError("no previous model to roll back to")
        previous = self._open(state["previous"])
        assert previous is not None
        self._write_state(state["previous"], state["active"])
        return previous

    def prune(self) -> list[str]:
        """Delete model directories other than active and previous."""
        state = self._read_state()
        keep = {state["active"], state["previous"]}
        removed = []
        for entry in self.models.iterdir():
            if entry.name not in keep and entry.is_dir() and not entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed

    # ---------------------------------------------------------------- crash recovery

    def recover(self) -> InstalledModel | None:
        """Clean up after a crash and return the active model, verified.

        Removes partial extractions and directories no state refers to; if the active model
        fails verification (a file damaged on disk), falls back to the previous one.
        """
        for entry in self.models.iterdir():
            if entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                log.info("removed an unfinished extraction: %s", entry.name)
        for stray in self.root.glob(f".{STATE_FILE}.*.tmp"):
            stray.unlink(missing_ok=True)
        state = self._read_state()
        try:
            active = self._open(state["active"])
        except (ArtifactError, OSError) as err:
            log.error("active model %s failed verification (%s); falling back", state["active"], err)
            active = None
            try:
                fallback = self._open(state["previous"])
            except (ArtifactError, OSError):
                fallback = None
            self._write_state(fallback.key if fallback else None, None)
            active = fallback
        self.prune()
        return active

    def status(self) -> dict[str, Any]:
        state = self._read_state()
        out: dict[str, Any] = {"store": str(self.root)}
        for role in ("active", "previous"):
            try:
                model = self._open(state[role])
                out[role] = model.to_json() if model else None
            except (ArtifactError, OSError) as err:
                out[role] = {"directory": state[role], "error": str(err)}
        return out
