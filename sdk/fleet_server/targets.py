"""Desired state as pure decisions: targets, a device's effective target, and what to do about it.

The server keeps, for the fleet, each group and each device, a :class:`Target`: model name ->
artifact sha256 (or :data:`ABSENT`), plus a hold flag. What a device should run is its
:func:`effective_target`:

- **models: device beats group beats fleet.** A device's own entry for a model wins; else
  the entries of the groups it is enrolled in; else the fleet's.
- **A device in several groups.** Groups that agree on a model (the same artifact) give it;
  groups that name different artifacts for the same model are a *conflict*: nothing is sent
  for that model and the decision says which groups disagree, until the operator sets a
  device target (which wins) or aligns the groups. Never a silent pick by group name.
- **hold: the most cautious scope wins.** A device is held when its own target, any of its
  groups' or the fleet's holds it (a fleet hold is a freeze); a hold never changes a target,
  it only stops commands.

:func:`reconcile` compares the effective target with what the device last reported and the
last command the server sent it for the model, and says what the reconciler does now:
``converged`` (on target: never a failure, whatever the device's job history), ``send`` (a
signed deploy of one model's artifact; a downgrade is allowed because the operator chose the
target) or ``wait`` with the reason the difference persists. No I/O, no clock: the driver
(:mod:`.driver`) reads the inputs from the database on every round, so a restart, a restore or
another server resumes from targets and reported states alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final, Literal

from sdk.fleet_server.rollouts import ALREADY_ACTIVE

ABSENT: Final = "absent"
"""A model that must not be on the device (in place of an artifact sha256)."""

FLEET: Final = "fleet"
GROUP: Final = "group"
DEVICE: Final = "device"
SCOPES = (FLEET, GROUP, DEVICE)

MAX_ATTEMPTS = 5
"""Commands for one (device, model, artifact, target revision) before the reconciler stops: a
device that takes the deploy but keeps reporting something else is not sent it forever."""


def _frozen(models: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(sorted(models.items())))


@dataclass(frozen=True)
class Target:
    """One scope's desired state: model name -> artifact sha256 or :data:`ABSENT`; ``hold``
    stops commands to the devices it covers. ``revisions``: model -> how many times the
    operator set that entry (a new revision is a new operator decision: it may retry an
    artifact the device rejected under the previous one)."""

    models: Mapping[str, str] = field(default_factory=dict)
    hold: bool = False
    revisions: Mapping[str, int] = field(default_factory=dict)
    set_at: Mapping[str, float] = field(default_factory=dict)  # model -> when the operator set it (server clock)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", _frozen(self.models))
        object.__setattr__(self, "revisions", MappingProxyType(dict(self.revisions)))
        object.__setattr__(self, "set_at", MappingProxyType(dict(self.set_at)))


NO_TARGET = Target()


@dataclass(frozen=True)
class Wanted:
    """What one model of a device should be, and which scope said so (``fleet``,
    ``group:kitchen``, ``group:a+b`` when groups agree, ``device``) at which revision."""

    artifact: str
    source: str
    revision: int = 1
    set_at: float = 0.0


@dataclass(frozen=True)
class Effective:
    """A device's effective target: wanted models, the models whose groups disagree
    (model -> ((group, artifact), ...)), and the scopes that hold it."""

    models: Mapping[str, Wanted]
    conflicts: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    held_by: tuple[str, ...] = ()

    @property
    def hold(self) -> bool:
        return bool(self.held_by)


def _from_groups(groups: Mapping[str, Target], model: str) -> Wanted | tuple[tuple[str, str], ...] | None:
    """The groups' word on ``model``: agreed, a conflict (the disagreeing pairs), or silence."""
    named = sorted((name, target.models[model]) for name, target in groups.items() if model in target.models)
    if not named:
        return None
    artifacts = {artifact for _name, artifact in named}
    if len(artifacts) > 1:
        return tuple(named)
    revision = max(groups[name].revisions.get(model, 1) for name, _a in named)
    set_at = max(groups[name].set_at.get(model, 0.0) for name, _a in named)
    return Wanted(named[0][1], "group:" + "+".join(name for name, _a in named), revision, set_at)


def effective_target(fleet: Target, groups: Mapping[str, Target], device: Target) -> Effective:
    """The device's effective target (see the module docstring for the rules). ``groups``: the
    targets of the groups the device is enrolled in (groups without a target left out). Pure."""
    names = set(fleet.models) | set(device.models)
    for target in groups.values():
        names |= set(target.models)
    wanted: dict[str, Wanted] = {}
    conflicts: dict[str, tuple[tuple[str, str], ...]] = {}
    for model in sorted(names):
        if model in device.models:
            wanted[model] = Wanted(device.models[model], DEVICE, device.revisions.get(model, 1),
                                   device.set_at.get(model, 0.0))
            continue
        said = _from_groups(groups, model)
        if isinstance(said, Wanted):
            wanted[model] = said
        elif said is not None:
            conflicts[model] = said
        elif model in fleet.models:
            wanted[model] = Wanted(fleet.models[model], FLEET, fleet.revisions.get(model, 1),
                                   fleet.set_at.get(model, 0.0))
    held_by = tuple([DEVICE] * device.hold + [f"group:{name}" for name, t in sorted(groups.items()) if t.hold]
                    + [FLEET] * fleet.hold)
    return Effective(MappingProxyType(wanted), MappingProxyType(conflicts), held_by)


# --------------------------------------------------------------------------- reported state


@dataclass(frozen=True)
class Running:
    """A model a device reported: its version and the model file's sha256 (the inner hash
    the agent reports, not the artifact's)."""

    version: str | None
    model_sha256: str | None = None


@dataclass(frozen=True)
class Rejection:
    """An artifact the device reported it refused to keep (its state's ``rejected`` list):
    the stage (admission, smoke_test, health_window), why, and when the server first heard it."""

    stage: str
    reason: str
    heard_at: float


@dataclass(frozen=True)
class Reported:
    """What the server last heard from the device. ``rejected``: artifact sha256 -> the
    device's own record of refusing it."""

    online: bool
    models: Mapping[str, Running] = field(default_factory=dict)
    status_reason: str = ""
    heard_at: float | None = None  # when the server heard the state (None: never)
    rejected: Mapping[str, Rejection] = field(default_factory=dict)
    several: bool = False  # the device reported more than one model: its agent holds several
    lists_models: bool = False  # its state lists its models: an agent that takes ``remove`` commands


@dataclass(frozen=True)
class ArtifactInfo:
    """What the server knows of an artifact (from its signed manifest)."""

    sha256: str
    name: str
    version: str
    model_sha256: str | None = None
    bad: str | None = None  # the operator's reason when the release is marked bad fleet-wide (never sent then)


def marked_bad(sha256: str, reason: str) -> str:
    """Why a release marked bad is not sent (the reconciler's wait, a refusal, a paused rollout)."""
    return f"artifact {sha256[:12]} marked bad: {reason}"


@dataclass(frozen=True)
class LastCommand:
    """The newest command the server sent the device for one model, with the job's newest
    state (``sent`` before any event)."""

    id: str
    artifact: str
    source: str
    revision: int
    attempt: int
    sent_at: float
    state: str = "sent"
    final: bool = False
    reason: str = ""
    final_at: float | None = None  # when the server received the final event


def matches(running: Running | None, artifact: ArtifactInfo) -> bool:
    """Whether a reported model is ``artifact``: same version, and the same model file when
    both sides know its hash."""
    if running is None or running.version != artifact.version:
        return False
    return running.model_sha256 is None or artifact.model_sha256 is None or \
        running.model_sha256 == artifact.model_sha256


def differences(effective: Effective, reported: Reported,
                artifacts: Mapping[str, ArtifactInfo]) -> dict[str, str]:
    """Model -> what differs, for every model not on target (conflicted models included)."""
    out: dict[str, str] = {}
    for model, wanted in effective.models.items():
        running = reported.models.get(model)
        if wanted.artifact == ABSENT:
            if running is not None:
                out[model] = f"runs {running.version}, target absent"
            continue
        info = artifacts.get(wanted.artifact)
        if info is not None and matches(running, info):
            continue
        have = "nothing" if running is None else f"{running.version}"
        out[model] = f"runs {have}, target {info.version if info else wanted.artifact[:12]}"
    for model, pairs in effective.conflicts.items():
        out[model] = "groups disagree: " + ", ".join(f"{g}={a[:12]}" for g, a in pairs)
    return out


# --------------------------------------------------------------------------- the decision

DecisionKind = Literal["converged", "send", "wait"]


@dataclass(frozen=True)
class Decision:
    """What the reconciler does for one device now. ``send``: deploy ``artifact`` as
    ``model`` with command ``command_id`` (attempt ``attempt`` of that target revision)."""

    kind: DecisionKind
    reason: str = ""
    model: str = ""
    artifact: str = ""
    source: str = ""
    revision: int = 0
    attempt: int = 0
    command_id: str = ""
    differences: Mapping[str, str] = field(default_factory=dict)


def target_command_id(device: str, model: str, wanted: Wanted, attempt: int) -> str:
    """The id of the reconciler's deploy: derived from (device, model, artifact, source,
    revision, attempt), never random, so a restarted server or another one computes the same
    id and records it once (the device's replay ledger refuses a second copy anyway)."""
    key = f"{device}|{model}|{wanted.artifact}|{wanted.source}|{wanted.revision}|{attempt}"
    return "tg-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _job_decision(device: str, model: str, wanted: Wanted, last: LastCommand | None, reported: Reported,
                  now: float, command_ttl_s: float) -> Decision:
    """The step for one model that differs, given the last command for it (pure)."""
    same = last is not None and (last.artifact, last.source, last.revision) == \
        (wanted.artifact, wanted.source, wanted.revision)
    attempt = last.attempt + 1 if same and last is not None else 1
    succeeded = "done" if wanted.artifact == ABSENT else "active"  # a remove ends done, a deploy active
    if same and last is not None:
        if not last.final and now - last.sent_at < command_ttl_s:
            return Decision("wait", f"command {last.id} in flight ({last.state})", model=model,
                            artifact=wanted.artifact)
        if last.final and last.state != succeeded and ALREADY_ACTIVE not in last.reason:
            what = f"the remove of {model} failed" if wanted.artifact == ABSENT else \
                f"artifact {wanted.artifact[:12]} rejected"
            return Decision("wait", f"{what} on this device ({last.state}: "
                                    f"{last.reason or 'no reason given'}); set the target again to retry",
                            model=model, artifact=wanted.artifact)
        if last.final and (reported.heard_at is None or last.final_at is None or reported.heard_at <= last.final_at):
            return Decision("wait", f"command {last.id} ended {last.state}; waiting for the device's state",
                            model=model, artifact=wanted.artifact)
        if attempt > MAX_ATTEMPTS:
            return Decision("wait", f"{MAX_ATTEMPTS} commands sent for this target; set it again to retry",
                            model=model, artifact=wanted.artifact)
    step = "remove" if wanted.artifact == ABSENT else f"deploy {wanted.artifact[:12]}"
    return Decision("send", f"{model}: {'resend ' if attempt > 1 else ''}{step}",
                    model=model, artifact=wanted.artifact, source=wanted.source, revision=wanted.revision,
                    attempt=attempt, command_id=target_command_id(device, model, wanted, attempt))


def device_rejected(wanted: Wanted, reported: Reported) -> str:
    """Why the device's own rejection of the wanted artifact stops the reconciler, or "".
    A rejection is never overridden by a fleet or group target: only a device target set after
    the server heard of the rejection is the operator's explicit retry (pure)."""
    rejection = reported.rejected.get(wanted.artifact)
    if rejection is None or (wanted.source == DEVICE and wanted.set_at > rejection.heard_at):
        return ""
    return (f"artifact {wanted.artifact[:12]} rejected by this device ({rejection.stage}: "
            f"{rejection.reason or 'no reason given'}); set a device target to retry")


def _blocked(effective: Effective, reported: Reported, diff: Mapping[str, str], busy: str) -> str:
    """Why no command may go to the device at all now, or "" (pure)."""
    if effective.hold:
        return f"held by {', '.join(effective.held_by)}"
    if busy:
        return f"in {busy}"
    if not reported.online:
        return f"offline{': ' + reported.status_reason if reported.status_reason else ''}"
    present = [m for m, w in effective.models.items() if w.artifact != ABSENT]
    if len(present) > 1 and not reported.several:
        return f"the target names {len(present)} models ({', '.join(present)}); this device runs one"
    conflicted = sorted(set(diff) & set(effective.conflicts))
    if conflicted and len(conflicted) == len(diff):
        return f"{conflicted[0]}: {diff[conflicted[0]]}; set a device target to choose"
    return ""


def reconcile(device: str, effective: Effective, reported: Reported, artifacts: Mapping[str, ArtifactInfo],
              last: Mapping[str, LastCommand], *, now: float, busy: str = "",
              command_ttl_s: float = 24 * 3600.0) -> Decision:
    """What the reconciler does for ``device`` now (see the module docstring). Pure.

    ``last``: model -> the newest command sent for it; ``busy``: a rollout the device is in
    ("rollout ro-..."; the reconciler waits for it). The device's agent runs one model, so at
    most one model is acted on at a time (the first that differs, by name)."""
    diff = differences(effective, reported, artifacts)
    if not diff:
        return Decision("converged", "on target")
    frozen = MappingProxyType(diff)
    blocked = _blocked(effective, reported, diff, busy)
    if blocked:
        return Decision("wait", blocked, differences=frozen)
    reasons: list[str] = []
    for model in sorted(diff):
        if model in effective.conflicts:
            reasons.append(f"{model}: {diff[model]}; set a device target to choose")
            continue
        wanted = effective.models[model]
        if wanted.artifact == ABSENT and not reported.lists_models:
            reasons.append(f"{model}: removing a model is not supported by the device's agent")
            continue
        if wanted.artifact != ABSENT and wanted.artifact not in artifacts:
            reasons.append(f"{model}: artifact {wanted.artifact[:12]} is not in the server's store")
            continue
        bad = artifacts[wanted.artifact].bad if wanted.artifact != ABSENT else None
        if bad is not None:
            reasons.append(f"{model}: {marked_bad(wanted.artifact, bad)}")
            continue
        refused = device_rejected(wanted, reported)
        if refused:
            reasons.append(f"{model}: {refused}")
            continue
        step = _job_decision(device, model, wanted, last.get(model), reported, now, command_ttl_s)
        if step.kind == "send":
            return replace(step, differences=frozen)
        reasons.append(f"{model}: {step.reason}")
    return Decision("wait", "; ".join(reasons), differences=frozen)
