"""``edgepack fleet status`` and ``edgepack fleet watch``."""

from __future__ import annotations

import json
import time

import click

from sdk.broker import BrokerOptions
from sdk.cli import main
from sdk.cli.broker_options import broker_options
from sdk.fleet import FleetView, collect, format_table

_SILENCE = click.option("--silence", "silence_s", default=60.0, show_default=True,
                        help="Seconds without a message after which an online device counts as silent.")
_SHARE = click.option("--share", default=None, help="Join this MQTT 5 shared-subscription group for telemetry.")


@main.group()
def fleet() -> None:
    """See the devices of a fleet from their MQTT state and telemetry."""


@fleet.command()
@broker_options
@_SILENCE
@_SHARE
@click.option("--wait", "wait_s", default=3.0, show_default=True, help="Listen at most this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(broker: BrokerOptions, silence_s: float, share: str | None, wait_s: float, as_json: bool) -> None:
    """Print every known device: online or not, model, provider, latency, errors, last seen."""
    view = collect(broker, wait_s=wait_s, silence_s=silence_s, share=share)
    now = time.time()
    rows = view.rows(now)
    if as_json:
        click.echo(json.dumps({"devices": [r.to_json() for r in rows], "dropped": view.dropped,
                               "online": sum(1 for r in rows if r.status == "online")}, default=str))
    else:
        click.echo(format_table(rows, now))


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
            click.echo(format_table(view.rows(now), now))

    forever = duration <= 0
    collect(broker, wait_s=duration if not forever else float("inf"), quiet_s=float("inf"), silence_s=silence_s,
            on_tick=draw, share=share)
    if not forever:
        click.echo(f"watched for {time.time() - started:.0f}s")
