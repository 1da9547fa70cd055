"""``edgepack deploy`` and ``edgepack device``, split by job:

| module | job |
| --- | --- |
| :mod:`.orchestrator` | :func:`deploy` with one :class:`DeployOptions`: targets, delivery, waves, result |
| :mod:`.policy` | pure rollout rules: :func:`plan_waves`, :func:`wave_verdict`, :class:`JobBoard` |
| :mod:`.server` | the artifact server (HTTP with Range) |
| :mod:`.sender` | the MQTT chunk sender, reading ranges from the file |
| :mod:`.messaging` | publish-and-wait-for-PUBACK, job listening, build-and-sign |
| :mod:`.device` | :func:`send_command` and :func:`send_rollback` for ``edgepack device`` |
"""

from edgepack_core.fsutil import sha256_file  # the deploy API's name for the one file hash
from sdk.deploy.device import parse_model_ref, send_command, send_rollback, serving_model
from sdk.deploy.messaging import make_command
from sdk.deploy.orchestrator import (
    COMMAND_TTL_S,
    DEFAULT_CHUNK,
    DeployOptions,
    DeployResult,
    deploy,
    group_members,
)
from sdk.deploy.policy import DeviceJob, JobBoard, WaveVerdict, plan_waves, wave_verdict
from sdk.deploy.sender import XferSender
from sdk.deploy.server import ArtifactServer, parse_range

__all__ = [
    "COMMAND_TTL_S", "DEFAULT_CHUNK", "ArtifactServer", "DeployOptions", "DeployResult", "DeviceJob",
    "JobBoard", "WaveVerdict", "XferSender", "deploy", "group_members", "make_command", "parse_model_ref",
    "parse_range", "plan_waves", "send_command", "send_rollback", "serving_model", "sha256_file", "wave_verdict",
]
