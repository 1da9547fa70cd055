"""Compatibility module: ``MqttTransport`` moved to :mod:`edgepack_core.mqtt_transport`, the one
MQTT client shared by the agent and the host tools. Old imports keep working through this
re-export."""

from edgepack_core.mqtt_transport import (
    DEFAULT_MAX_INCOMING_BYTES,
    BrokerConnectError,
    BrokerLoginRefused,
    BrokerUnreachable,
    Handler,
    Incoming,
    InvalidPublishError,
    MqttSettings,
    MqttSettingsError,
    MqttTransport,
    Payload,
    PublishCallback,
    TlsSettings,
    Will,
    backoff_delay,
    encode_payload,
)

__all__ = [
    "DEFAULT_MAX_INCOMING_BYTES", "BrokerConnectError", "BrokerLoginRefused", "BrokerUnreachable", "Handler",
    "Incoming", "InvalidPublishError", "MqttSettings", "MqttSettingsError", "MqttTransport", "Payload",
    "PublishCallback", "TlsSettings", "Will", "backoff_delay", "encode_payload",
]
