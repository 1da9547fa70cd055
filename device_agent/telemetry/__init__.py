"""Device telemetry: metrics aggregation (pure) and the store-and-forward outbox.

``metrics`` turns inference timings and system readings into the ``edgepack.telemetry/1``
payload; ``outbox`` keeps every outgoing message on disk until the broker acknowledged it.
"""
