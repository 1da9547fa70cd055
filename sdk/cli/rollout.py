"""``edgepack rollout create|status|list|pause|resume|abort``: server-side rollouts, from the CLI.

Thin commands over the fleet server's REST API (:mod:`sdk.fleet_server.client`, standard
library only). ``create`` uploads the artifact when the server lacks it (by sha256), then
creates the rollout; with ``--wait`` it follows it and exits 0 only when the rollout succeeded
and every device ended ``active``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from edgepack_core.fsutil import sha256_file
from sdk.cli import main
from sdk.cli.server_tls import server_tls, tls_options
from sdk.cli.terminal import echo
from sdk.errors import CommandFailed, FleetServerError
from sdk.fleet_server.auth import client_token
from sdk.fleet_server.client import FleetClient

TERMINAL = ("succeeded", "failed", "aborted")
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def client_for(server: str, token_file: Path | None) -> FleetClient:
    if token_file is None:
        raise click.UsageError("give --token-file F (or EDGEPACK_SERVER_TOKEN_FILE): the server needs a token")
    return FleetClient(server, client_token(token_file), server_tls())


def _server_options(func: Any) -> Any:
    func = tls_options(func)
    func = click.option("--token-file", type=_FILE, envvar="EDGEPACK_SERVER_TOKEN_FILE",
                        help="File holding the bearer token (or EDGEPACK_SERVER_TOKEN_FILE).")(func)
    return click.option("--server", required=True, envvar="EDGEPACK_SERVER",
                        help="The fleet server's URL, e.g. http://127.0.0.1:8760 (or EDGEPACK_SERVER).")(func)


def _waves(text: str) -> list[float]:
    try:
        waves = [float(part.strip().rstrip("%")) for part in text.split(",")]
    except ValueError as err:
        raise click.BadParameter(f"{text!r} is not a list of percentages like 5,25,100") from err
    return waves


def _line(doc: dict[str, Any]) -> str:
    counts = doc.get("counts") or {}
    wave = f"wave {doc['wave'] + 1}/{doc['wave_count']}" if doc.get("wave_count") else ""
    return (f"{doc['id']} {doc['state']:<9} {wave:<10} active {counts.get('active', 0)}/{counts.get('devices', 0)}"
            f" failed {counts.get('failed', 0)} in progress {counts.get('in_progress', 0)}"
            f"{'  ' + doc['reason'] if doc.get('reason') else ''}")


def _waits(wave: dict[str, Any]) -> str:
    """A wave's offline devices and its deadline, when it has them."""
    offline = f", {wave['offline']} offline" if wave.get("offline") else ""
    deadline = f", times out at {utc_time(wave['deadline'])} UTC" if wave.get("deadline") else ""
    return offline + deadline


def _table(doc: dict[str, Any]) -> list[str]:
    """The rollout's lines (devices' reasons in them: printed through :func:`echo`)."""
    lines = [_line(doc)]
    for wave in doc.get("waves", []):
        lines.append(f"  wave {wave['index'] + 1} ({wave['percent']:g}%): {wave['state']:<8} "
                     f"{wave['active']}/{wave['devices']} active, {wave['failed']} failed" + _waits(wave))
    lines.append(f"  {'DEVICE':<24} {'WAVE':>4} {'STATE':<12} REASON")
    for device in doc.get("devices", []):
        undo = device.get("undo")
        tail = f" [{undo['kind']}: {undo['state']}]" if undo else ""
        lines.append(f"  {device['device']:<24} {device['wave'] + 1:>4} {device['state']:<12} "
                     f"{device['reason']}{tail}")
    transitions = doc.get("transitions") or []
    if transitions:
        lines.append("  HISTORY")
    for step in transitions:
        moved = f"{step['from']} -> {step['to']}" if step["from"] != step["to"] else step["to"]
        lines.append(f"  {utc_time(step['at'])}  {step['event']:<8} {moved:<20} wave {step['wave']:<3} "
                     f"by {step['actor']}" + (f": {step['reason']}" if step["reason"] else ""))
    return lines


def _print(doc: dict[str, Any], as_json: bool) -> None:
    """A rollout: the server's JSON, or its lines escaped."""
    if as_json:
        click.echo(json.dumps(doc))
    else:
        echo(*_table(doc))


def utc_time(ts: float | None) -> str:
    """A unix time as ``YYYY-MM-DD HH:MM:SS`` UTC ("-" for None)."""
    import datetime

    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _everyone_active(doc: dict[str, Any]) -> bool:
    devices = doc.get("devices", [])
    return doc.get("state") == "succeeded" and bool(devices) and \
        all(d["state"] == "active" and d["final"] for d in devices)


def _follow(client: FleetClient, rollout_id: str, *, timeout: float, interval: float,
            show: Any = None) -> dict[str, Any]:
    """Poll until the rollout ends (or ``timeout``); ``show(doc)`` on every change."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        doc = client.get(f"/api/rollouts/{rollout_id}")
        line = _line(doc)
        if line != last and show is not None:
            show(doc)
        last = line
        if doc["state"] in TERMINAL:
            return doc
        if time.monotonic() >= deadline:
            raise FleetServerError(f"rollout {rollout_id} is still {doc['state']} after {timeout:g} s "
                                   "(it goes on on the server)")
        time.sleep(interval)


@main.group()
def rollout() -> None:
    """Rollouts run by a fleet server (edgepack fleet serve): create, follow, pause, resume, abort."""


@rollout.command()
@click.argument("artifact", type=_FILE)
@_server_options
@click.option("--group", help="Every device of this group online now.")
@click.option("--device", "devices", multiple=True, help="A target device (repeatable).")
@click.option("--waves", default="100", show_default=True,
              help="Cumulative percentages of the targets per wave, the last 100 (e.g. 5,25,100).")
@click.option("--soak", "soak_s", type=float, default=0.0, show_default=True,
              help="Seconds a passed wave is watched (online, error rate) before the next starts.")
@click.option("--success-share", type=float, default=1.0, show_default=True,
              help="Share of a wave that must end active (0 to 1).")
@click.option("--wave-timeout", type=float, default=1800.0, show_default=True,
              help="Seconds a device has to answer finally; later counts as failed.")
@click.option("--max-error-rate", type=float, help="During the soak: the largest error share of inferences.")
@click.option("--rollback-on-failure", is_flag=True, help="A failed wave rolls back the devices already updated.")
@click.option("--health-window", type=float, help="Seconds each device watches the new model (signed in).")
@click.option("--force-downgrade", is_flag=True, help="Allow devices to install an older version.")
@click.option("--allow-contract-change", is_flag=True, help="Allow a model whose inputs or outputs differ.")
@click.option("--exclude-offline", is_flag=True,
              help="With --device: leave out the devices offline now (a --group takes online devices only).")
@click.option("--wait", is_flag=True, help="Follow the rollout; exit 0 only if every device ends active.")
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="With --wait: seconds to follow.")
@click.option("--json", "as_json", is_flag=True, help="Print the rollout as JSON.")
@click.option("--reason", default="", help="Why (kept in the rollout's history and the audit; at most 500 characters).")
def create(artifact: Path, server: str, token_file: Path | None, group: str | None, devices: tuple[str, ...],
           waves: str, soak_s: float, success_share: float, wave_timeout: float, max_error_rate: float | None,
           rollback_on_failure: bool, health_window: float | None, force_downgrade: bool,
           allow_contract_change: bool, exclude_offline: bool, wait: bool, timeout: float, as_json: bool,
           reason: str) -> None:
    """Roll ARTIFACT out to a group or devices, in waves, from the server."""
    if bool(devices) == bool(group):
        raise click.UsageError("give --group G or --device ID (repeatable)")
    client = client_for(server, token_file)
    sha = sha256_file(artifact)
    if client.artifact(sha) is None:
        uploaded = client.upload(artifact)
        echo(f"uploaded {uploaded['name']} {uploaded['version']} ({sha[:12]})", err=True)
    body: dict[str, Any] = {"artifact": sha, "waves": _waves(waves), "soak_s": soak_s,
                            "min_success_share": success_share, "wave_timeout_s": wave_timeout,
                            "rollback_on_failure": rollback_on_failure, "force_downgrade": force_downgrade,
                            "allow_contract_change": allow_contract_change}
    body.update({"group": group} if group else {"devices": list(devices)})
    if max_error_rate is not None:
        body["max_error_rate"] = max_error_rate
    if health_window is not None:
        body["health_window_s"] = health_window
    if reason:
        body["reason"] = reason
    if exclude_offline:
        if group:
            raise click.UsageError("--exclude-offline goes with --device (a --group takes online devices only)")
        body["exclude_offline"] = True
    doc = client.post("/api/rollouts", body)
    if not wait:
        click.echo(json.dumps(doc)) if as_json else echo(
            f"created {doc['id']}: {doc['counts']['devices']} device(s) in {doc['wave_count']} wave(s)")
        return
    echo(f"created {doc['id']}", err=True)
    final = _follow(client, doc["id"], timeout=timeout, interval=1.0,
                    show=None if as_json else (lambda d: echo(_line(d), err=True)))
    _print(final, as_json)
    if not _everyone_active(final):
        raise CommandFailed(f"rollout {final['id']} ended {final['state']}: not every device is active"
                            f"{': ' + final['reason'] if final.get('reason') else ''}")


@rollout.command()
@click.argument("rollout_id")
@_server_options
@click.option("--watch", is_flag=True, help="Refresh until the rollout ends.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="With --watch: seconds between reads.")
@click.option("--json", "as_json", is_flag=True, help="Print the rollout as JSON.")
def status(rollout_id: str, server: str, token_file: Path | None, watch: bool, interval: float,
           as_json: bool) -> None:
    """Show a rollout: its state, waves and every device's job."""
    client = client_for(server, token_file)
    if not watch:
        _print(client.get(f"/api/rollouts/{rollout_id}"), as_json)
        return

    def show(doc: dict[str, Any]) -> None:
        if as_json:
            click.echo(json.dumps(doc))
        else:
            echo(_line(doc))

    final = _follow(client, rollout_id, timeout=float("inf"), interval=max(0.2, interval), show=show)
    if not as_json:
        echo(*_table(final))


@rollout.command(name="list")
@_server_options
@click.option("--state", help="Only rollouts in this state.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_rollouts(server: str, token_file: Path | None, state: str | None, as_json: bool) -> None:
    """The server's rollouts, newest first."""
    docs = client_for(server, token_file).get("/api/rollouts", state=state)["rollouts"]
    if as_json:
        click.echo(json.dumps(docs))
        return
    echo(*(f"{doc['id']} {doc['state']:<9} {doc['artifact']['name']} {doc['artifact']['version']} "
           f"wave {doc['wave'] + 1}/{doc['wave_count']} {doc['reason']}" for doc in docs))


def _action(name: str, doc: str) -> None:
    @rollout.command(name=name, help=doc)
    @click.argument("rollout_id")
    @_server_options
    @click.option("--reason", default="", help="Recorded in the rollout's history and the audit log (at most 500 "
                                               "characters, kept whole).")
    def command(rollout_id: str, server: str, token_file: Path | None, reason: str) -> None:
        answer = client_for(server, token_file).post(f"/api/rollouts/{rollout_id}/{name}",
                                                     {"reason": reason} if reason else {})
        echo(_line(answer))


_action("pause", "Stop sending new commands (jobs already sent go on).")
_action("resume", "Continue a paused rollout.")
_action("abort", "End a rollout for good (no new commands).")
