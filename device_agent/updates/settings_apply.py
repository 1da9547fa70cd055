"""``apply-settings``: a signed settings document from the fleet server, applied live.

The command was authorised (always signed: ``edgepack_core.command_auth``) and de-duplicated by
the update service. Here: the whole document is checked up front (unknown or local-only keys,
values out of bounds, a key list left empty: refused whole, nothing changed); a generation not
newer than the held one is refused (a replay or a reordering); each key is decided against the
device's own bounds (:func:`device_agent.remote_settings.decide`); the document is persisted
atomically before anything changes, then every applied key takes effect at once, with no
restart: trust and operator keys, groups (their command topics subscribed or dropped), the
telemetry period, health limits, allowed origins, log level, artifact limits, pipelines (the
running ones stopped, the new ones checked against the installed models and started). The state message
then reports the generation, each key's result and the keys the device holds.
"""

from __future__ import annotations

import logging
from typing import Any

from device_agent.remote_settings import Held, decide, limits_for, overlay, save_held
from device_agent.updates import jobs as J
from edgepack_core.errors import EdgepackError, SchemaError, SignatureError
from edgepack_core.pipeline_spec import PipelineSpec
from edgepack_core.protocol.commands import Command
from edgepack_core.settings_doc import SettingsDocument, parse_document
from edgepack_core.signing import TrustStore

log = logging.getLogger("edgepack.agent.settings")


def handle(service: Any, command: Command) -> None:
    """Answer one ``apply-settings`` command: ``done`` with each key's result, ``rejected`` when
    the document is refused whole, ``failed`` when it could not be persisted (nothing changed)."""
    host = service.host
    body = command.body
    if host.operator_trust is None:
        service._reply(
            command, J.REJECTED, "settings are only taken signed: this device has no operator_keys in agent.yaml"
        )
        return
    try:
        document = parse_document(body.get("generation"), body.get("settings"))
    except SchemaError as err:
        service._reply(command, J.REJECTED, f"settings refused whole: {err}")
        return
    held: Held = host.held
    if document.generation <= held.generation:
        service._reply(
            command,
            J.REJECTED,
            f"settings generation {document.generation} is not newer than the "
            f"one this device holds ({held.generation}): refused (replayed or late)",
        )
        return
    results = decide(document, host.base_config, _unverifiable(host, document))
    if results.get("pipelines") == "applied":
        results["pipelines"] = _pipelines_result(host, document.pipelines or ())
    fresh = held.after(document, results)
    try:
        save_held(host.config.store, fresh)
    except (OSError, EdgepackError) as err:
        service._reply(command, J.FAILED, f"settings not applied: they could not be persisted ({err})")
        return
    apply_live(service, fresh)
    refused = sorted(key for key, result in results.items() if result != "applied")
    log.info(
        "settings generation %d applied (%d key(s); refused: %s)",
        document.generation,
        len(results),
        ", ".join(refused) or "none",
    )
    service.reporter.publish_state()
    service._reply(
        command,
        J.DONE,
        f"settings generation {document.generation}: {len(results) - len(refused)} applied, {len(refused)} refused",
        generation=document.generation,
        results=results,
    )


def _unverifiable(host: Any, document: SettingsDocument) -> tuple[str, ...]:
    """The models this device serves whose manifest signature none of the document's release
    keys verifies (read from their verified directories; () when the document carries no trust)."""
    if not document.release_keys:
        return ()
    trust = TrustStore(document.release_keys)
    out = []
    for slot in host.models.slots:
        model = slot.service.model
        if model is None:
            continue
        try:
            trust.verify((model.root / "manifest.json").read_bytes(), (model.root / "manifest.sig").read_bytes())
        except (SignatureError, OSError):
            out.append(f"{model.manifest.name} {model.manifest.version}")
    return tuple(out)


def _pipelines_result(host: Any, pipelines: tuple[PipelineSpec, ...]) -> str:
    """``applied``, or ``refused: ...`` for pipelines the models installed now cannot run (each
    checked as a start would check it: docs/agent.md, "Pipelines"); the running ones then stay.
    ``pipelines``: the document's, as parsed with it (the values then started)."""
    from device_agent.errors import PipelineRefused
    from device_agent.pipelines.checks import check_models
    from device_agent.pipelines.contracts import installed_contracts

    try:
        contracts = installed_contracts(host.config)
        for index, spec in enumerate(pipelines):
            check_models(spec, contracts, where=f"pipelines[{index}]")
    except (PipelineRefused, SchemaError) as err:
        return f"refused: {err}"
    return "applied"


def apply_live(service: Any, held: Held) -> None:
    """Make ``held`` the device's settings now: every part that reads them is told."""
    host = service.host
    values = held.applied()
    config = overlay(host.base_config, values, held.pipelines)
    pipelines_changed = config.pipelines != host.config.pipelines
    host.held = held
    host.config = config
    host.use_keys(held)
    logging.getLogger().setLevel(getattr(logging, config.log_level.upper()))
    service.window = config.updates.health_window_s
    service.health = config.updates.health_policy()
    service.bounds = service._bounds(config)
    root_model = next((slot.name for slot in host.models.slots if slot.store is host.store), None)
    host.store.limits = limits_for(config, values, root_model)
    for slot in host.models.slots:
        slot.store.limits = limits_for(config, values, slot.name)
    if config.mqtt is not None:
        service.reporter.set_interval(config.mqtt.telemetry_interval)
        _use_groups(service, list(config.mqtt.groups))
    if pipelines_changed:
        host.restart_pipelines()


def _use_groups(service: Any, groups: list[str]) -> None:
    """Subscribe to the command topics of groups joined, drop those of groups left."""
    old = set(service.groups)
    for group in sorted(old - set(groups)):
        service.transport.unsubscribe(service.topics.group_cmd(group))
    for group in groups:
        if group not in old:
            service.transport.subscribe(service.topics.group_cmd(group), 1, service._on_command)
    service.groups = list(groups)
    service.reporter.groups[:] = groups  # in place: the last will made at the next connection names them
