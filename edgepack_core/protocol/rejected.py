"""A version a device refused to keep, as the state message carries it: its own small module so
the agent's store (``device_agent/updates/rejected.py``) keeps its ledger without loading every
message parser (:mod:`.messages`, which re-exports these). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_REJECTED = 32  # the state schema's maxItems for rejected
REJECTION_STAGES = ("admission", "smoke_test", "health_window")


@dataclass(frozen=True)
class RejectedRef:
    """A version the device refused to keep (``device_agent/updates/rejected.py`` keeps them as
    this type): the fleet server marks (device, ``sha256``) rejected and never re-targets it
    automatically. ``sha256`` is the artifact's; ``stage`` one of :data:`REJECTION_STAGES`;
    ``reason`` cut to :data:`~edgepack_core.protocol.messages.MAX_STATE_REASON`."""

    name: str
    version: str
    sha256: str
    stage: str
    reason: str
    ts: float

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256, "stage": self.stage,
                "reason": self.reason, "ts": self.ts}
