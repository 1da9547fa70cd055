"""Compatibility package: the MQTT topic names and transport moved to the shared core
(:mod:`edgepack_core.protocol.topics`, :mod:`edgepack_core.mqtt_transport`) so the host tools
use them without importing the device agent. ``device_agent.mqtt.topics`` and
``device_agent.mqtt.transport`` re-export them for old imports.
"""
