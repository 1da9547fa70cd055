"""Which of two retained states of one device is the newer. Pure.

A device's birth ("online") and last will ("offline") arrive in any order: the broker publishes
a will when it notices the connection is gone (up to keepalive x 1.5 later), a server that was
away hears the retained one at its next subscribe, and an old connection's will can be published
after the device has reconnected. Clocks do not settle it either (a Raspberry Pi has no RTC).
So agents mark each state with their connection (:class:`~edgepack_core.protocol.messages.SessionMark`):
within one epoch a later connection wins, and within one connection offline (the will, a clean
stop) follows online. States without a mark, or from another epoch (a device whose counter
file was lost), are ordered by when the server heard them, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgepack_core.protocol.messages import SessionMark


@dataclass(frozen=True)
class HeardState:
    """What ordering needs of a state: its connection mark, status and when it was heard."""

    session: SessionMark | None
    status: str
    heard: float


def _rank(status: str) -> int:
    return 1 if status == "offline" else 0


def supersedes(new: HeardState, old: HeardState) -> bool:
    """Whether ``new`` replaces ``old`` as the device's state."""
    a, b = new.session, old.session
    if a is None or b is None or a.epoch != b.epoch:
        return new.heard >= old.heard
    mine, theirs = (a.n, _rank(new.status)), (b.n, _rank(old.status))
    return mine > theirs if mine != theirs else new.heard >= old.heard

