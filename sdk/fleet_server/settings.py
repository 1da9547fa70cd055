"""Desired agent settings and fleet keys, pure: each device's effective document and what the
reconciler does about it (docs/fleet-server.md, "Settings and keys").

The operator sets dotted agent.yaml keys (:data:`edgepack_core.settings_doc.SETTING_KEYS`) per
fleet, group or device; the device's value beats its groups', its groups' beat the fleet's, and
groups that disagree on a key leave it to the fleet (the conflict is shown). Release and operator
public keys are the fleet's (``edgepack fleet keys``): once a key of a kind was added, every
document carries the kind's keys in use as ``trust`` / ``operator_keys``.

A device's document has a generation that only rises: a new one is made when the document
changes (its digest) and is sent, signed, as ``apply-settings``; the device reports the
generation it holds in its state, and is converged when that reaches the newest sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgepack_core.settings_doc import digest
from edgepack_core.signing import OPERATOR, RELEASE, SigningKey

FLEET, GROUP, DEVICE = "fleet", "group", "device"
SCOPES = (FLEET, GROUP, DEVICE)
KEY_SETTING = {RELEASE: "trust", OPERATOR: "operator_keys"}


@dataclass(frozen=True)
class FleetKey:
    """A public key the fleet's devices are told to hold."""

    key_id: str
    kind: str
    pem: str
    added_at: float
    retired_at: float | None = None

    @property
    def in_use(self) -> bool:
        return self.retired_at is None


@dataclass(frozen=True)
class SettingsScopes:
    """Every settings entry: the fleet's, each group's, each device's (key -> JSON value)."""

    fleet: Mapping[str, Any] = field(default_factory=dict)
    groups: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    devices: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Effective:
    """A device's document (key -> value), where each key came from, and the group conflicts."""

    settings: Mapping[str, Any]
    sources: Mapping[str, str]
    conflicts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return digest(self.settings)


@dataclass(frozen=True)
class Sent:
    """The newest document the server signed for a device."""

    generation: int
    digest: str
    command_id: str
    created_at: float


@dataclass(frozen=True)
class Decision:
    """``converged``, ``send`` (``generation``: the document's) or ``wait`` (``reason``)."""

    kind: str
    generation: int = 0
    reason: str = ""


def effective(scopes: SettingsScopes, keys: Sequence[FleetKey], device: str, groups: Sequence[str]) -> Effective:
    """The document ``device`` (in ``groups``) should hold. Pure."""
    settings: dict[str, Any] = dict(scopes.fleet)
    sources = {key: FLEET for key in scopes.fleet}
    by_key: dict[str, dict[str, Any]] = {}
    for group in sorted(groups):
        for key, value in scopes.groups.get(group, {}).items():
            by_key.setdefault(key, {})[group] = value
    conflicts: dict[str, tuple[str, ...]] = {}
    for key, values in by_key.items():
        distinct = {_canonical(v) for v in values.values()}
        if len(distinct) > 1:
            conflicts[key] = tuple(sorted(values))
            continue
        settings[key] = next(iter(values.values()))
        sources[key] = f"group {','.join(sorted(values))}"
    for key, value in scopes.devices.get(device, {}).items():
        settings[key] = value
        sources[key] = DEVICE
        conflicts.pop(key, None)
    for kind, key in KEY_SETTING.items():
        used = sorted((k for k in keys if k.kind == kind and k.in_use), key=lambda k: k.key_id)
        if any(k.kind == kind for k in keys):
            settings[key] = [k.pem for k in used]
            sources[key] = "fleet keys"
    return Effective(settings, sources, conflicts)


def _canonical(value: Any) -> str:
    return digest({"v": value})


def decide(
    document: Effective, sent: Sent | None, reported: int | None, *, online: bool, now: float, retry_s: float
) -> Decision:
    """What the reconciler does for one device. Pure.

    ``reported``: the generation the device's newest state holds (None: it reports none, an
    agent before remote settings). Nothing to say and nothing said: converged. A changed document
    to an online device: send the next generation (above both what was sent and what the device
    holds, so a server restored from an older backup still goes forward). The newest sent held:
    converged. Sent and not held: wait, and send again (a new generation) after ``retry_s``."""
    if sent is None and not document.settings:
        return Decision("converged")
    held = reported or 0
    next_generation = max(sent.generation if sent else 0, held) + 1
    if sent is None or sent.digest != document.digest:
        if not online:
            return Decision("wait", reason="the device is offline: its settings are sent when it is back")
        return Decision("send", next_generation)
    if held >= sent.generation:
        return Decision("converged", sent.generation)
    if reported is None:
        return Decision("wait", reason="the device does not report settings (an agent before remote settings?)")
    if online and now - sent.created_at >= retry_s:
        return Decision("send", next_generation)
    return Decision(
        "wait", sent.generation, f"generation {sent.generation} sent, the device holds {held}: waiting for its answer"
    )


def signer_for(keys: Sequence[SigningKey], held: Sequence[str]) -> SigningKey:
    """The operator key to sign a device's command with: the first of the server's keys the
    device reports holding (a rotation: devices that took the new key get it, the others the old
    one); the first key for a device that reported none. Pure."""
    held_ids = set(held)
    return next((key for key in keys if key.key_id in held_ids), keys[0])


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line as (key, JSON value), typed by the key's schema: a list
    key takes comma-separated items (empty: an empty list), a number key a number; the value is
    then checked by the server. Pure; :class:`ValueError` naming what to fix."""
    from edgepack_core.settings_doc import schema_of

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{text!r} is not KEY=VALUE")
    schema = schema_of(key) or {}
    kind = schema.get("type")
    if kind == "array":
        return key, [item.strip() for item in raw.split(",") if item.strip()]
    if kind in ("number", "integer"):
        try:
            number = float(raw) if kind == "number" else int(raw)
        except ValueError as err:
            raise ValueError(f"{key} takes a number, not {raw!r}") from err
        return key, number
    return key, raw
