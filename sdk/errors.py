"""The host side's error hierarchy, extending the shared one in ``edgepack_core.errors``.

Every host failure is a :class:`HostError` (a usage mistake is also a ``UsageError``, exit code
2). The CLI (``sdk.cli``) turns any :class:`EdgepackError` into one line on stderr and exit code
``error.exit_code``, and with ``-v`` the cause chain; nothing below the CLI prints or exits.
"""

from __future__ import annotations

import signal

from edgepack_core.errors import EdgepackError, SchemaError, UsageError

__all__ = ["ApiError", "BrokerOptionError", "BuildError", "CommandFailed", "DeployError", "EdgepackError",
           "FleetError", "FleetServerError", "HostError", "MetricInputError", "ModelError", "OrtCrashError",
           "RecipeError", "RolloutError", "SchemaError", "ServerConfigError", "ValidationFailed"]


class HostError(EdgepackError):
    """Base of the host's own failures (packager, deploy, rollouts, fleet, fleet server, broker options)."""


class RecipeError(HostError, UsageError):
    """The recipe cannot be used as written (a missing file, a bad value); names the recipe key."""

    def __init__(self, key: str, problem: str, *, recipe: str = "") -> None:
        where = f"{recipe}: " if recipe else ""
        super().__init__(f"{where}{key}: {problem}")
        self.key = key
        self.problem = problem
        self.recipe = recipe


class ModelError(HostError):
    """The ONNX model is unusable: fails to load, fails onnx.checker, opset outside range."""

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(f"{model}: {problem}")
        self.model = model
        self.problem = problem


class BuildError(HostError):
    """A build pass failed. ``pass_name`` says which."""

    def __init__(self, pass_name: str, problem: str) -> None:
        super().__init__(f"{pass_name}: {problem}")
        self.pass_name = pass_name
        self.problem = problem


class ValidationFailed(BuildError):
    """The packaged model missed an accuracy threshold of the recipe."""

    def __init__(self, metric: str, value: float, threshold: float, problem: str) -> None:
        super().__init__("validate", problem)
        self.metric = metric
        self.value = value
        self.threshold = threshold


_SIGNAL_MEANING = {
    "SIGSEGV": "invalid memory access",
    "SIGFPE": "arithmetic error such as an integer division by zero",
    "SIGABRT": "aborted",
    "SIGKILL": "killed from outside, often by the out-of-memory killer",
    "SIGBUS": "bus error",
    "SIGILL": "illegal instruction, a build for another CPU?",
}


class OrtCrashError(BuildError):
    """The onnxruntime worker (``sdk/packager/ort_host.py``) died (a signal or an exit) while
    running ``doing`` for a pass."""

    def __init__(self, pass_name: str, model: str, doing: str, returncode: int | None) -> None:
        self.signal_name = _signal_name(returncode)
        self.model = model
        self.doing = doing
        self.returncode = returncode
        if self.signal_name:
            meaning = _SIGNAL_MEANING.get(self.signal_name, "")
            how = f"crashed with {self.signal_name}" + (f" ({meaning})" if meaning else "")
        else:
            how = f"exited with status {returncode}"
        super().__init__(pass_name, f"onnxruntime {how} on {doing} of {model}")


def _signal_name(returncode: int | None) -> str:
    if returncode is None or returncode >= 0:
        return ""
    try:
        return signal.Signals(-returncode).name
    except ValueError:  # a number no signal has: the number is the whole story
        return f"signal {-returncode}"


class ContractError(HostError, ValueError):
    """An output the build cannot describe truthfully (dtype unlike the declared one, rank that
    varies across samples); the message names the output."""


class MetricInputError(HostError):
    """An output a task metric cannot read (a detection metric on something that is no detection head)."""


class FleetServerError(HostError):
    """The fleet server (``edgepack fleet serve``) or a command talking to it failed."""


class ServerConfigError(HostError, UsageError):
    """A fleet server setting that cannot be used (a flag, a token file, a database URL)."""


class AlertDeliveryError(FleetServerError):
    """An alert sink could not deliver one alert (an HTTP status, a refused connection, no PUBACK);
    retried with backoff, then given up and audited."""


class ApiError(FleetServerError):
    """A request the fleet server's REST API refuses, or a client's view of such a refusal.

    ``status`` is the HTTP status, ``code`` a stable word for programs (``unauthorized``,
    ``not_found``, ``too_large``, ``invalid``, ``conflict``, ...); the message is one line.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ForbiddenError(ApiError):
    """A valid token whose role may not do what it asked (403); ``needs`` is the least role that may."""

    def __init__(self, needs: str, message: str) -> None:
        super().__init__(403, "forbidden", message)
        self.needs = needs


class BrokerOptionError(HostError, UsageError):
    """A broker address, password file or TLS file that cannot be used."""


class DeployError(HostError):
    """The deployment or command could not be started or did not reach every device."""


class RolloutError(HostError):
    """A rollout that cannot be planned (an empty target list, a canary share out of range)."""


class FleetError(HostError):
    """The broker could not be reached or the fleet could not be read."""


class CommandFailed(HostError):
    """A command ran to its end and its outcome is a failure (a deployment or rollout that did
    not end active everywhere, a device command answered with a failure); the CLI prints it as
    one line and exits 1. Whatever the command prints on stdout has already been printed."""
