"""The driver's targets round: each device that differs from its effective target, and may get a
command now, gets the signed deploy (or remove) the pure :func:`~.targets.reconcile` chose;
:mod:`.desired` reads the inputs from the database, so the round resumes from targets and
reported states alone. Each command is recorded (``target_commands``, ``commands``) before it is
published."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from edgepack_core import faults
from edgepack_core.protocol.commands import build_command
from sdk.fleet_server import db as tables
from sdk.fleet_server.desired import View, load_plan
from sdk.fleet_server.targets import ABSENT, Decision

log = logging.getLogger("edgepack.fleet_server.driver")


class _Available(dict[str, bool]):
    """sha256 -> whether this server's store can serve it, asked on first use."""

    def __init__(self, check: Callable[[str], bool]) -> None:
        super().__init__()
        self.check = check

    def get(self, key: str, default: Any = None) -> bool:
        if key not in self:
            self[key] = self.check(key)
        return self[key]


def reconcile(driver: Any, now: float) -> None:
    """Send each device that differs from its effective target, and may get a command now,
    the signed deploy the pure :func:`~.targets.reconcile` chose (:mod:`.desired` reads the
    inputs from the database, so this resumes from targets and reported states alone)."""
    with driver.database.read() as connection:
        if connection.execute(select(tables.target_entries.c.model).limit(1)).first() is None:
            return
        view = View(now, driver.config.silence_s, driver.config.command_ttl_s)
        plans = load_plan(connection, view, available=_Available(driver.artifact_available))
    sends = [plan for plan in plans if plan.decision.kind == "send"]
    driver.converged = sum(plan.decision.kind == "converged" for plan in plans)
    if not sends:
        return
    to_publish: list[dict[str, Any]] = []
    with driver.database.write() as connection:
        for plan in sends:
            recorded = _record(driver, connection, plan.device, plan.decision, now)
            if recorded is not None:
                to_publish.append(recorded)
    faults.point("fleet-recorded-targets")
    driver.publish(to_publish, now)
    if to_publish:
        log.info(
            "targets: %d deploy(s) sent (%s)", len(to_publish), ", ".join(f"{c['device']}" for c in to_publish[:10])
        )


def _record(driver: Any, connection: Connection, device: str, decision: Decision, now: float) -> dict[str, Any] | None:
    """Record one reconciler deploy (its target_commands row and its signed bytes); the
    command to publish if this call created it. A downgrade is signed: the operator chose it."""
    new = driver.database.insert_new(
        connection,
        tables.target_commands,
        {
            "id": decision.command_id,
            "device": device,
            "model": decision.model,
            "artifact": decision.artifact,
            "source": decision.source,
            "revision": decision.revision,
            "attempt": decision.attempt,
            "created_at": now,
        },
    )
    if not new:
        return None
    fields: dict[str, Any]
    if decision.artifact == ABSENT:  # the target says the model must not be there: the signed remove
        kind, fields = "remove", {"model": decision.model}
    else:
        artifact = connection.execute(
            select(tables.artifacts).where(tables.artifacts.c.sha256 == decision.artifact)
        ).one()
        kind, fields = (
            "deploy",
            {
                "name": artifact.name,
                "version": artifact.version,
                "size": artifact.size,
                "sha256": artifact.sha256,
                "artifact": {"url": driver.artifact_url(artifact.sha256)},
                "force_downgrade": True,
            },
        )
    command = build_command(
        kind, device=device, command_id=decision.command_id, ttl_s=driver.config.command_ttl_s, now=now, **fields
    )
    driver.target_sent += 1
    return driver.record_command(connection, device, kind, command, now)
