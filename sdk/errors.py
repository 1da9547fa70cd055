"""The host side's error hierarchy, extending the shared one in ``edgepack_core.errors``.

The CLI (``sdk.cli``) turns any :class:`EdgepackError` into one line on stderr and exit code
``error.exit_code``; nothing below the CLI prints or exits.
"""

from __future__ import annotations

from edgepack_core.errors import EdgepackError, SchemaError, UsageError

__all__ = ["BuildError", "EdgepackError", "ModelError", "RecipeError", "SchemaError", "ValidationFailed"]


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
