"""``edgepack device show DEVICE_ID [--json]``: one device as the fleet server sees it, in one
view for an operator on call: identity and credentials, what it runs against its target, its
latest health and pipelines, active rollouts, the last jobs, and a release marked bad.

Thin: the server's answers are read here (existing read endpoints only, through the one
:func:`~sdk.cli.rollout.client_for`, so ``--server``/``--token-file``/``--ca`` and their
variables, and unreachable/TLS/401 errors, are those of every server command), then parsed once
by :mod:`sdk.device_view` and rendered by :mod:`sdk.device_view_text`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from edgepack_core.protocol.ids import is_valid_id
from sdk.cli.deploy import device
from sdk.cli.rollout import _server_options, client_for
from sdk.device_view import MAX_HISTORY, Answers, parse
from sdk.device_view_text import render
from sdk.errors import ApiError, CommandFailed
from sdk.fleet_server.client import FleetClient

ACTIVE = ("running", "paused", "pending")
MAX_ROLLOUT_READS = 20
"""Active rollouts read whole to find the device in them (a fleet has a few at a time)."""


def _or_none(read: Callable[[], Any]) -> Any:
    """``read()``, or None when the server answers 404 (nothing to show, or an older server)."""
    try:
        return read()
    except ApiError as err:
        if err.status == 404:
            return None
        raise


def active_rollouts(client: FleetClient, device_id: str, groups: list[str]) -> list[dict[str, Any]]:
    """The active rollouts that list the device: those to one of its groups or to a device list,
    read whole (at most :data:`MAX_ROLLOUT_READS`)."""
    found: list[dict[str, Any]] = []
    reads = 0
    for state in ACTIVE:
        for summary in client.get("/api/rollouts", state=state, limit=100).get("rollouts", []):
            group = (summary.get("target") or {}).get("group")
            if (group is not None and group not in groups) or reads >= MAX_ROLLOUT_READS:
                continue
            reads += 1
            path = f"/api/rollouts/{summary['id']}"
            doc = _or_none(lambda: client.get(path))  # noqa: B023  called at once, in this iteration
            if doc is not None and any(d.get("device") == device_id for d in doc.get("devices", [])):
                found.append(doc)
    return found


def gather(client: FleetClient, device_id: str) -> Answers:
    """Every answer the view needs; :class:`CommandFailed` ``no device X`` for a device the
    server neither knows nor has decommissioned."""
    doc = _or_none(lambda: client.get(f"/api/devices/{device_id}"))
    credentials = _or_none(lambda: client.get(f"/api/devices/{device_id}/credentials"))
    if doc is None:
        gone = next(
            (d for d in client.get("/api/decommissioned").get("devices", []) if d.get("device") == device_id), None
        )
        if gone is None:
            raise CommandFailed(f"no device {device_id}")
        return Answers(device_id, decommissioned=gone, credentials=credentials)
    groups = [g for g in doc.get("groups") or [] if isinstance(g, str)]
    return Answers(
        device_id,
        device=doc,
        credentials=credentials,
        target=_or_none(lambda: client.get(f"/api/devices/{device_id}/target")),
        history=_or_none(lambda: client.get(f"/api/devices/{device_id}/history", limit=MAX_HISTORY)),
        rollouts=active_rollouts(client, device_id, groups),
        artifacts=[a for a in client.get("/api/artifacts").get("artifacts", []) if a.get("bad")],
    )


@device.command(name="show")
@click.argument("device_id")
@_server_options
@click.option("--json", "as_json", is_flag=True, help="Print the whole view as one JSON document.")
def show(device_id: str, server: str, token_file: Path | None, as_json: bool) -> None:
    """One device through the fleet server: identity, models against its target, health,
    pipelines, active rollouts, the last 5 jobs, and a release marked bad it runs."""
    if not is_valid_id(device_id):
        raise click.BadParameter(f"{device_id[:64]!r} is not a device id", param_hint="DEVICE_ID")
    view = parse(gather(client_for(server, token_file), device_id))
    click.echo(json.dumps(view.to_json()) if as_json else render(view, time.time()))
