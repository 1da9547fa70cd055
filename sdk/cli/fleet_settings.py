"""``edgepack fleet settings set|show`` and ``edgepack fleet keys add|retire|list``: agent settings
and the devices' keys, held by the fleet server and sent to devices in signed documents
(docs/fleet-server.md, "Settings and keys")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from edgepack_core.errors import KeyFileError
from edgepack_core.signing import KEY_KINDS, check_kind, key_id, public_key_from_pem
from sdk.cli.fleet import fleet
from sdk.cli.rollout import _server_options, client_for
from sdk.cli.terminal import echo

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


MAX_PIPELINES_FILE_BYTES = 256 * 1024


def _scope_path(device: str | None, group: str | None, whole_fleet: bool, verb: str) -> str:
    given = [flag for flag, value in (("--device", device), ("--group", group), ("--fleet", whole_fleet)) if value]
    if len(given) != 1:
        raise click.UsageError(f"{verb} needs exactly one of --device D, --group G or --fleet")
    if device:
        return f"/api/settings/devices/{device}"
    return f"/api/settings/groups/{group}" if group else "/api/settings/fleet"


@fleet.group()
def settings() -> None:
    """Agent settings the server sends to devices (signed; applied live, reported back)."""


@settings.command("set")
@_server_options
@click.option("--device", help="Only this device (beats its groups and the fleet).")
@click.option("--group", help="Every device of this group (beats the fleet).")
@click.option("--fleet", "whole_fleet", is_flag=True, help="Every device.")
@click.option("--unset", "unset", multiple=True, help="A key to remove from this scope (repeatable).")
@click.option("--reason", default="", help="Why (kept in the audit).")
@click.argument("assignments", nargs=-1)
def set_settings(
    server: str,
    token_file: Path | None,
    device: str | None,
    group: str | None,
    whole_fleet: bool,
    unset: tuple[str, ...],
    reason: str,
    assignments: tuple[str, ...],
) -> None:
    """Set KEY=VALUE settings (e.g. mqtt.telemetry_interval=5, updates.allowed_origins=http://a:80,http://b:80).

    Lists are comma-separated; the keys are agent.yaml's (docs/agent.md, "Remote settings");
    pipelines=@FILE takes a YAML list of pipelines (docs/agent.md, "Pipelines")."""
    from sdk.fleet_server.settings import parse_assignment

    path = _scope_path(device, group, whole_fleet, "settings set")
    if not assignments and not unset:
        raise click.UsageError("give KEY=VALUE settings or --unset KEY")
    values: dict[str, Any] = {}
    for text in assignments:
        if text.startswith("pipelines=@"):
            values["pipelines"] = _pipelines_file(Path(text.removeprefix("pipelines=@")))
            continue
        try:
            key, value = parse_assignment(text)
        except ValueError as err:
            raise click.UsageError(str(err)) from err
        values[key] = value
    client_for(server, token_file).put(path, {"set": values, "unset": list(unset), "reason": reason})
    click.echo(
        f"set {', '.join(sorted(values)) or '-'}; unset {', '.join(unset) or '-'}; devices get the new "
        "document at the next reconciler round"
    )


def _pipelines_file(path: Path) -> Any:
    """The pipelines list of a YAML file, checked here by the device's own rule before it is sent."""
    from edgepack_core.errors import SchemaError
    from edgepack_core.pipeline_spec import parse_pipelines
    from edgepack_core.yamlfile import read_yaml_file

    document = read_yaml_file(path, MAX_PIPELINES_FILE_BYTES, lambda problem: SchemaError(str(path), problem),
                              kind="pipelines")
    parse_pipelines(document, where=f"{path}: pipelines")
    return document


@settings.command("show")
@_server_options
@click.option("--device", help="The document this device should hold, and what it reported.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
def show_settings(server: str, token_file: Path | None, device: str | None, as_json: bool) -> None:
    """Every scope's settings, or one device's document and report."""
    client = client_for(server, token_file)
    doc = client.get(f"/api/devices/{device}/settings") if device else client.get("/api/settings")
    if as_json:
        click.echo(json.dumps(doc, indent=1, sort_keys=True))
        return
    if device:
        _show_device(doc)
        return
    for entry in doc["entries"]:
        scope = entry["scope"] + (f" {entry['name']}" if entry["name"] else "")
        echo(f"{scope:<24} {entry['key']:<34} {json.dumps(entry['value'])}  (by {entry['set_by']})")
    echo(*(f"key {key['key_id']} {key['kind']:<9} {'in use' if key['in_use'] else 'retired'}" for key in doc["keys"]))


def _show_device(doc: dict[str, Any]) -> None:
    reported = doc.get("reported") or {}
    results = reported.get("results", {})
    sent = doc.get("sent") or {}
    echo(
        f"{doc['device']}: generation sent {sent.get('generation', '-')}, held {reported.get('generation', '-')}"
        f" ({doc['decision']['kind']}{': ' + doc['decision']['reason'] if doc['decision']['reason'] else ''})"
    )
    for key, value in sorted(doc["settings"].items()):
        echo(
            f"  {key:<34} {json.dumps(value):<30} from {doc['sources'][key]:<14} {results.get(key, 'not reported')}"
        )
    keys = reported.get("keys") or {}
    echo(
        f"  keys held: release {', '.join(keys.get('release', [])) or '-'}; operator "
        f"{', '.join(keys.get('operator', [])) or '-'}"
    )


@fleet.group()
def keys() -> None:
    """The release and operator public keys every device is told to hold (rotation)."""


@keys.command("add")
@_server_options
@click.option("--kind", type=click.Choice(KEY_KINDS), required=True, help="What the key signs.")
@click.argument("public_key", type=_FILE)
def add_key(server: str, token_file: Path | None, kind: str, public_key: Path) -> None:
    """Add PUBLIC_KEY (a .pub file): devices trust it after the next settings document."""
    data = public_key.read_bytes()[: 64 * 1024]
    check_kind(data, str(public_key), kind)
    if b"PRIVATE KEY" in data:
        raise KeyFileError(str(public_key), "this is a private key; give the public key")
    public_key_from_pem(data, str(public_key))
    row = client_for(server, token_file).post("/api/keys", {"kind": kind, "pem": data.decode("ascii")})
    echo(f"added {row['kind']} key {row['key_id']}")


@keys.command("retire")
@_server_options
@click.argument("key")
def retire_key(server: str, token_file: Path | None, key: str) -> None:
    """Retire KEY (a key id, or the .pub file): the next documents leave it out."""
    path = Path(key)
    kid = key_id(public_key_from_pem(path.read_bytes()[: 64 * 1024], key)) if path.is_file() else key
    row = client_for(server, token_file).delete(f"/api/keys/{kid}")
    echo(f"retired {row['kind']} key {row['key_id']}")


@keys.command("list")
@_server_options
def list_keys(server: str, token_file: Path | None) -> None:
    """The fleet's keys, in use and retired."""
    rows = client_for(server, token_file).get("/api/keys")["keys"]
    echo(*(f"{row['key_id']} {row['kind']:<9} {'in use' if row['in_use'] else 'retired'}" for row in rows))
