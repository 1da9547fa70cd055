"""MQTT building blocks of the device agent and the fleet tools.

``topics`` builds and parses the v1 topic names (pure); ``transport`` wraps paho-mqtt with the
connection policy Edgepack needs (background thread, jittered reconnect, subscriptions that
survive reconnects, TCP_NODELAY, bounded incoming payloads). Both sides import this package:
it depends on nothing but paho-mqtt and the shared core.
"""
