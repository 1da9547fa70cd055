"""Compatibility module: the topic names moved to :mod:`edgepack_core.protocol.topics`, where
the host tools and the agent share them. Old imports keep working through this re-export."""

from edgepack_core.protocol.topics import (
    DEFAULT_ROOT,
    MAX_NAME_LENGTH,
    DeviceTopicKind,
    InvalidNameError,
    ParsedTopic,
    TopicKind,
    Topics,
    validate_device_id,
    validate_group,
    validate_root,
)

__all__ = [
    "DEFAULT_ROOT", "MAX_NAME_LENGTH", "DeviceTopicKind", "InvalidNameError", "ParsedTopic", "TopicKind", "Topics",
    "validate_device_id", "validate_group", "validate_root",
]
