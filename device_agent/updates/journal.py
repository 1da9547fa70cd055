"""Persisted jobs: one JSON file per command id, replaced atomically on every state change, so a
kill -9 at any step leaves the last state on disk and a duplicate command is recognised even
after a restart.

Nothing from the network becomes a path: a job file is named by the command id only when the
id matches the protocol's one id pattern (``edgepack_core.protocol.ids``), otherwise by a hash
of it, and every path is resolved and checked to stay inside the journal folder. Commands that
are rejected before they become jobs are counted here (:meth:`Journal.count_rejected`), never
written one file each: a flood of garbage must not fill the store.

Restart attempts are counted in the journal too, inside each job's history (``queued`` entries
a restart adds; see ``updates.jobs.on_restart``), so a job that crashed the agent is not run
into the same crash forever.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

from device_agent.errors import JournalError
from device_agent.updates.jobs import Job, resumes
from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.ids import is_valid_id

log = logging.getLogger("edgepack.agent.updates")

MAX_JOBS_KEPT = 500
MAX_JOB_FILE_BYTES = 1024 * 1024
MAX_REJECTION_REASONS = 32
_SUFFIX = ".json"


def job_file_name(job_id: str) -> str:
    """The file name for ``job_id``: the id itself when it is a valid protocol id, else
    ``_`` + its SHA-256 (a valid id never starts with ``_``, so the two cannot collide). Pure."""
    if is_valid_id(job_id):
        return job_id + _SUFFIX
    return "_" + hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest() + _SUFFIX


class Journal:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._root = self.folder.resolve()
        self._lock = threading.Lock()
        self.rejected = 0
        self.rejected_by_reason: dict[str, int] = {}

    def _path(self, job_id: str) -> Path:
        path = (self._root / job_file_name(job_id)).resolve()
        if path.parent != self._root:
            raise JournalError(f"job file for {job_id[:80]!r} would leave the journal folder")
        return path

    def _load(self, path: Path) -> Job | None:
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_JOB_FILE_BYTES + 1)
            if len(data) > MAX_JOB_FILE_BYTES:
                raise ValueError("job file too large")
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            return Job.from_json(doc)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.error("job file %s is unreadable (%s); treating the job as unknown", path.name, err)
            return None

    def get(self, job_id: str) -> Job | None:
        return self._load(self._path(job_id))

    def save(self, job: Job) -> None:
        """Persist ``job`` atomically; raise JournalError if the medium refuses."""
        try:
            atomic_write(self._path(job.id), json.dumps(job.to_json()).encode())
        except OSError as err:
            raise JournalError(f"cannot write the job journal: {err.strerror or err}") from err

    def attempts(self, job_id: str) -> int:
        """How many times the job was started: its first queueing plus every restart that sent
        it back to ``queued`` (0 for an unknown job). ``jobs.on_restart`` refuses to resume a
        job past ``jobs.MAX_RESUMES`` attempts, or one that was verifying when the agent died."""
        job = self.get(job_id)
        return 0 if job is None else 1 + resumes(job)

    def _job_files(self) -> list[Path]:
        paths = []
        for path in self.folder.glob("*" + _SUFFIX):
            try:
                paths.append((path.stat().st_mtime, path))
            except OSError:
                continue  # removed meanwhile
        return [path for _, path in sorted(paths)]

    def all(self) -> list[Job]:
        """Every readable job, oldest first."""
        return [job for job in map(self._load, self._job_files()) if job is not None]

    def prune(self) -> None:
        """Keep the newest MAX_JOBS_KEPT jobs (enough to answer late duplicates; replayed
        state-changing commands are refused by the replay ledger for as long as they are valid)."""
        try:
            for path in self._job_files()[:-MAX_JOBS_KEPT]:
                path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("cannot prune the job journal: %s", err.strerror or err)

    def count_rejected(self, reason: str) -> int:
        """Count a command rejected before it became a job (not written to disk). Reasons are
        kept by their first words, at most MAX_REJECTION_REASONS of them; returns the total."""
        key = " ".join(reason.split()[:4])[:60] or "unknown"
        with self._lock:
            self.rejected += 1
            if key in self.rejected_by_reason or len(self.rejected_by_reason) < MAX_REJECTION_REASONS:
                self.rejected_by_reason[key] = self.rejected_by_reason.get(key, 0) + 1
            else:
                self.rejected_by_reason["other"] = self.rejected_by_reason.get("other", 0) + 1
            return self.rejected
