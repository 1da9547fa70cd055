"""``edgepack target set|show|hold|release``: the fleet's desired state, from the CLI.

Thin commands over the fleet server's REST API (:mod:`sdk.fleet_server.client`). ``set``
says which artifact a model should be on the fleet, a group or a device (ARTIFACT a file,
uploaded when the server lacks it, or a sha256); the server reconciles every device to it
(:mod:`sdk.fleet_server.targets`). With ``--wait`` it follows the devices and exits 0 only
when every one is on target; otherwise each device still off target is listed with why.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import click

from edgepack_core.fsutil import sha256_file
from sdk.cli import main
from sdk.cli.rollout import _follow, _line, _server_options, _waves, client_for
from sdk.cli.terminal import echo
from sdk.errors import CommandFailed, FleetServerError
from sdk.fleet_server.client import FleetClient

_SHA = re.compile(r"^[0-9a-f]{64}$")


def _scope_path(fleet: bool, group: str | None, device: str | None) -> str:
    if sum((fleet, group is not None, device is not None)) != 1:
        raise click.UsageError("give exactly one of --fleet, --group G, --device D")
    if group is not None:
        return f"/api/targets/groups/{group}"
    return f"/api/targets/devices/{device}" if device is not None else "/api/targets/fleet"


def _artifact(client: FleetClient, artifact: str) -> tuple[str, str | None]:
    """ARTIFACT as (sha256, model name): a file is uploaded when the server lacks it; a sha256
    is looked up; ``absent`` has no model name of its own."""
    if artifact == "absent":
        return artifact, None
    path = Path(artifact)
    if _SHA.match(artifact) and not path.exists():
        known = client.artifact(artifact)
        if known is None:
            raise FleetServerError(f"the server has no artifact {artifact} (give the file to upload it)")
        return artifact, str(known["name"])
    if not path.is_file():
        raise click.BadParameter(f"{artifact!r} is neither a file nor a sha256", param_hint="ARTIFACT")
    sha = sha256_file(path)
    known = client.artifact(sha)
    if known is None:
        known = client.upload(path)
        echo(f"uploaded {known['name']} {known['version']} ({sha[:12]})", err=True)
    return sha, str(known["name"])


def _states(client: FleetClient, fleet: bool, group: str | None, device: str | None) -> list[dict[str, Any]]:
    """Each covered device's state, reason and difference."""
    if device is not None:
        doc = client.get(f"/api/devices/{device}/target")
        return [{"device": device, "state": doc["state"], "reason": doc["reason"], "difference": doc["difference"]}]
    if group is not None:
        return list(client.get(f"/api/targets/groups/{group}")["devices"])
    return list(client.get("/api/targets")["states"])


def _state_lines(states: list[dict[str, Any]]) -> list[str]:
    lines = [f"  {'DEVICE':<24} {'STATE':<10} WHY"]
    for item in states:
        diff = "; ".join(f"{m}: {d}" for m, d in item["difference"].items())
        why = item["reason"] if item["state"] != "converged" else "on target"
        lines.append(f"  {item['device']:<24} {item['state']:<10} {why}{'  [' + diff + ']' if diff else ''}")
    return lines


def _wait(client: FleetClient, scope: tuple[bool, str | None, str | None], timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        states = _states(client, *scope)
        if all(item["state"] == "converged" for item in states) or time.monotonic() >= deadline:
            return states
        time.sleep(0.5)


@main.group()
def target() -> None:
    """Desired state on a fleet server: which artifact each model should be, per fleet, group or device."""


@target.command(name="set")
@click.argument("artifact")
@_server_options
@click.option("--fleet", is_flag=True, help="The whole fleet (groups and devices with their own target win).")
@click.option("--group", help="Every device enrolled in this group (a device's own target wins).")
@click.option("--device", help="One device.")
@click.option("--model", help="The model name (default: the artifact's own name).")
@click.option("--reason", default="", help="Why (kept in the audit log).")
@click.option("--waves", help="Stage the change (a group or the fleet): cumulative percentages of the devices that "
                              "need it, e.g. 5,25,100; a rollout moves them and the target changes when it succeeds.")
@click.option("--soak", "soak_s", type=float, help="With --waves: seconds each passed wave is watched.")
@click.option("--wave-timeout", type=float, help="With --waves: seconds a device has to answer finally.")
@click.option("--success-share", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="With --waves: share of a wave that must end active (default 1).")
@click.option("--wait", is_flag=True, help="Follow the devices; exit 0 only when every one is on target.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="With --wait: seconds to follow.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def set_target(artifact: str, server: str, token_file: Path | None, fleet: bool, group: str | None,
               device: str | None, model: str | None, reason: str, waves: str | None, soak_s: float | None,
               wave_timeout: float | None, success_share: float | None, wait: bool, timeout: float,
               as_json: bool) -> None:
    """Set MODEL of the fleet, a group or a device to ARTIFACT (a file, a sha256 or "absent");
    the server sends each device that differs the signed command, downgrades included."""
    path = _scope_path(fleet, group, device)
    if waves is None and (soak_s is not None or wave_timeout is not None or success_share is not None):
        raise click.UsageError("--soak, --wave-timeout and --success-share stage a change: give --waves too")
    client = client_for(server, token_file)
    sha, name = _artifact(client, artifact)
    model = model or name
    if model is None:
        raise click.UsageError("give --model NAME with absent")
    body: dict[str, Any] = {"models": {model: sha}, "reason": reason}
    if waves is not None:
        body.update({"waves": _waves(waves), **({"soak_s": soak_s} if soak_s is not None else {}),
                     **({"wave_timeout_s": wave_timeout} if wave_timeout is not None else {}),
                     **({"min_success_share": success_share} if success_share is not None else {})})
    doc = client.put(path, body)
    staged = [s for s in doc.get("staged", []) if s["artifact"] == sha and s["model"] == model]
    if not wait:
        where = path.removeprefix("/api/targets/")
        if as_json:
            click.echo(json.dumps(doc))
        else:
            echo(f"{where}: {model} -> {sha}{' (staged in rollout ' + staged[-1]['rollout'] + ')' if staged else ''}")
        return
    deadline = time.monotonic() + timeout
    if staged:
        rollout_id = staged[-1]["rollout"]
        echo(f"staged in rollout {rollout_id}", err=True)
        final = _follow(client, rollout_id, timeout=timeout, interval=1.0,
                        show=None if as_json else (lambda d: echo(_line(d), err=True)))
        if final["state"] != "succeeded":
            raise CommandFailed(f"rollout {rollout_id} ended {final['state']}: the target was not changed"
                                f"{': ' + final['reason'] if final.get('reason') else ''}")
    states = _wait(client, (fleet, group, device), max(0.0, deadline - time.monotonic()))
    off = [item for item in states if item["state"] != "converged"]
    if as_json:
        click.echo(json.dumps(states))
    else:
        echo(f"{len(states) - len(off)}/{len(states)} device(s) on target", *_state_lines(states))
    if off:
        raise CommandFailed(f"{len(off)} device(s) not on target after {timeout:g} s: "
                            f"{off[0]['device']}: {off[0]['reason']}")


def _show_scope(doc: dict[str, Any], label: str) -> list[str]:
    lines = [f"{label}{'  HELD' if doc.get('hold') else ''}"]
    lines += [f"  {model}: {entry if isinstance(entry, str) else entry['artifact']}"
              for model, entry in doc.get("models", {}).items()]
    return lines


@target.command()
@_server_options
@click.option("--group", help="One group's target and its devices.")
@click.option("--device", help="One device: effective target, reported state, difference and why.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show(server: str, token_file: Path | None, group: str | None, device: str | None, as_json: bool) -> None:
    """Targets and how far the devices are from them (every scope without --group or --device)."""
    if group is not None and device is not None:
        raise click.UsageError("give --group or --device, not both")
    client = client_for(server, token_file)
    if device is not None:
        doc = client.get(f"/api/devices/{device}/target")
        if as_json:
            click.echo(json.dumps(doc))
            return
        effective = doc["effective"]
        lines = [f"{device} ({', '.join(doc['groups']) or 'no group'}): {doc['state']}  {doc['reason']}"]
        lines += [f"  target {m}: {w['artifact']} (from {w['source']})" for m, w in effective["models"].items()]
        lines += [f"  runs   {m}: {r['version']}" for m, r in doc["reported"]["models"].items()]
        lines += [f"  differs {m}: {d}" for m, d in doc["difference"].items()]
        if effective["held_by"]:
            lines.append(f"  held by {', '.join(effective['held_by'])}")
        echo(*lines)
        return
    path = f"/api/targets/groups/{group}" if group is not None else "/api/targets"
    doc = client.get(path)
    if as_json:
        click.echo(json.dumps(doc))
        return
    if group is not None:
        lines = _show_scope({"models": doc["models"], "hold": doc["hold"]}, f"group {group}")
        lines += _state_lines(doc["devices"])
    else:
        lines = _show_scope(doc["fleet"], "fleet")
        for kind in ("groups", "devices"):
            for name, scope in doc[kind].items():
                lines += _show_scope(scope, f"{kind[:-1]} {name}")
        lines += _state_lines(doc["states"])
    echo(*lines)


def _hold(name: str, hold: bool, doc: str) -> None:
    @target.command(name=name, help=doc)
    @_server_options
    @click.option("--device", required=True, help="The device.")
    @click.option("--reason", default="", help="Why (kept in the audit log).")
    def command(server: str, token_file: Path | None, device: str, reason: str) -> None:
        client_for(server, token_file).put(f"/api/targets/devices/{device}", {"hold": hold, "reason": reason})
        echo(f"{device}: {'held' if hold else 'released'}")


_hold("hold", True, "Send a device no command until it is released (its target is kept).")
_hold("release", False, "Let the server reconcile a held device again.")
