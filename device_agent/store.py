"""The model store: verified installs in versioned directories, an atomic switch of the
active model, the previous version kept for rollback, and recovery after a crash.

Layout under the store root::

    models/<name>-<version>-<sha12>/   one verified, extracted artifact per directory
    cache/<name>-<version>-<sha12>/    its TensorRT engines / CoreML model, removed with it
    models/.<dir>.partial-*/           an extraction in progress (removed by recover())
    state.json                         {"active": dir, "previous": dir | null}: the commit point
    rejected.json                      versions this device refused to keep (updates/rejected.py)

Every change of the active model is one atomic rename of a new state.json (written to a temp
file in the same directory and fsynced first). A kill -9 at any point therefore leaves
either the old state or the new one; ``recover`` removes whatever a crash left half-done
(partial extractions, directories no state refers to) and re-verifies the active model's
signature and hashes, falling back to the previous model if the active one is damaged.

``previous`` is the version to roll back to, so it only ever holds a version that passed its
health window (or the first install): a rollback away from a model that failed its window, or
was undone before the window closed, forgets it (``rollback(forget_active=True)``), and
``rollback_target`` refuses a previous version the ledger of rejected versions names.

The store survives its medium (SD cards corrupt files and go read-only):

- a ``state.json`` that is unreadable, empty, garbage, not an object, or names a directory that
  is not a plain entry of ``models/`` is *damaged*: nothing is ever deleted on its account.
  ``recover`` picks the newest model that verifies, rewrites the state and records what it did
  in ``state_note`` (the agent reports it);
- a store that cannot be written still serves: ``writable`` is False, ``read_only_reason``
  says why, every change (install, activate, rollback, prune) is refused with that reason and
  ``recover`` only verifies;
- every path is built from a validated entry name and checked to stay inside the store.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_agent.errors import StoreError
from device_agent.updates.rejected import FILE_NAME as REJECTED_FILE
from device_agent.updates.rejected import RejectedLedger, for_state
from edgepack_core import faults
from edgepack_core.artifact import Admit, Limits, VerifiedArtifact, extract_artifact, read_extracted
from edgepack_core.errors import ArtifactError
from edgepack_core.fsutil import atomic_write
from edgepack_core.signing import TrustStore
from edgepack_core.versions import Version, check_upgrade

log = logging.getLogger("edgepack.agent.store")

STATE_FILE = "state.json"
MAX_STATE_BYTES = 64 * 1024
NO_GOOD_VERSION = "no earlier version that passed its health window is kept on this device"


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


def parse_state(data: bytes) -> tuple[dict[str, str | None], str | None]:
    """Decode state.json bytes into ``({"active", "previous"}, problem)``. Pure.

    ``problem`` is None for a sound state; otherwise the state is empty and ``problem`` says
    what was wrong. A value must be null or a plain directory name (no separator, not hidden),
    so a damaged or forged state can never point outside ``models/``.
    """
    empty: dict[str, str | None] = {"active": None, "previous": None}
    if len(data) > MAX_STATE_BYTES:
        return empty, f"{STATE_FILE} is larger than {MAX_STATE_BYTES} bytes"
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return empty, f"{STATE_FILE} is not JSON" if data.strip() else f"{STATE_FILE} is empty"
    if not isinstance(doc, dict):
        return empty, f"{STATE_FILE} holds a {type(doc).__name__}, not an object"
    state = dict(empty)
    for role in state:
        value = doc.get(role)
        if value is not None and not is_entry_name(value):
            return empty, f"{STATE_FILE}: {role} {str(value)[:80]!r} is not a model directory name"
        state[role] = value
    return state, None


def is_entry_name(value: object) -> bool:
    """A plain, visible directory entry name (what the store writes into state.json). Pure."""
    return (isinstance(value, str) and 0 < len(value) <= 255 and "/" not in value and "\\" not in value
            and "\0" not in value and not value.startswith("."))


def newest_first(models: list[InstalledModel]) -> list[InstalledModel]:
    """Models ordered by version, newest first (ties: the most recently written directory). Pure
    over the models' versions and directory times."""
    def key(model: InstalledModel) -> tuple[Version, float]:
        try:
            mtime = model.directory.stat().st_mtime
        except OSError:
            mtime = 0.0
        return Version(model.version), mtime
    return sorted(models, key=key, reverse=True)


class ModelStore:
    """Install, activate, roll back and recover models under one directory."""

    def __init__(self, root: Path, trust: TrustStore, limits: Limits | None = None) -> None:
        self.root = Path(root)
        self.models = self.root / "models"
        self.caches = self.root / "cache"  # cache/<model directory>/: provider engines, removed with the model
        self.trust = trust
        self.limits = limits or Limits()
        self.state_note: str | None = None
        self._override: dict[str, str | None] | None = None
        self.read_only_reason: str | None = None
        try:
            self.models.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if not self.models.is_dir():
                raise StoreError(f"{self.models} cannot be created: {err.strerror or err}") from err
        self.check_writable()
        self.rejected = RejectedLedger(self.root / REJECTED_FILE)

    # ---------------------------------------------------------------- medium

    @property
    def writable(self) -> bool:
        return self.read_only_reason is None

    def check_writable(self) -> bool:
        """Probe the medium with a real write (a temp file, fsynced and removed): permission
        bits say nothing for root, and a card that went read-only only shows on write."""
        try:
            fd, name = tempfile.mkstemp(prefix=".probe-", dir=self.root)
            try:
                os.write(fd, b"probe")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(name)
        except OSError as err:
            self.read_only_reason = (f"the store {self.root} cannot be written ({err.strerror or err}); "
                                     "updates are refused")
        else:
            self.read_only_reason = None
        return self.writable

    def _require_writable(self) -> None:
        if self.read_only_reason is not None:
            raise StoreError(self.read_only_reason)

    def _inside(self, key: str) -> Path:
        """``models/<key>``, refusing any key that is not a plain entry of ``models/``."""
        if not is_entry_name(key):
            raise StoreError(f"{key[:80]!r} is not a model directory name")
        path = self.models / key
        if path.resolve().parent != self.models.resolve():
            raise StoreError(f"{key[:80]!r} leaves the store")
        return path

    # ---------------------------------------------------------------- state

    def _load_state(self) -> tuple[dict[str, str | None], str | None]:
        if self._override is not None:
            return dict(self._override), None
        try:
            with open(self.root / STATE_FILE, "rb") as handle:
                data = handle.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return {"active": None, "previous": None}, None
        except OSError as err:
            return {"active": None, "previous": None}, f"{STATE_FILE} is unreadable ({err.strerror or err})"
        return parse_state(data)

    def _read_state(self) -> dict[str, str | None]:
        """The committed state; a damaged one raises StoreError (so nothing acts on a guess;
        ``recover`` is the one place that repairs it)."""
        state, problem = self._load_state()
        if problem is not None:
            raise StoreError(f"{self.root / STATE_FILE}: {problem}; run recovery")
        return state

    def _write_state(self, active: str | None, previous: str | None) -> None:
        self._require_writable()
        atomic_write(self.root / STATE_FILE, json.dumps({"active": active, "previous": previous}).encode() + b"\n")
        self._override = None

    def _open(self, key: str | None) -> InstalledModel | None:
        if not key:
            return None
        directory = self._inside(key)
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
            return json.loads((self._inside(key) / "manifest.json").read_bytes())["version"]
        except (OSError, ValueError, KeyError, TypeError, StoreError):
            return None

    # ---------------------------------------------------------------- install steps

    def stage(self, artifact: Path, *, force: bool = False, admit: Admit | None = None) -> InstalledModel:
        """Verify and extract ``artifact`` into its own directory; refuse a downgrade unless
        forced. ``admit`` judges the signed manifest before any member is extracted (it raises
        to refuse). Does not change what is active."""
        self._require_writable()
        tmp = Path(tempfile.mkdtemp(prefix=".stage-", dir=self.models))
        try:
            verified = extract_artifact(artifact, tmp / "x", self.trust, self.limits, admit=admit)
            check_upgrade(verified.manifest.version, self.active_version(), force=force, artifact=str(artifact))
            key = f"{verified.manifest.name}-{verified.manifest.version}-{verified.manifest.model_sha256[:12]}"
            target = self._inside(key)
            state = self._read_state()
            if target.exists():
                if key == state["active"]:
                    raise StoreError(f"{key} is already the active model")
                if key == state["previous"]:
                    # The same signed build is kept for rollback: reuse it (re-verified) rather
                    # than hold two copies.
                    return InstalledModel(target, read_extracted(target, self.trust))
                shutil.rmtree(target)  # a leftover nobody refers to
                self._remove_cache(key)
            os.rename(tmp / "x", target)
            faults.point("after-extract")
            return InstalledModel(target, VerifiedArtifact(verified.path, verified.manifest, verified.manifest_bytes,
                                                           verified.key_id, target))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def activate(self, model: InstalledModel) -> None:
        """Make ``model`` active (one atomic state write); the old active becomes previous."""
        self._require_writable()
        state = self._read_state()
        faults.point("before-switch")
        self._write_state(model.key, state["active"] if state["active"] != model.key else state["previous"])
        faults.point("after-switch")
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
        faults.point("after-smoke")
        self.activate(model)
        return model

    def discard(self, model: InstalledModel) -> None:
        """Remove a staged model that never became active (one the state still refers to,
        such as a reused previous model, is kept)."""
        state = self._read_state()
        if model.key not in (state["active"], state["previous"]):
            shutil.rmtree(model.directory, ignore_errors=True)
            self._remove_cache(model.key)

    def rollback_target(self) -> InstalledModel:
        """The version a rollback goes to: the previous one, re-verified. Raises StoreError when
        there is none, or when it is a version this device rejected (a store written by an older
        agent kept the version a health window rolled back as previous)."""
        previous = self.previous()
        if previous is None:
            raise StoreError(NO_GOOD_VERSION)
        rejected = self.rejected.find(previous.name, previous.version)
        if rejected is not None:
            raise StoreError(f"the previous version {rejected.label} was rejected ({rejected.stage}: "
                             f"{rejected.reason}); {NO_GOOD_VERSION}")
        return previous

    def rollback(self, *, forget_active: bool = False) -> InstalledModel:
        """Make the rollback target active. The old active becomes previous (a rollback can be
        undone), unless ``forget_active``: it failed or never finished its health window, so it
        must never be rolled back to, and its directory is removed. Raises StoreError when there
        is no target (:meth:`rollback_target`)."""
        self._require_writable()
        state = self._read_state()
        target = self.rollback_target()
        self._write_state(target.key, None if forget_active else state["active"])
        if forget_active:
            self.prune()
        return target

    def clear(self) -> None:
        """No active model any more (a ``remove`` command): one atomic state write, then every
        model directory is pruned. The ledger of rejected versions is kept."""
        self._require_writable()
        self._write_state(None, None)
        self.prune()

    def prune(self) -> list[str]:
        """Delete model directories other than active and previous (never on a damaged state)."""
        if not self.writable:
            return []
        state = self._read_state()
        keep = {state["active"], state["previous"]}
        removed = []
        for entry in self.models.iterdir():
            if entry.name not in keep and entry.is_dir() and not entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        if self.caches.is_dir():  # engines of models that are gone, including ones a crash left
            for entry in self.caches.iterdir():
                if entry.name not in keep:
                    self._remove_cache(entry.name)
        return removed

    def _remove_cache(self, key: str) -> None:
        """Remove ``cache/<key>``: the compiled engines of one model directory (TensorRT,
        CoreML), which only that model can use (``device_agent.runtime.engine_cache_dir``)."""
        if is_entry_name(key):
            shutil.rmtree(self.caches / key, ignore_errors=True)

    # ---------------------------------------------------------------- crash recovery

    def recover(self) -> InstalledModel | None:
        """Clean up after a crash and return the active model, verified.

        Removes partial extractions and directories no state refers to; if the active model
        fails verification (a file damaged on disk), falls back to the previous one. A damaged
        state.json is rebuilt from the newest models that verify, deleting nothing. On a
        read-only store nothing is cleaned or written: the state is only verified.
        """
        self.check_writable()
        if self.writable:
            self._remove_leftovers()
        state, problem = self._load_state()
        if problem is not None:
            return self._rebuild_state(problem)
        try:
            active = self._open(state["active"])
        except (ArtifactError, OSError, StoreError) as err:
            log.error("active model %s failed verification (%s); falling back", state["active"], err)
            try:
                active = self._open(state["previous"])
            except (ArtifactError, OSError, StoreError):
                active = None
            self._commit_recovered(active, None, f"active model {state['active']} failed verification ({err})")
        self.prune()
        return active

    def _remove_leftovers(self) -> None:
        for entry in self.models.iterdir():
            if entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                log.info("removed an unfinished extraction: %s", entry.name)
        for leftover in (STATE_FILE, REJECTED_FILE):
            for stray in self.root.glob(f".{leftover}.*.tmp"):
                stray.unlink(missing_ok=True)

    def verified_models(self) -> list[InstalledModel]:
        """Every model directory that verifies (signature and hashes), newest first."""
        found = []
        for entry in self.models.iterdir():
            if not is_entry_name(entry.name) or not entry.is_dir():
                continue
            try:
                found.append(InstalledModel(entry, read_extracted(entry, self.trust)))
            except (ArtifactError, OSError) as err:
                log.warning("model directory %s does not verify: %s", entry.name, err)
        return newest_first(found)

    def _rebuild_state(self, problem: str) -> InstalledModel | None:
        """state.json is damaged: choose the newest verified model this device did not reject (any,
        if it rejected them all), keep the next one of the same name as previous, delete nothing,
        and write the state again."""
        verified = self.verified_models()
        models = [m for m in verified if self.rejected.find(m.name, m.version) is None] or verified
        active = models[0] if models else None
        previous = next((m for m in models[1:] if active and m.name == active.name), None)
        self._commit_recovered(active, previous, problem)
        return active

    def _commit_recovered(self, active: InstalledModel | None, previous: InstalledModel | None, why: str) -> None:
        chosen = f"{active.name} {active.version}" if active else "no model"
        try:
            self._write_state(active.key if active else None, previous.key if previous else None)
            self.state_note = f"{why}; recovered: {chosen} is active"
        except (OSError, StoreError) as err:
            # Serve the choice from memory; the medium refuses writes (read_only_reason says why).
            self._override = {"active": active.key if active else None, "previous": previous.key if previous else None}
            self.state_note = f"{why}; serving {chosen} (state not rewritten: {getattr(err, 'strerror', None) or err})"
        log.error("store: %s", self.state_note)

    def health(self) -> dict[str, Any]:
        """What /healthz and the published state add about the store: nothing while it is sound;
        ``{"store": {...}, "updates": "refused: ..."}`` while it is read-only or was recovered."""
        if self.writable and not self.state_note:
            return {}
        store: dict[str, Any] = {"writable": self.writable}
        if self.state_note:
            store["state_note"] = self.state_note
        out: dict[str, Any] = {"store": store}
        if self.read_only_reason:
            store["read_only_reason"] = self.read_only_reason
            out["updates"] = f"refused: {self.read_only_reason}"
        return out

    def status(self) -> dict[str, Any]:
        state, problem = self._load_state()
        out: dict[str, Any] = {"store": str(self.root), "writable": self.writable}
        if self.read_only_reason:
            out["read_only_reason"] = self.read_only_reason
        if problem or self.state_note:
            out["state_note"] = problem or self.state_note
        for role in ("active", "previous"):
            try:
                model = self._open(state[role])
                out[role] = model.to_json() if model else None
            except (ArtifactError, OSError, StoreError) as err:
                out[role] = {"directory": state[role], "error": str(err)}
        out["rejected"] = for_state(self.rejected.records())
        return out
