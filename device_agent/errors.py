"""The device side's error hierarchy, extending ``edgepack_core.errors``.

``edgepack-agent`` turns any :class:`EdgepackError` into one line on stderr and its exit
code; the HTTP API answers a :class:`BadRequest` (the client's mistake) with its 4xx, an
:class:`InferenceError` (the model's failure) with 500, :class:`Busy` and :class:`NoModelError`
with 503, and keeps serving.
"""

from __future__ import annotations

from edgepack_core.errors import EdgepackError, UsageError
from edgepack_core.golden_stream import mismatch_reason

__all__ = [
    "AdmissionRefused", "AgentError", "BackgroundError", "BadRequest", "Busy", "ConfigError", "DownloadCancelled",
    "DownloadError", "EnrollError", "InferenceError", "JournalError", "MessageTooLargeError", "NoModelError",
    "NonFiniteOutput", "OutboxError", "PipelineRefused", "ProviderError", "ReplayError", "RequestError",
    "SmokeTestError", "StoreError",
    "TransferError",
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


class PipelineRefused(AgentError):
    """A pipeline the installed models cannot run (a missing model, a video source into an audio
    model, crops of a stage that gives no boxes): refused before it starts, naming the key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class StoreError(AgentError):
    """The model store cannot complete an operation (nothing to roll back to, disk errors)."""


class AdmissionRefused(AgentError):
    """A verified update this device must not run (name, version, profile or I/O contract;
    ``updates/admission.py``): the job is rejected and nothing is extracted. ``rule`` names the
    admission rule that refused it."""

    def __init__(self, reason: str, rule: str = "") -> None:
        super().__init__(reason)
        self.rule = rule


class SmokeTestError(AgentError):
    """A model's golden samples did not reproduce: it is not activated."""

    def __init__(self, model: str, sample: int | None, problem: str) -> None:
        where = f" (golden sample {sample})" if sample is not None else ""
        super().__init__(f"smoke test of {model} failed{where}: {problem}")
        self.model = model
        self.sample = sample
        self.problem = problem


class GoldenStreamMismatch(AgentError):
    """A candidate's golden clip did not give its signed events: it is not activated.
    ``counts``: the job's ``golden_stream`` detail (events expected, mismatches)."""

    def __init__(self, model: str, problem: str, counts: dict[str, int]) -> None:
        super().__init__(mismatch_reason(model, problem))
        self.model = model
        self.problem = problem
        self.counts = counts


class ProviderError(AgentError):
    """No execution provider on the list could create a session for the model."""

    def __init__(self, model: str, attempts: list[tuple[str, str]]) -> None:
        tried = "; ".join(f"{name}: {reason}" for name, reason in attempts)
        super().__init__(f"no provider could load {model} ({tried})")
        self.model = model
        self.attempts = attempts


class NoModelError(AgentError):
    """A request arrived while no model is active (the HTTP layer answers 503)."""


class RequestError(AgentError):
    """Base of an inference request's failures; ``kind`` names the problem for metrics. The
    class says whose failure it is, and the HTTP layer alone turns it into a status
    (``device_agent/http/answers.py``: :func:`~device_agent.http.answers.status_of`)."""

    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(problem)
        self.kind = kind


class BadRequest(RequestError):
    """The client's mistake: wrong shape, dtype or input name, corrupt image, oversized body.
    ``http_status`` is the 4xx that names it (400 unless 404, 406, 408, 413, 415 say more);
    a failure that is not the client's is an :class:`InferenceError` or :class:`Busy`."""

    def __init__(self, kind: str, problem: str, *, http_status: int = 400) -> None:
        if not 400 <= http_status <= 499:
            raise ValueError(f"a client's refusal is a 4xx, not {http_status}")
        super().__init__(kind, problem)
        self.http_status = http_status


class InferenceError(RequestError):
    """A request the contract admits that the model could not answer: onnxruntime failed on it,
    or the postprocessing could not read the outputs. The model's failure, answered 500 and
    counted against the model (the health window), never against the client."""


class NonFiniteOutput(InferenceError):
    """The model answered NaN or infinity in an output its recipe does not declare
    ``allow_non_finite``: a model error (500 ``non_finite_output``), never a 200 carrying
    ``"NaN"`` that a client would read as a score. ``counts``: output name -> how many values."""

    def __init__(self, counts: dict[str, int], sizes: dict[str, int]) -> None:
        named = ", ".join(f"{name} holds {n} NaN/infinite value(s) of {sizes[name]}" for name, n in counts.items())
        super().__init__("non_finite_output", f"output {named}; the recipe does not allow non-finite values "
                         f"there (outputs.NAME.allow_non_finite)")
        self.counts = dict(counts)


class Busy(RequestError):
    """The agent cannot take the request now (workers, queue or body budget taken): 503 with
    ``Retry-After``, for the client to try again."""

    def __init__(self, problem: str) -> None:
        super().__init__("busy", problem)


# --------------------------------------------------------------------------- updates


class EnrollError(AgentError):
    """``edgepack-agent enroll`` or a certificate renewal failed: the server refused, could not be
    reached, or answered something unusable (the message says which, in one line)."""


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
