"""What a rollout's waves wait for: offline devices counted apart, and the running wave's deadline.

A wave with an offline device does not fail at once: the device may come back and answer. It
waits until the wave's timeout, and the operator sees how long: ``deadline`` is
``wave_started_at + wave_timeout_s`` (time paused is already added to ``wave_started_at`` on
resume), and ``offline`` counts the wave's devices without a final answer that are offline
now. :func:`wave_waits` is the pure part; :func:`annotate` reads device liveness and adds both
to a ``GET /api/rollouts/{id}`` document.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import select

from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.queries import is_online

CHUNK = 500


def wave_waits(
    wave_count: int,
    devices: Iterable[tuple[str, int, bool]],
    offline: set[str],
    *,
    state: str,
    current_wave: int,
    wave_started_at: float | None,
    wave_timeout_s: float,
) -> list[dict[str, Any]]:
    """Per wave (0-based index order): ``offline`` (devices without a final answer that are
    offline now) and ``deadline`` (when the running wave times out; None for any other). Pure."""
    counts = [0] * wave_count
    for device, wave, final in devices:
        if not final and device in offline and 0 <= wave < wave_count:
            counts[wave] += 1
    running = state == "running" and wave_started_at is not None
    return [
        {
            "offline": counts[index],
            "deadline": wave_started_at + wave_timeout_s
            if running and index == current_wave and wave_started_at is not None
            else None,
        }
        for index in range(wave_count)
    ]


def _offline(database: Database, devices: Sequence[str], now: float, silence_s: float) -> set[str]:
    d = tables.devices
    online: set[str] = set()
    with database.read() as connection:
        for start in range(0, len(devices), CHUNK):
            part = list(devices[start : start + CHUNK])
            online.update(
                row.id
                for row in connection.execute(select(d.c.id, d.c.status, d.c.last_seen).where(d.c.id.in_(part)))
                if is_online(row.status, row.last_seen, now, silence_s)
            )
    return set(devices) - online


def annotate(database: Database, doc: Mapping[str, Any], *, now: float, silence_s: float) -> dict[str, Any]:
    """``doc`` (a rollout document) with each wave's ``offline`` and ``deadline``, and the
    rollout's ``offline`` total and ``wave_deadline``."""
    members = [(d["device"], int(d["wave"]), bool(d["final"])) for d in doc.get("devices", [])]
    waiting = [device for device, _wave, final in members if not final]
    offline = _offline(database, waiting, now, silence_s) if waiting else set()
    waits = wave_waits(
        int(doc["wave_count"]),
        members,
        offline,
        state=str(doc["state"]),
        current_wave=int(doc["wave"]),
        wave_started_at=doc.get("wave_started_at"),
        wave_timeout_s=float(doc["gates"]["wave_timeout_s"]),
    )
    waves = [{**wave, **waits[index]} if index < len(waits) else dict(wave) for index, wave in enumerate(doc["waves"])]
    current = waits[int(doc["wave"])] if int(doc["wave"]) < len(waits) else {"deadline": None}
    return {**doc, "waves": waves, "offline": sum(w["offline"] for w in waits), "wave_deadline": current["deadline"]}
