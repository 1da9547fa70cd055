"""Persisted jobs: one JSON file per command id, replaced atomically on every state change, so a
kill -9 at any step leaves the last state on disk and a duplicate command is recognised even
after a restart."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from device_agent.store import atomic_write
from device_agent.updates.jobs import Job

log = logging.getLogger("edgepack.agent.updates")

MAX_JOBS_KEPT = 500


class Journal:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.json"

    def get(self, job_id: str) -> Job | None:
        try:
            return Job.from_json(json.loads(self._path(job_id).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as err:
            log.error("job file %s is unreadable (%s); treating the job as unknown", job_id, err)
            return None

    def save(self, job: Job) -> None:
        atomic_write(self._path(job.id), json.dumps(job.to_json()).encode())

    def all(self) -> list[Job]:
        jobs = []
        for path in sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
            job = self.get(path.stem)
            if job is not None:
                jobs.append(job)
        return jobs

    def prune(self) -> None:
        """Keep the newest MAX_JOBS_KEPT finished jobs (enough to answer late duplicates)."""
        paths = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in paths[:-MAX_JOBS_KEPT]:
            path.unlink(missing_ok=True)
