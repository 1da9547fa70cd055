"""Topic names of the Edgepack MQTT protocol v1, built and parsed in one place.

Why a module of its own: device ids and group names end up inside topic names and, on the
broker, inside ACL patterns (``%u`` is the device id). A name holding ``+``, ``#`` or ``/``
would let one device subscribe to or publish on another's topics, so every name is checked
here before it can reach a topic string. Everything is pure: no I/O, no paho.

    {root}/dev/{d}/state        retained birth / last will
    {root}/dev/{d}/telemetry    periodic metrics
    {root}/dev/{d}/cmd          commands to one device
    {root}/grp/{g}/cmd          commands to a group
    {root}/dev/{d}/job          job progress and results
    {root}/dev/{d}/xfer/...     chunked artifact transfer
    {root}/dev/{d}/logs         log records a fetch-logs command asked for, in chunks
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from edgepack_core.errors import InvalidNameError
from edgepack_core.protocol.ids import MAX_ID_LENGTH, is_valid_id, validate_id

DEFAULT_ROOT = "edgepack/v1"
MAX_NAME_LENGTH = MAX_ID_LENGTH

_ROOT_LEVEL = re.compile(r"[A-Za-z0-9._-]+")

DeviceTopicKind = Literal["state", "telemetry", "cmd", "job", "xfer", "events", "logs"]
TopicKind = Literal["state", "telemetry", "cmd", "job", "xfer", "events", "logs", "group_cmd"]
_DEVICE_KINDS: tuple[DeviceTopicKind, ...] = ("state", "telemetry", "cmd", "job", "events", "logs")


def _check_name(field: str, value: object) -> str:
    return validate_id(value, field)


def validate_device_id(device_id: object) -> str:
    """Return ``device_id`` if it is safe as one topic level; raise :class:`InvalidNameError`."""
    return validate_id(device_id, "device_id")


def validate_group(group: object) -> str:
    """Return ``group`` if it is safe as one topic level; raise :class:`InvalidNameError`."""
    return validate_id(group, "group")


def validate_root(root: object) -> str:
    """Return a topic root such as ``edgepack/v1``: levels of safe characters, no wildcards,
    no empty level, no leading ``$`` (reserved for broker topics)."""
    if not isinstance(root, str) or not root:
        raise InvalidNameError("topic_root", str(root), "must be a non-empty string")
    for level in root.split("/"):
        if not _ROOT_LEVEL.fullmatch(level):
            raise InvalidNameError(
                "topic_root", root, "must be '/'-separated non-empty levels of letters, digits, '.', '_' and '-'"
            )
    return root


@dataclass(frozen=True)
class ParsedTopic:
    """What an incoming topic name means. ``device`` is set for ``dev/`` topics, ``group`` for
    ``grp/`` topics; ``rest`` holds the levels after ``xfer`` (empty for the others)."""

    kind: TopicKind
    device: str | None = None
    group: str | None = None
    rest: tuple[str, ...] = ()


class Topics:
    """Builds and parses the v1 topic names under one root (``edgepack/v1`` by default)."""

    def __init__(self, root: str = DEFAULT_ROOT) -> None:
        self.root = validate_root(root)

    # ------------------------------------------------------------------ per device

    def state(self, device_id: str) -> str:
        return f"{self.root}/dev/{validate_device_id(device_id)}/state"

    def telemetry(self, device_id: str) -> str:
        return f"{self.root}/dev/{validate_device_id(device_id)}/telemetry"

    def cmd(self, device_id: str) -> str:
        return f"{self.root}/dev/{validate_device_id(device_id)}/cmd"

    def job(self, device_id: str) -> str:
        return f"{self.root}/dev/{validate_device_id(device_id)}/job"

    def events(self, device_id: str) -> str:
        """Where a device's pipelines publish their events (QoS 1, through the outbox)."""
        return f"{self.root}/dev/{validate_device_id(device_id)}/events"

    def logs(self, device_id: str) -> str:
        return f"{self.root}/dev/{validate_device_id(device_id)}/logs"

    def xfer(self, device_id: str, *levels: str) -> str:
        """``{root}/dev/{d}/xfer/<levels...>``; each level is checked like a name (no wildcards)."""
        parts = [_check_name("xfer", level) for level in levels]
        return "/".join([f"{self.root}/dev/{validate_device_id(device_id)}/xfer", *parts])

    def xfer_filter(self, device_id: str) -> str:
        """Subscription filter for everything under one device's ``xfer/``."""
        return f"{self.root}/dev/{validate_device_id(device_id)}/xfer/#"

    # ------------------------------------------------------------------ groups

    def group_cmd(self, group: str) -> str:
        return f"{self.root}/grp/{validate_group(group)}/cmd"

    # ------------------------------------------------------------------ fleet-wide filters

    def all_of(self, kind: DeviceTopicKind) -> str:
        """Filter matching one kind of topic of every device, e.g. ``edgepack/v1/dev/+/state``."""
        if kind == "xfer":
            return f"{self.root}/dev/+/xfer/#"
        if kind not in _DEVICE_KINDS:
            raise InvalidNameError("kind", str(kind), f"is not one of {', '.join(_DEVICE_KINDS)}, xfer")
        return f"{self.root}/dev/+/{kind}"

    def everything(self) -> str:
        """Filter matching every topic of the protocol under this root."""
        return f"{self.root}/#"

    # ------------------------------------------------------------------ parsing

    def parse(self, topic: str) -> ParsedTopic | None:
        """Interpret an incoming topic name; None for anything that is not a well-formed v1 topic
        under this root (a foreign topic, a newer kind, a name with unsafe characters).

        Returns None rather than raising because the input comes off the network, not from the
        user: the caller logs and ignores it.
        """
        prefix = self.root + "/"
        if not topic.startswith(prefix):
            return None
        levels = topic[len(prefix):].split("/")
        if len(levels) < 3 or not _is_name(levels[1]):
            return None
        scope, name, kind, rest = levels[0], levels[1], levels[2], tuple(levels[3:])
        if scope == "grp":
            return ParsedTopic("group_cmd", group=name) if kind == "cmd" and not rest else None
        if scope != "dev":
            return None
        if kind == "xfer":
            if not rest or not all(_is_name(level) for level in rest):
                return None
            return ParsedTopic("xfer", device=name, rest=rest)
        if kind in _DEVICE_KINDS and not rest:
            return ParsedTopic(kind, device=name)
        return None


def _is_name(value: str) -> bool:
    return is_valid_id(value)
