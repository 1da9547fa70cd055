"""Roles of the fleet server's users and what each may do: one pure table, no I/O.

Four roles, each allowed everything the ones before it are: ``viewer`` (reads), ``operator``
(rollouts, targets, holds, device actions), ``release`` (a release manager: uploads artifacts and
marks releases bad), ``admin`` (tokens, keys, enrollment, server settings). Every API route is
guarded by an action (``rollout.create``; reads are ``read``); :data:`PERMISSIONS` maps each action
to the least role allowed. An action the table does not know needs ``admin``: a route added
without a line here is closed, not open (a test checks every registered route is listed).

Why one linear order and not sets of grants: the least role an action needs is then one word,
which the 403 answer names, and which the docs table and the dashboard show as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("viewer", "operator", "release", "admin")
"""Least to most allowed."""
DEFAULT_ROLE = "admin"
"""A token file line without a role (the file's tokens were all-powerful before roles existed)."""
READ = "read"
"""The action of every read route."""

PERMISSIONS: dict[str, str] = {
    READ: "viewer",
    # operators run rollouts, targets, holds and device actions
    "rollout.create": "operator",
    "rollout.pause": "operator",
    "rollout.resume": "operator",
    "rollout.abort": "operator",
    "target.set": "operator",
    "device.action": "operator",
    "device.groups": "operator",
    "logs.fetch": "operator",
    # release managers upload artifacts and mark releases bad (or good again)
    "artifact.upload": "release",
    "artifact.bad": "release",
    "artifact.good": "release",
    # admins manage tokens, keys, enrollment, device identity and the server's settings
    "token.create": "admin",
    "token.list": "admin",
    "token.revoke": "admin",
    "device.enroll": "admin",
    "device.enroll_identity": "admin",
    "device.decommission": "admin",
    "device.revoke": "admin",
    "device.rotate": "admin",
    "settings.set": "admin",
    "keys.*": "admin",
    "alerts.*": "admin",
}
"""Action -> the least role allowed. ``family.*`` covers every ``family.`` action not listed itself."""


@dataclass(frozen=True)
class Identity:
    """Who sent a request: the token's name (what the audit records), its role, where it is
    held (``file``: the token file; ``database``: made with ``fleet token create``)."""

    name: str
    role: str
    source: str


def is_role(value: object) -> bool:
    return isinstance(value, str) and value in ROLES


def known(action: str) -> bool:
    """Whether the table lists ``action`` (itself or by its ``family.*`` line)."""
    return action in PERMISSIONS or f"{action.partition('.')[0]}.*" in PERMISSIONS


def needed_role(action: str) -> str:
    """The least role allowed ``action``; ``admin`` for an action the table does not know."""
    role = PERMISSIONS.get(action) or PERMISSIONS.get(f"{action.partition('.')[0]}.*")
    return role or "admin"


def allows(role: str, action: str) -> bool:
    """Whether ``role`` may do ``action``; an unknown role may do nothing."""
    return role in ROLES and ROLES.index(role) >= ROLES.index(needed_role(action))


def allowed_actions(role: str) -> list[str]:
    """Every listed action ``role`` may do (the dashboard hides the buttons of the others)."""
    return sorted(action for action in PERMISSIONS if allows(role, action))


def _article(role: str) -> str:
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"


def refusal(action: str, identity: Identity) -> str:
    """The 403's one line: what the action needs and what the token is."""
    return f"{action} needs the {needed_role(action)} role; token {identity.name!r} is {_article(identity.role)}"
