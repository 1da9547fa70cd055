"""``edgepack deploy`` and ``edgepack device`` (ping, get-state, rollback, cancel)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from edgepack_core.protocol.messages import JobEvent
from edgepack_core.signing import RELEASE, SigningKey, TrustStore
from sdk.broker import BrokerOptions
from sdk.cli import main
from sdk.cli.broker_options import broker_options
from sdk.cli.rollout import _server_options, client_for
from sdk.cli.server_tls import tls_options
from sdk.cli.terminal import echo
from sdk.deploy import DeployOptions, parse_model_ref, send_command, send_rollback
from sdk.deploy import deploy as run_deploy
from sdk.errors import CommandFailed
from sdk.keys import load_operator_key

_OPERATOR_KEY = click.option(
    "--operator-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), envvar="EDGEPACK_OPERATOR_KEY",
    help="Sign the command with this operator key (edgepack keygen --operator); devices with operator_keys "
         "refuse unsigned state-changing commands (or EDGEPACK_OPERATOR_KEY).")


def _percent(value: str | None) -> float | None:
    if value is None:
        return None
    text = value.rstrip("%")
    try:
        number = float(text)
    except ValueError as err:
        raise click.BadParameter(f"{value!r} is not a percentage like 10%") from err
    if not 0 < number <= 100:
        raise click.BadParameter("must be between 0 and 100%")
    return number


def _key(path: Path | None) -> SigningKey | None:
    return None if path is None else load_operator_key(path)


def _print_result(result: Any, wait: bool, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"command": result.command_id, "succeeded": result.succeeded, "aborted": result.aborted,
                               "devices": {d: {"state": j.state, "reason": j.reason, "final": j.final}
                                           for d, j in result.jobs.items()}}))
    elif wait:
        echo(*(f"{device:<24} {job.state:<12} {job.reason}" for device, job in sorted(result.jobs.items())))
    else:
        click.echo(f"sent {result.command_id} to {len(result.jobs)} device(s)")


@main.command()
@click.argument("artifact", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--device", "devices", multiple=True, help="Target device id (repeatable).")
@click.option("--group", help="Target every online device of this group.")
@broker_options
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
@click.option("--allow-contract-change", is_flag=True,
              help="Allow a model whose inputs or outputs differ from the running one (signed into the command).")
@click.option("--expect", type=int, help="With --group: fail unless at least this many devices are online.")
@_OPERATOR_KEY
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def deploy(artifact: Path, devices: tuple[str, ...], group: str | None, broker: BrokerOptions, wait: bool,
           timeout: float, canary: str | None, url: str | None, transfer: str, serve_host: str,
           trust: tuple[Path, ...], force_downgrade: bool, health_window: float | None, allow_contract_change: bool,
           expect: int | None, operator_key: Path | None, as_json: bool) -> None:
    """Send ARTIFACT to devices over MQTT and follow their update jobs."""
    if bool(devices) == bool(group):
        raise click.UsageError("give --device ID (repeatable) or --group G")
    if url is None and not wait:
        raise click.UsageError(f"the built-in {'HTTP server' if transfer == 'http' else 'chunk sender'} lives only "
                               "while deploy runs: use --wait, or --url where the artifact is hosted")

    def show(device: str, event: JobEvent) -> None:
        if not as_json:
            echo(f"{device}: {event.state} {'(final) ' if event.final else ''}{event.reason}", err=True)

    options = DeployOptions(
        artifact=artifact, broker=broker, devices=devices, group=group, wait=wait, timeout=timeout,
        canary_percent=_percent(canary), url=url, transfer=transfer,  # type: ignore[arg-type]
        serve_host=serve_host, trust=TrustStore.from_paths(trust, kind=RELEASE) if trust else None,
        force_downgrade=force_downgrade, health_window_s=health_window, allow_contract_change=allow_contract_change,
        expect=expect, operator_key=_key(operator_key), on_event=show,
    )
    result = run_deploy(options)
    _print_result(result, wait, as_json)
    if wait and not result.succeeded:
        raise CommandFailed(f"deployment {result.command_id} did not end active everywhere"
                            f"{': ' + result.aborted if result.aborted else ''}")


@main.group()
def device() -> None:
    """Send one command to one device and print its answer."""


def _command(broker: BrokerOptions, device_id: str, kind: str, timeout: float, key_path: Path | None = None,
             **body: Any) -> None:
    event, seconds = send_command(broker, device_id, kind, timeout=timeout, operator_key=_key(key_path), **body)
    _answer(event, seconds)


def _answer(event: JobEvent, seconds: float) -> None:
    click.echo(json.dumps({**event.to_json(), "round_trip_ms": round(seconds * 1000, 3)}))
    if event.state not in ("done", "active", "cancelled"):
        why = f": {event.reason}" if event.reason else ""
        raise CommandFailed(f"{event.device}: job {event.job} ended {event.state}{why}")


_TIMEOUT = click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for the answer.")


_SERVER_OR_BROKER = click.option(
    "--server", envvar="EDGEPACK_SERVER",
    help="Go through this fleet server (audited, signed with the server's operator key) instead of MQTT "
         "(or EDGEPACK_SERVER).")
_SERVER_TOKEN = click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                             envvar="EDGEPACK_SERVER_TOKEN_FILE",
                             help="With --server: the file holding the bearer token (or EDGEPACK_SERVER_TOKEN_FILE).")
_ACTION_REASON = click.option("--reason", default="", help="With --server: why (kept in the audit; at most 500 "
                                                           "characters).")


def _through_server(server: str, token_file: Path | None, device_id: str, action: str, body: dict[str, Any],
                    timeout: float) -> None:
    """One device action through the fleet server, then its job followed in the device's history
    until it ends (or ``timeout``): the same answer line as over MQTT."""
    done, job = follow_action(client_for(server, token_file), device_id, action, body, timeout)
    click.echo(json.dumps({"device": device_id, "command": done["command"], "job": job,
                           **({"held": done["held"]} if "held" in done else {})}))
    state = (job or {}).get("state")
    if job is None or not job.get("final"):
        raise CommandFailed(f"{device_id}: command {done['command']} sent; no final answer within {timeout:g} s "
                            "(see edgepack device history)")
    if state not in ("done", "active", "cancelled", "rolled_back"):
        why = f": {job['reason']}" if job.get("reason") else ""
        raise CommandFailed(f"{device_id}: job {done['command']} ended {state}{why}")


def follow_action(client: Any, device_id: str, action: str, body: dict[str, Any],
                  timeout: float) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """POST the action, then read the device's history until the command's job is final (or
    ``timeout``): (the server's answer, the job's history entry or None)."""
    import time

    done = client.post(f"/api/devices/{device_id}/actions/{action}", body)
    deadline = time.monotonic() + timeout
    job = None
    while True:
        entries = client.get(f"/api/devices/{device_id}/history", limit=20)["entries"]
        job = next((e for e in entries if e["job"] == done["command"]), job)
        if (job is not None and any(s["final"] for s in job["states"])) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if job is not None:
        job = {"state": job["state"], "final": any(s["final"] for s in job["states"]), "reason": job["reason"],
               "outcome": job["outcome"]}
    return done, job


def _no_route(broker: BrokerOptions | None, server: str | None) -> None:
    if broker is None and server is None:
        raise click.UsageError("give --broker HOST:PORT (MQTT) or --server URL (through the fleet server)")


def _read_only_command(kind: str, doc: str, *, via_server: bool = False) -> None:
    @device.command(name=kind, help=doc)
    @click.argument("device_id")
    @broker_options(required=False)
    @_TIMEOUT
    @_SERVER_OR_BROKER
    @_SERVER_TOKEN
    @tls_options
    @_ACTION_REASON
    def command(device_id: str, broker: BrokerOptions | None, timeout: float, server: str | None,
                token_file: Path | None, reason: str) -> None:
        _no_route(broker, server if via_server else None)
        if via_server and server is not None:
            _through_server(server, token_file, device_id, kind, {"reason": reason}, timeout)
            return
        if broker is None:
            raise click.UsageError("give --broker HOST:PORT")
        _command(broker, device_id, kind, timeout)


_read_only_command("ping", "Round trip to a device, over MQTT (--broker) or through the fleet server (--server).",
                   via_server=True)
_read_only_command("get-state", "The device's active model, store and profile.")


@device.command(name="rollback")
@click.argument("device_id")
@click.option("--from", "from_ref", metavar="NAME@VERSION",
              help="The model this rollback undoes (default: the one the device reports serving, asked with a "
                   "get-state first). A device serving another model refuses the rollback.")
@click.option("--model", metavar="NAME", help="The model to roll back (default: the one the device serves; on a "
              "device holding several models, name one). Over MQTT its version is asked with a get-state.")
@broker_options(required=False)
@_TIMEOUT
@_OPERATOR_KEY
@_SERVER_OR_BROKER
@_SERVER_TOKEN
@tls_options
@_ACTION_REASON
def rollback(device_id: str, from_ref: str | None, model: str | None, broker: BrokerOptions | None, timeout: float,
             operator_key: Path | None, server: str | None, token_file: Path | None, reason: str) -> None:
    """Make the device's last good model active again: through the fleet server with --server
    (audited; the device is held when its target names the model), else over MQTT (--broker)."""
    _no_route(broker, server)
    if server is not None:
        if from_ref is not None:
            raise click.UsageError("--from goes with --broker; through the server use --model NAME")
        _through_server(server, token_file, device_id, "rollback",
                        {"reason": reason, **({"model": model} if model else {})}, timeout)
        return
    assert broker is not None
    from_version = parse_model_ref(from_ref) if from_ref is not None else None
    event, seconds = send_rollback(broker, device_id, from_version=from_version, timeout=timeout,
                                   operator_key=_key(operator_key), model=model)
    _answer(event, seconds)


@device.command(name="cancel")
@click.argument("device_id")
@click.argument("job_id")
@broker_options
@_TIMEOUT
@_OPERATOR_KEY
def cancel(device_id: str, job_id: str, broker: BrokerOptions, timeout: float, operator_key: Path | None) -> None:
    """Stop a queued or running job (JOB_ID: the deploy's command id) on the device."""
    _command(broker, device_id, "cancel", timeout, operator_key, job=job_id)


@device.command(name="remove")
@click.argument("device_id")
@click.option("--model", required=True, metavar="NAME", help="The model to take out of service.")
@broker_options
@_TIMEOUT
@_OPERATOR_KEY
def remove(device_id: str, model: str, broker: BrokerOptions, timeout: float, operator_key: Path | None) -> None:
    """Stop serving a model on the device and delete its store (a device holding several named models)."""
    _command(broker, device_id, "remove", timeout, operator_key, model=model)




_REASON = click.option("--reason", default="", help="Why (kept in the audit; at most 500 characters).")


@device.command(name="decommission")
@click.argument("device_id")
@_server_options
@_REASON
def decommission(device_id: str, server: str, token_file: Path | None, reason: str) -> None:
    """Remove a device from the fleet through the fleet server: its records go, its retained state
    is cleared on the broker, and its later messages are dropped until it is enrolled again.
    Remove its broker account too (docs/fleet-server.md, "Devices")."""
    done = client_for(server, token_file).delete(f"/api/devices/{device_id}", {"reason": reason})
    echo(f"{done['device']} decommissioned" + (f": {done['reason']}" if done.get("reason") else ""))


@device.command(name="enroll")
@click.argument("device_id")
@_server_options
@_REASON
def enroll(device_id: str, server: str, token_file: Path | None, reason: str) -> None:
    """Take a decommissioned device back: its next state enrols it as a new device."""
    done = client_for(server, token_file).post(f"/api/devices/{device_id}/enroll", {"reason": reason})
    echo(f"{done['device']} may join again; its next state enrols it")


def history_lines(doc: dict[str, Any]) -> list[str]:
    """``edgepack device history`` as text: one line per job, newest first, then its states;
    reasons whole (never cut: the reason is what the operator needs)."""
    from sdk.cli.rollout import utc_time as _when

    lines = []
    for entry in doc["entries"]:
        artifact = entry.get("artifact") or {}
        what = f"{artifact.get('name') or '?'} {artifact.get('version') or '?'} ({artifact['sha256'][:12]})" \
            if artifact.get("sha256") else ""
        rollout = f" rollout {entry['rollout']['id']}" if entry.get("rollout") else \
            f" target ({entry['target']})" if entry.get("target") else ""
        by = "" if entry["sent_by_server"] else " (not sent by the server)"
        lines.append(f"{_when(entry['started_at'])}  {entry['job']}  {entry['kind']} {what}{rollout}{by}: "
                     f"{entry['outcome']}" + (f": {entry['reason']}" if entry["reason"] else ""))
        lines.extend(f"    {_when(state['received_at'])}  {state['state']}{' (final)' if state['final'] else ''}"
                     + (f": {state['reason']}" if state["reason"] else "") for state in entry["states"])
    return lines or [f"{doc['device']}: no update recorded"]


@device.command(name="history")
@click.argument("device_id")
@_server_options
@click.option("--limit", type=click.IntRange(1, 200), default=50, show_default=True, help="Jobs to show.")
@click.option("--before", type=click.FloatRange(min=0), help="Only jobs started before this time (paging).")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON document.")
def history(device_id: str, server: str, token_file: Path | None, limit: int, before: float | None,
            as_json: bool) -> None:
    """Every job and rollout the device went through, newest first, with outcome and reason."""
    from edgepack_core.protocol.ids import is_valid_id

    if not is_valid_id(device_id):
        raise click.BadParameter(f"{device_id[:64]!r} is not a device id", param_hint="DEVICE_ID")
    query: dict[str, Any] = {"limit": limit}
    if before is not None:
        query["before"] = repr(before)
    doc = client_for(server, token_file).get(f"/api/devices/{device_id}/history", **query)
    if as_json:
        click.echo(json.dumps(doc))
    else:
        echo(*history_lines(doc))
