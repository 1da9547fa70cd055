"""``edgepack fleet status`` and ``edgepack fleet watch`` (``edgepack fleet serve``: sdk/cli/fleet_server.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from edgepack_core.protocol.messages import ModelRef, Telemetry
from sdk.broker import BrokerOptions
from sdk.cli import main
from sdk.cli.broker_options import broker_options
from sdk.cli.server_tls import tls_options
from sdk.cli.terminal import echo
from sdk.fleet import DeviceRow, FleetView, collect, format_table

_SILENCE = click.option("--silence", "silence_s", default=60.0, show_default=True,
                        help="Seconds without a message after which an online device counts as silent.")
_SHARE = click.option("--share", default=None, help="Join this MQTT 5 shared-subscription group for telemetry.")


@main.group()
def fleet() -> None:
    """See the devices of a fleet from their MQTT state and telemetry."""


def server_rows(devices: list[dict[str, Any]]) -> list[DeviceRow]:
    """The fleet server's device documents as rows of the same table ``--broker`` prints."""
    rows = []
    for doc in devices:
        status = "online" if doc.get("online") else ("offline" if doc.get("status") == "offline" else "silent")
        device = str(doc.get("id"))
        latency = doc.get("latency_ms") or {}
        telemetry = Telemetry(device, latency_p50=latency.get("p50"), latency_p99=latency.get("p99"),
                              errors_total=doc.get("errors_total") or 0)
        model = doc.get("model")
        rows.append(DeviceRow(device=device, status=status, status_reason=doc.get("status_reason") or "",
                              last_seen=doc.get("last_seen"), provider=doc.get("provider"),
                              model=ModelRef(model.get("name"), model.get("version"), model.get("sha256"))
                              if isinstance(model, dict) else None,
                              profile=doc.get("profile"), groups=list(doc.get("groups") or []), telemetry=telemetry))
    return rows


def _server_status(server: str, token_file: Path | None, group: str | None, as_json: bool) -> None:
    from sdk.cli.rollout import client_for

    answer = client_for(server, token_file).get("/api/devices", group=group, limit=10000)
    if as_json:
        click.echo(json.dumps(answer))
        return
    echo(*format_table(server_rows(answer.get("devices", [])), time.time()).split("\n"))
    if answer.get("total", 0) > len(answer.get("devices", [])):
        echo(f"(first {len(answer['devices'])} of {answer['total']})")


@fleet.command()
@broker_options(required=False)
@click.option("--server", envvar="EDGEPACK_SERVER",
              help="Read the fleet from this fleet server (edgepack fleet serve) instead of the broker "
                   "(or EDGEPACK_SERVER).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              envvar="EDGEPACK_SERVER_TOKEN_FILE", help="With --server: the bearer token's file.")
@tls_options
@click.option("--group", help="With --server: only this group.")
@_SILENCE
@_SHARE
@click.option("--wait", "wait_s", default=3.0, show_default=True, help="Listen at most this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(broker: BrokerOptions | None, server: str | None, token_file: Path | None, group: str | None,
           silence_s: float, share: str | None, wait_s: float, as_json: bool) -> None:
    """Print every known device: online or not, model, provider, latency, errors, last seen.

    With --server, the fleet server's view (its JSON with --json: {devices, total, counts});
    with --broker, the view rebuilt from the broker's retained state and live telemetry."""
    if server is not None:
        _server_status(server, token_file, group, as_json)
        return
    if broker is None:
        raise click.UsageError("give --broker HOST:PORT (or --server URL for a fleet server)")
    if group is not None:
        raise click.UsageError("--group goes with --server")
    view = collect(broker, wait_s=wait_s, silence_s=silence_s, share=share)
    now = time.time()
    rows = view.rows(now)
    if as_json:
        click.echo(json.dumps({"devices": [r.to_json() for r in rows], "dropped": view.dropped,
                               "online": sum(1 for r in rows if r.status == "online")}, default=str))
    else:
        echo(*format_table(rows, now).split("\n"))


@fleet.command()
@broker_options
@_SILENCE
@_SHARE
@click.option("--interval", default=1.0, show_default=True, help="Seconds between screen refreshes.")
@click.option("--duration", default=0.0, help="Stop after this many seconds (0: until Ctrl-C).")
def watch(broker: BrokerOptions, silence_s: float, share: str | None, interval: float, duration: float) -> None:
    """Show the fleet table live, refreshed every INTERVAL seconds."""
    last_draw = [0.0]
    started = time.time()

    def draw(view: FleetView) -> None:
        now = time.time()
        if now - last_draw[0] >= interval:
            last_draw[0] = now
            click.clear()
            echo(*format_table(view.rows(now), now).split("\n"))

    forever = duration <= 0
    collect(broker, wait_s=duration if not forever else float("inf"), quiet_s=float("inf"), silence_s=silence_s,
            on_tick=draw, share=share)
    if not forever:
        click.echo(f"watched for {time.time() - started:.0f}s")
