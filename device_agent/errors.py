"""The device side's error hierarchy, extending ``edgepack_core.errors``.

``edgepack-agent`` turns any :class:`EdgepackError` into one line on stderr and its exit
code; the HTTP API turns a :class:`BadRequest` into a 4xx JSON answer and keeps serving.
"""

from __future__ import annotations

from edgepack_core.errors import EdgepackError, UsageError

__all__ = [
    "AdmissionRefused", "AgentError", "BackgroundError", "BadRequest", "ConfigError", "DownloadCancelled",
    "DownloadError", "JournalError", "MessageTooLargeError", "NoModelError", "OutboxError", "ProviderError",
    "ReplayError", "SmokeTestError", "StoreError", "TransferError",
]


class AgentError(EdgepackError):
    """Base of the device agent's own failures."""


class BackgroundError(AgentError):
    """predict's forked verification ended without an answer (killed, crashed, or garbled)."""


class ConfigError(AgentError, UsageError):
    """agent.yaml cannot be used (beyond schema errors, which are ``edgepack_core.errors.SchemaError``)."""

    def __init__(self, key: str, problem: str, *, config: str = "") -> None:
        where = f"{config}: " if config else ""
        super().__init__(f"{where}{key}: {problem}")
        self.key = key
        self.problem = problem


class StoreError(AgentError):
    """The model store cannot complete an operation (nothing to roll back to, disk errors)."""


class AdmissionRefused(AgentError):
    """A verified update this device must not run (name, version, profile or I/O contract;
    ``updates/admission.py``): the job is rejected and nothing is extracted."""


class SmokeTestError(AgentError):
    """A model's golden samples did not reproduce: it is not activated."""

    def __init__(self, model: str, sample: int | None, problem: str) -> None:
        where = f" (golden sample {sample})" if sample is not None else ""
        super().__init__(f"smoke test of {model} failed{where}: {problem}")
        self.model = model
        self.sample = sample
        self.problem = problem


class ProviderError(AgentError):
    """No execution provider on the list could create a session for the model."""

    def __init__(self, model: str, attempts: list[tuple[str, str]]) -> None:
        tried = "; ".join(f"{name}: {reason}" for name, reason in attempts)
        super().__init__(f"no provider could load {model} ({tried})")
        self.model = model
        self.attempts = attempts


class NoModelError(AgentError):
    """A request arrived while no model is active."""

    http_status = 503


class BadRequest(AgentError):
    """A request the model cannot take: wrong shape, dtype or input name, corrupt image,
    oversized body. ``kind`` names the problem for metrics; ``http_status`` is the answer."""

    def __init__(self, kind: str, problem: str, *, http_status: int = 400) -> None:
        super().__init__(problem)
        self.kind = kind
        self.http_status = http_status


# --------------------------------------------------------------------------- updates


class DownloadError(AgentError):
    """The artifact could not be fetched completely and intact. The message is one of a few fixed
    texts (plus numbers the agent computed), never bytes from the remote side."""


class DownloadCancelled(DownloadError):
    """The job was cancelled or superseded while downloading."""


class TransferError(AgentError):
    """A chunked transfer (``updates/xfer.py``) could not complete."""


class JournalError(AgentError):
    """A job cannot be written to the journal (read-only or full medium, permissions). The
    command it belongs to must not run; its sender is told with a ``failed`` event."""


class ReplayError(AgentError):
    """A command id was used before, or its bucket is full, or the ledger cannot be written."""


# --------------------------------------------------------------------------- telemetry


class OutboxError(AgentError):
    """The telemetry outbox database cannot be opened or used (corrupt file, disk full, wrong
    permissions)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"outbox {path}: {problem}")
        self.path = path
        self.problem = problem


class MessageTooLargeError(AgentError, UsageError):
    """A single message is larger than the outbox's whole byte bound for its kind."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a {size}-byte message cannot fit an outbox bounded to {limit} bytes")
        self.size = size
        self.limit = limit
