"""``edgepack fleet token create|list|revoke`` and ``edgepack fleet audit export``: users of a
fleet server, from the CLI (over its REST API; the server needs no restart).

``token create`` prints the new token once, alone on stdout (``> ann.token`` makes a token
file); the server keeps only its sha256.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any, BinaryIO, cast

import click

from edgepack_core.protocol.ids import is_valid_id
from sdk.cli.fleet import fleet
from sdk.cli.rollout import _server_options, client_for, utc_time
from sdk.cli.terminal import JsonLines, echo
from sdk.fleet_server.roles import ROLES  # pure: needs no server extra


def parse_since(text: str) -> float:
    """``--since``: unix seconds, or an ISO 8601 date or time (``2026-01-31``, ``2026-01-31T08:00:00Z``;
    UTC when it names no zone)."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = datetime.datetime.fromisoformat(text.strip())
        except ValueError as err:
            raise click.BadParameter(f"{text[:64]!r} is neither unix seconds nor an ISO 8601 time "
                                     "(2026-01-31, 2026-01-31T08:00:00Z)") from err
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = when.timestamp()
    if not math.isfinite(seconds) or seconds < 0:
        raise click.BadParameter(f"{text[:64]!r} is not a time after 1970")
    return seconds


def _name(value: str) -> str:
    if not is_valid_id(value):
        raise click.BadParameter(f"{value[:64]!r}: a name is 1 to 64 letters, digits, '.', '_' or '-'",
                                 param_hint="NAME")
    return value


@fleet.group()
def token() -> None:
    """Named API tokens with a role (viewer, operator, release, admin), held by the server."""


@token.command(name="create")
@click.argument("name")
@click.option("--role", type=click.Choice(ROLES), required=True,
              help="viewer reads; operator runs rollouts, targets and device actions; release uploads artifacts and "
                   "marks bad releases; admin manages tokens, keys and enrollment.")
@_server_options
def create(name: str, role: str, server: str, token_file: Path | None) -> None:
    """Make token NAME; prints the token (only it, once) on stdout."""
    made = client_for(server, token_file).post("/api/tokens", {"name": _name(name), "role": role})
    echo(made["token"])


def _token_line(doc: dict[str, Any]) -> str:
    state = f"revoked {utc_time(doc['revoked_at'])} by {doc['revoked_by']}" if doc.get("revoked_at") else "in force"
    made = f"{utc_time(doc['created_at'])} by {doc['created_by']}" if doc.get("created_at") else "-"
    return (f"{doc['name']:<24} {doc['role']:<9} {doc['source']:<9} {made:<34} "
            f"{utc_time(doc.get('last_used_at')):<20} {state}")


@token.command(name="list")
@_server_options
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON document.")
def list_tokens(server: str, token_file: Path | None, as_json: bool) -> None:
    """Every token: name, role, where it is held, who made it, when last used, revoked or not."""
    doc = client_for(server, token_file).get("/api/tokens")
    if as_json:
        click.echo(json.dumps(doc))
        return
    echo(f"{'NAME':<24} {'ROLE':<9} {'SOURCE':<9} {'CREATED':<34} {'LAST USED':<20} STATE",
         *(_token_line(entry) for entry in doc["tokens"]))


@token.command(name="revoke")
@click.argument("name")
@_server_options
def revoke(name: str, server: str, token_file: Path | None) -> None:
    """Revoke token NAME: every server refuses it from its next request."""
    done = client_for(server, token_file).delete(f"/api/tokens/{_name(name)}")
    echo(f"{done['name']} ({done['role']}) revoked")


@fleet.group()
def audit() -> None:
    """The fleet server's audit log: every write, with who, what, when and how it ended."""


@audit.command(name="export")
@_server_options
@click.option("--since", help="Only entries from this time on: unix seconds or ISO 8601 (UTC unless it says).")
@click.option("--action", help="Only this action (rollout.create, token.revoke, ...).")
def export(server: str, token_file: Path | None, since: str | None, action: str | None) -> None:
    """Write the audit log as JSON lines to stdout, oldest first (> audit.jsonl); each line
    re-encoded as ASCII JSON on the way, so no byte the server sent acts on a terminal."""
    start = None if since is None else repr(parse_since(since))
    lines = JsonLines(sys.stdout.buffer)
    client_for(server, token_file).download("/api/audit", cast(BinaryIO, lines), format="jsonl", since=start,
                                            action=action)
    lines.close()
