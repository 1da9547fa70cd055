"""Admission of a verified artifact before anything is installed. Pure: manifests and the
command in, the first reason to refuse (or None) out.

The signature says who built a model; admission says whether *this device* should run it:

1. the artifact is what the command announced (name, version);
2. its name is one this device is bound to (agent.yaml ``updates.allowed_names``, default the
   name it runs), so a signed ``othermodel`` can never replace ``scale``;
3. versions compare only within a name: not older than, nor equal to, the newest version of
   that name the device knows, unless the (signed) command says ``force_downgrade``;
4. it is built for this device's target profile;
5. its I/O contract matches the active model's (what clients send and get back), unless the
   signed command says ``allow_contract_change``; the first difference is named.

A rollback installs nothing new; it is admitted only while the device still serves the model
it undoes (:func:`rollback_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgepack_core.errors import UsageError
from edgepack_core.manifest import Manifest
from edgepack_core.versions import Version


@dataclass(frozen=True)
class DevicePolicy:
    """What the device's configuration and store say about admissible models.

    ``allowed_names`` None means "the name the device runs now" (any name on an empty device).
    ``known_versions`` maps each model name to the newest version installed or run under it.
    """

    profile: str
    allowed_names: frozenset[str] | None = None
    known_versions: Mapping[str, str] = field(default_factory=dict)


def admit(new_manifest: Manifest, active_manifest: Manifest | None, command: Mapping[str, Any],
          device_policy: DevicePolicy) -> str | None:
    """The first reason to refuse ``new_manifest`` on this device, or None to admit it."""
    refused = refusal(new_manifest, active_manifest, command, device_policy)
    return None if refused is None else refused[1]


DEVICE_STATE_RULES = frozenset({"version"})
"""Rules whose refusal says something about this device, not the artifact: not "newer than what
the device holds" is no fault of the version, so it is not recorded as a rejected version
(``updates/rejected.py``)."""


def refusal(new_manifest: Manifest, active_manifest: Manifest | None, command: Mapping[str, Any],
            device_policy: DevicePolicy) -> tuple[str, str] | None:
    """The first rule that refuses ``new_manifest`` and its reason, or None. Pure."""
    rules = (("announced", _announced), ("name", _name_allowed), ("version", _version), ("profile", _profile),
             ("contract", _contract))
    for name, rule in rules:
        reason = rule(new_manifest, active_manifest, command, device_policy)
        if reason is not None:
            return name, reason
    return None


def _announced(new: Manifest, _active: Manifest | None, command: Mapping[str, Any], _policy: DevicePolicy) \
        -> str | None:
    name = command.get("name", new.name)
    if new.version != command.get("version") or name != new.name:
        return f"artifact is {new.name} {new.version}, the command announced {name} {command.get('version')}"
    return None


def _name_allowed(new: Manifest, active: Manifest | None, _command: Mapping[str, Any], policy: DevicePolicy) \
        -> str | None:
    allowed = policy.allowed_names
    if allowed is None:
        if active is None:
            return None
        allowed = frozenset({active.name})
    if new.name in allowed:
        return None
    return f"model name {new.name!r} is not allowed on this device (allowed: {', '.join(sorted(allowed))})"


def _version(new: Manifest, active: Manifest | None, command: Mapping[str, Any], policy: DevicePolicy) \
        -> str | None:
    known = dict(policy.known_versions)
    if active is not None:
        known.setdefault(active.name, active.version)
        if _newer(active.version, known[active.name]):
            known[active.name] = active.version
    installed = known.get(new.name)
    if installed is None or command.get("force_downgrade") is True:
        return None
    try:
        recorded = Version(installed)
    except UsageError:  # a garbled record must not let any version through, nor crash the job
        return f"the version recorded for {new.name} on this device ({installed!r}) is unreadable: refusing to compare"
    if Version(new.version) <= recorded:
        return (f"{new.name} {new.version} is not newer than {new.name} {installed} on this device "
                "(a signed command with force_downgrade overrides)")
    return None


def _newer(a: str, b: str) -> bool:
    """True when version ``a`` is newer than ``b``; a readable ``a`` beats an unreadable ``b``."""
    try:
        return Version(a) > Version(b)
    except UsageError:
        return _readable(a) and not _readable(b)


def _readable(version: str) -> bool:
    try:
        Version(version)
    except UsageError:
        return False
    return True


def _profile(new: Manifest, _active: Manifest | None, _command: Mapping[str, Any], policy: DevicePolicy) \
        -> str | None:
    if new.targets and policy.profile not in new.targets:
        return f"built for {', '.join(sorted(new.targets))}, not for this device's profile {policy.profile}"
    return None


def _contract(new: Manifest, active: Manifest | None, command: Mapping[str, Any], _policy: DevicePolicy) \
        -> str | None:
    if active is None or command.get("allow_contract_change") is True:
        return None
    difference = contract_difference(active.raw, new.raw)
    if difference is None:
        return None
    return f"I/O contract changes: {difference} (a signed command with allow_contract_change overrides)"


# --------------------------------------------------------------------------- the I/O contract


def _kind(spec: Any) -> str:
    return str(spec.get("kind")) if isinstance(spec, Mapping) else "none"


def _client_inputs(raw: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Inputs a client feeds (constant-role inputs are fed by the agent, not by clients)."""
    return {t["name"]: t for t in raw.get("inputs", []) if t.get("role") != "constant"}


def _dims_difference(where: str, old: Sequence[Any], new: Sequence[Any], *, relax_ok: bool) -> str | None:
    """Rank must match; a fixed dim must stay fixed at the same size. An input dim may become
    symbolic (``relax_ok``: it accepts more); an output dim may not (clients read it)."""
    if len(old) != len(new):
        return f"{where} has rank {len(new)}, was {len(old)} ({list(new)} vs {list(old)})"
    for axis, was in enumerate(old):
        now = new[axis]
        was_fixed, now_fixed = isinstance(was, int), isinstance(now, int)
        if was_fixed and now_fixed and was != now:
            return f"{where} dim {axis} is {now}, was {was}"
        if was_fixed and not now_fixed and not relax_ok:
            return f"{where} dim {axis} is symbolic {now!r}, was fixed {was}"
        if not was_fixed and now_fixed:
            return f"{where} dim {axis} is fixed {now}, was symbolic {was!r}"
    return None


def _tensors_difference(kind: str, old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]) \
        -> str | None:
    """``kind`` is "input" or "output": only an input's fixed dim may become symbolic."""
    for name in old:
        if name not in new:
            return f"{kind} {name!r} is gone (now: {', '.join(new) or 'none'})"
    for name in new:
        if name not in old:
            return f"{kind} {name!r} is new (was: {', '.join(old) or 'none'})"
    for name, spec in old.items():
        if new[name]["dtype"] != spec["dtype"]:
            return f"{kind} {name!r} dtype is {new[name]['dtype']}, was {spec['dtype']}"
        difference = _dims_difference(f"{kind} {name!r}", spec["shape"], new[name]["shape"],
                                      relax_ok=kind == "input")
        if difference is not None:
            return difference
    return None


def contract_difference(active: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """The first difference between two manifests' I/O contracts, or None. Pure.

    Compared in the order a client meets them: preprocessing kind, inputs (names, dtypes,
    fixed dims), outputs (names, dtypes, dims), postprocessing kind.
    """
    old_pre, new_pre = _kind(active.get("preprocess")), _kind(new.get("preprocess"))
    if old_pre != new_pre:
        return f"preprocessing kind is {new_pre}, was {old_pre}"
    difference = _tensors_difference("input", _client_inputs(active), _client_inputs(new))
    if difference is not None:
        return difference
    outputs_old = {t["name"]: t for t in active.get("outputs", [])}
    outputs_new = {t["name"]: t for t in new.get("outputs", [])}
    difference = _tensors_difference("output", outputs_old, outputs_new)
    if difference is not None:
        return difference
    old_post, new_post = _kind(active.get("postprocess")), _kind(new.get("postprocess"))
    if old_post != new_post:
        return f"postprocessing kind is {new_post}, was {old_post}"
    return None


def policy_names(names: Iterable[str] | None) -> frozenset[str] | None:
    """agent.yaml ``updates.allowed_names`` as a policy value (absent: bound to the running name)."""
    return None if names is None else frozenset(names)


def rollback_refusal(from_version: Mapping[str, str], serving: tuple[str, str] | None) -> str:
    """Why a rollback of ``from_version`` (``{"name", "version"}``, required by the schema) must
    not run on a device serving ``serving`` (name, version; None: nothing), or "" when it may.
    Binds a rollback to what it undoes: one delivered late, after a newer deploy, must not
    revert that newer model. Pure."""
    wanted = f"{from_version['name']} {from_version['version']}"
    if serving is None:
        return f"the device has moved on: this rollback is from {wanted}, the device serves no model"
    if (from_version["name"], from_version["version"]) != serving:
        return f"the device has moved on: this rollback is from {wanted}, the device serves {serving[0]} {serving[1]}"
    return ""
