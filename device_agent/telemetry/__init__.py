"""Device telemetry: metrics aggregation (pure) and the store-and-forward outbox.

``metrics`` turns inference timings and system readings into the ``edgepack.telemetry/1``
payload; ``outbox`` keeps every outgoing message on disk until the broker acknowledged it.
"""

# The outbox's bounds (agent.yaml mqtt.queue), here so that reading agent.yaml does not load the
# outbox and sqlite3 on an agent without mqtt: (tests/test_agent_lazy_imports.py).
DEFAULT_MAX_MESSAGES = 10_000  # agent.yaml mqtt.queue.max_messages
DEFAULT_MAX_BYTES = 16 << 20  # agent.yaml mqtt.queue.max_bytes
