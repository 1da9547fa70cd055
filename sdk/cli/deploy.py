"""``edgepack deploy`` and ``edgepack device`` (ping, state, rollback)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from edgepack_core.signing import TrustStore
from sdk.cli import main
from sdk.deploy import deploy as run_deploy
from sdk.deploy import send_command


def _percent(value: str | None) -> float | None:
    if value is None:
        return None
    text = value.rstrip("%")
    try:
        number = float(text)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a percentage like 10%") from None
    if not 0 < number <= 100:
        raise click.BadParameter("must be between 0 and 100%")
    return number


@main.command()
@click.argument("artifact", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--device", "devices", multiple=True, help="Target device id (repeatable).")
@click.option("--group", help="Target every online device of this group.")
@click.option("--broker", required=True, help="MQTT broker as HOST:PORT.")
@click.option("--wait/--no-wait", default=False, help="Follow every job to its end (exit 0 only if all end active).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the jobs.")
@click.option("--canary", help="Staged rollout: send to this share first (e.g. 10%), the rest only if they succeed.")
@click.option("--url", help="Devices fetch the artifact from this URL (object store, CDN) instead.")
@click.option("--transfer", type=click.Choice(["http", "mqtt"]), default="http", show_default=True,
              help="Serve the artifact from a built-in HTTP server, or in chunks over MQTT.")
@click.option("--serve-host", default="127.0.0.1", show_default=True,
              help="Address the built-in HTTP server binds to (devices must reach it).")
@click.option("--trust", "trust", multiple=True, type=click.Path(path_type=Path),
              help="Verify the artifact locally before sending it.")
@click.option("--force-downgrade", is_flag=True, help="Allow devices to install an older version.")
@click.option("--health-window", type=float, help="Seconds each device watches the new model before closing the job.")
@click.option("--expect", type=int, help="With --group: fail unless at least this many devices are online.")
@click.option("--topic-root", default="edgepack/v1", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def deploy(artifact: Path, devices: tuple[str, ...], group: str | None, broker: str, wait: bool, timeout: float,
           canary: str | None, url: str | None, transfer: str, serve_host: str, trust: tuple[Path, ...],
           force_downgrade: bool, health_window: float | None, expect: int | None, topic_root: str,
           as_json: bool) -> None:
    """Send ARTIFACT to devices over MQTT and follow their update jobs."""
    if bool(devices) == bool(group):
        raise click.UsageError("give --device ID (repeatable) or --group G")
    if transfer == "http" and url is None and not wait:
        raise click.UsageError("the built-in HTTP server lives only while deploy runs: use --wait, --url or "
                               "--transfer mqtt with --wait")

    def show(device: str, event: dict[str, Any]) -> None:
        if not as_json:
            click.echo(f"{device}: {event.get('state')} {'(final) ' if event.get('final') else ''}"
                       f"{event.get('reason', '')}", err=True)

    result = run_deploy(
        artifact, broker=broker, devices=list(devices) or None, group=group, wait=wait, timeout=timeout,
        canary_percent=_percent(canary), url=url, transfer=transfer, serve_host=serve_host,
        trust=TrustStore.from_paths(trust) if trust else None, force_downgrade=force_downgrade,
        health_window_s=health_window, expect=expect, root=topic_root, on_event=show,
    )
    if as_json:
        click.echo(json.dumps({"command": result.command_id, "succeeded": result.succeeded, "aborted": result.aborted,
                               "devices": {d: {"state": j.state, "reason": j.reason, "final": j.final}
                                           for d, j in result.jobs.items()}}))
    elif wait:
        for device, job in sorted(result.jobs.items()):
            click.echo(f"{device:<24} {job.state:<12} {job.reason}")
    else:
        click.echo(f"sent {result.command_id} to {len(result.jobs)} device(s)")
    if wait and not result.succeeded:
        click.echo(f"edgepack: error: deployment {result.command_id} did not end active everywhere"
                   f"{': ' + result.aborted if result.aborted else ''}", err=True)
        sys.exit(1)


@main.group()
def device() -> None:
    """Send one command to one device and print its answer."""


def _command(broker: str, device_id: str, kind: str, topic_root: str, **body: Any) -> None:
    event, seconds = send_command(broker, device_id, kind, root=topic_root, **body)
    click.echo(json.dumps({**event, "round_trip_ms": round(seconds * 1000, 3)}))
    if event.get("state") not in ("done", "active"):
        sys.exit(1)


_OPTIONS = [click.argument("device_id"), click.option("--broker", required=True),
            click.option("--topic-root", default="edgepack/v1")]


def _device_command(kind: str, doc: str) -> None:
    def command(device_id: str, broker: str, topic_root: str) -> None:
        _command(broker, device_id, kind, topic_root)

    command.__doc__ = doc
    for option in reversed(_OPTIONS):
        command = option(command)
    device.command(name=kind)(command)


_device_command("ping", "Round trip to a device over MQTT.")
_device_command("get-state", "The device's active model, store and profile.")
_device_command("rollback", "Make the device's previous model active again.")
