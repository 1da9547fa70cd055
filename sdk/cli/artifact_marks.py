"""``edgepack artifact bad|good``: mark a release bad fleet-wide on a fleet server, or clear the mark.

Thin commands over ``POST``/``DELETE /api/artifacts/{sha256}/bad``. The answer names what still
points at the release (targets of the fleet, groups and devices; rollouts in progress, which
the server pauses), so the operator knows what to set back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from sdk.cli import main
from sdk.cli.rollout import _server_options, client_for
from sdk.cli.terminal import echo


def _named_lines(doc: dict[str, Any]) -> list[str]:
    """What names the artifact: one line per target and per rollout in progress."""
    lines = [f"  target {t['scope']}{' ' + t['name'] if t['name'] else ''}: {t['model']}" for t in doc["targets"]]
    lines += [f"  rollout {r['id']} ({r['state']})" for r in doc["rollouts"]]
    return lines or ["  no target or rollout in progress names it"]


def _show(doc: dict[str, Any], as_json: bool, what: str) -> None:
    """The server's answer: JSON, or the artifact, ``what`` happened, and what names it."""
    if as_json:
        click.echo(json.dumps(doc))
        return
    art = doc["artifact"]
    echo(f"{art['name']} {art['version']} ({art['sha256'][:12]}) {what}", *_named_lines(doc))


@main.group()
def artifact() -> None:
    """Artifacts on a fleet server: mark a release bad fleet-wide, or clear the mark."""


@artifact.command()
@click.argument("sha256")
@_server_options
@click.option("--reason", required=True, help="Why the release is bad (at most 500 characters; kept in the audit).")
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
def bad(sha256: str, server: str, token_file: Path | None, reason: str, as_json: bool) -> None:
    """Mark SHA256 bad: never sent again, new rollouts and targets naming it refused, running rollouts paused."""
    doc = client_for(server, token_file).post(f"/api/artifacts/{sha256}/bad", {"reason": reason})
    _show(doc, as_json, f"marked bad: {doc['artifact']['bad']['reason']}")


@artifact.command()
@click.argument("sha256")
@_server_options
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
def good(sha256: str, server: str, token_file: Path | None, as_json: bool) -> None:
    """Clear SHA256's bad mark: targets naming it are sent again; paused rollouts may be resumed."""
    doc = client_for(server, token_file).delete(f"/api/artifacts/{sha256}/bad")
    _show(doc, as_json, "is no longer marked bad")
