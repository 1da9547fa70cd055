"""The host side's error hierarchy, extending the shared one in ``edgepack_core.errors``.

The CLI (``sdk.cli``) turns any :class:`EdgepackError` into one line on stderr and exit code
``error.exit_code``; nothing below the CLI prints or exits.
"""

from __future__ import annotations

from edgepack_core.errors import EdgepackError, SchemaError, UsageError

__all__ = ["ApiError", "BuildError", "EdgepackError", "FleetServerError", "ModelError", "RecipeError", "SchemaError",
           "ServerConfigError", "ValidationFailed"]


class RecipeError(UsageError):
    """The recipe cannot be used as written (a missing file, a bad value); names the recipe key."""

    def __init__(self, key: str, problem: str, *, recipe: str = "") -> None:
        where = f"{recipe}: " if recipe else ""
        super().__init__(f"{where}{key}: {problem}")
        self.key = key
        self.problem = problem
        self.recipe = recipe


class ModelError(EdgepackError):
    """The ONNX model is unusable: fails to load, fails onnx.checker, opset outside range."""

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(f"{model}: {problem}")
        self.model = model
        self.problem = problem


class BuildError(EdgepackError):
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


class FleetServerError(EdgepackError):
    """The fleet server (``edgepack fleet serve``) or a command talking to it failed."""


class ServerConfigError(UsageError):
    """A fleet server setting that cannot be used (a flag, a token file, a database URL)."""


class ApiError(FleetServerError):
    """A request the fleet server's REST API refuses, or a client's view of such a refusal.

    ``status`` is the HTTP status, ``code`` a stable word for programs (``unauthorized``,
    ``not_found``, ``too_large``, ``invalid``, ``conflict``, ...); the message is one line.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
