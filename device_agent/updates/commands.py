"""Remote commands on the device: the schema and the parser live in the shared protocol
package (:mod:`edgepack_core.protocol.commands`), so the host builds exactly what the agent
parses. This module re-exports them under their old names for the agent's code."""

from __future__ import annotations

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
    "Rejection", "parse_command",
]
