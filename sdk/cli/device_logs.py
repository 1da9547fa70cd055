"""``edgepack device logs D [--since T] [--lines N] [--level L] [--follow]``: a device's log
records through the fleet server (``POST /api/devices/{id}/logs/fetch``, then
``GET /api/devices/{id}/logs``), printed one line each; ``--follow`` asks for the newer ones
every few seconds until Ctrl-C (exit 0).
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path
from typing import Any

import click

from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.protocol.logs import LEVELS
from sdk.cli.deploy import device
from sdk.cli.rollout import _server_options, client_for
from sdk.cli.terminal import echo
from sdk.errors import CommandFailed
from sdk.fleet_server.client import FleetClient

_AGO = re.compile(r"^(\d{1,9})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float) -> float:
    """``--since``: unix seconds, a duration ago (``90s``, ``10m``, ``2h``, ``1d``) or an ISO 8601
    time (UTC unless it names a zone). Pure; :class:`click.BadParameter` naming the forms."""
    ago = _AGO.match(text)
    if ago:
        return max(0.0, now - int(ago.group(1)) * _UNIT_S[ago.group(2)])
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0 <= value < 1e11:
        return value
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:  # from None: the message names the forms; the parser's own text adds nothing
        raise click.BadParameter(f"{text[:64]!r} is not unix seconds, a duration like 10m or 2h, "
                                 "nor an ISO time like 2026-11-29T08:00:00") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def record_line(record: dict[str, Any]) -> str:
    """One record as a line: UTC time to the millisecond, level, logger, message (the device's
    text: printed through :func:`sdk.cli.terminal.echo`, which escapes it)."""
    when = datetime.datetime.fromtimestamp(record["ts"], datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return f"{when[:-3]}Z {record['level'].upper():<8} {record['logger']}: {record['message']}"


def fetch(client: FleetClient, device_id: str, body: dict[str, Any], timeout: float) -> None:
    """Ask the device for its records and wait until its whole answer is stored; CommandFailed
    with the device's reason when it refused (the rate limit says when to retry)."""
    command = client.post(f"/api/devices/{device_id}/logs/fetch", body)["command"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.get(f"/api/devices/{device_id}/logs", request=command, limit=1)["request"]
        if state["complete"]:
            return
        if state["final"] and state["state"] != "done":  # refused: the device says why
            raise CommandFailed(f"{device_id}: {state['reason'] or state['state']}")
        time.sleep(0.3)  # polling the server for the device's answer
    raise CommandFailed(f"{device_id} sent no complete answer to {command} within {timeout:g} s (is it online?)")


def _print_new(client: FleetClient, device_id: str, since: float | None, level: str | None, limit: int) -> float | None:
    doc = client.get(f"/api/devices/{device_id}/logs", since=None if since is None else repr(since), level=level,
                     limit=limit)
    echo(*(record_line(record) for record in doc["records"]))
    return doc["newest"] if doc["newest"] is not None else since


@device.command(name="logs")
@click.argument("device_id")
@_server_options
@click.option("--since", "since_text", metavar="T", help="Only records after T: unix seconds, 10m, 2h, 1d or an "
                                                         "ISO time.")
@click.option("--lines", type=click.IntRange(1, 10_000), default=200, show_default=True,
              help="The newest N records.")
@click.option("--level", type=click.Choice(LEVELS), help="Only records at this level or above.")
@click.option("--follow", is_flag=True, help="Keep printing newer records until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=1.0), default=5.0, show_default=True,
              help="With --follow: seconds between fetches (the device limits how often it answers).")
@click.option("--timeout", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="Seconds to wait for the device's answer.")
def logs(device_id: str, server: str, token_file: Path | None, since_text: str | None, lines: int,
         level: str | None, follow: bool, interval: float, timeout: float) -> None:
    """A device's recent log records (secrets redacted on the device), asked for through the
    fleet server and printed one line each, oldest first."""
    if not is_valid_id(device_id):
        raise click.BadParameter(f"{device_id[:64]!r} is not a device id", param_hint="DEVICE_ID")
    since = None if since_text is None else parse_since(since_text, time.time())
    client = client_for(server, token_file)
    body: dict[str, Any] = {"lines": lines, **({"since": since} if since is not None else {}),
                            **({"level": level} if level else {})}
    try:
        fetch(client, device_id, body, timeout)
        newest = _print_new(client, device_id, since, level, lines)
        while follow:
            time.sleep(interval)  # the follow period, not a synchronisation
            try:
                fetch(client, device_id, {**body, **({"since": newest} if newest is not None else {})}, timeout)
            except CommandFailed as err:  # a refused or unanswered fetch: said, and tried again
                echo(f"edgepack: {err}", err=True)
            newest = _print_new(client, device_id, newest, level, 10_000)
    except KeyboardInterrupt:  # Ctrl-C ends --follow: a normal end, exit 0
        if not follow:
            raise
