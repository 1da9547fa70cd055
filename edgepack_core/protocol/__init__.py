"""The Edgepack wire protocol (MQTT v1), shared by the host tools and the device agent.

- :mod:`.ids`: the one pattern every id and name must match before anything uses it;
- :mod:`.topics`: topic names, built and parsed;
- :mod:`.payloads`: schema ids and the JSON Schemas of every payload (``cmd``, ``job``,
  ``state``, ``telemetry``, ``xfer``), shipped as files in ``schemas/``;
- :mod:`.commands`: the one command builder (host) and the one parser (device);
- :mod:`.messages`: the one parser of each device message (state, telemetry, job event) into
  frozen, bounded values, every host reader's; :mod:`.bounds`: the bounds they are held to;
- :mod:`.codec`: the chunk codec of the MQTT artifact transfer.

Pure: no I/O besides reading the schema files, no paho, nothing host- or device-only.
"""
