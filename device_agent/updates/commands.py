"""Remote commands on the device: the schema and the parser live in the shared protocol
package (:mod:`edgepack_core.protocol.commands`), so the host builds exactly what the agent
parses. This module re-exports them under their old names for the agent's code, and holds the
device's own pure check of what a rollback is bound to (:func:`rollback_refusal`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgepack_core.protocol.commands import (
    COMMAND_TYPES,
    MAX_COMMAND_BYTES,
    MAX_LIFETIME_S,
    Command,
    Rejection,
    parse_command,
)
from edgepack_core.protocol.payloads import CMD_SCHEMA_ID, load_schema

COMMAND_SCHEMA_ID = CMD_SCHEMA_ID
COMMAND_SCHEMA: dict[str, Any] = load_schema("cmd")

__all__ = [
    "COMMAND_SCHEMA", "COMMAND_SCHEMA_ID", "COMMAND_TYPES", "MAX_COMMAND_BYTES", "MAX_LIFETIME_S", "Command",
    "Rejection", "parse_command", "rollback_refusal",
]


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
