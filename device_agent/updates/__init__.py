"""Remote updates over MQTT: commands, the job state machine, delivery, and the executor."""
