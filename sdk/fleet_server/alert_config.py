"""The alerts file of ``edgepack fleet serve --alerts FILE``: typed, frozen, and its own JSON Schema.

The rules and the sinks are frozen dataclasses declared with :func:`~sdk.packager.options.option`
(as the recipe's sections are), so the schema the file is validated against is generated from
what the server reads (``edgepack schema alerts``, ``schemas/alerts.schema.json``), an unknown
key is refused naming it, and each key is documented (docs/fleet-server.md, "Alerts"). A rule
section that is absent is off; one that is present, even empty (``offline: {}``), is on with
its defaults. A webhook's shared secret is read from a file here, once, at start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgepack_core.errors import SchemaError
from edgepack_core.schema import validate
from edgepack_core.yamlfile import read_yaml_file
from sdk.errors import ServerConfigError
from sdk.packager.options import option, parse, schema_of

MAX_FILE_BYTES = 64 * 1024
MAX_SECRET_BYTES = 4096
DEFAULT_TOPIC = "edgepack/v1/fleet/alerts"
ROLLOUT_STATES = ("running", "paused", "succeeded", "failed", "aborted")
_URL = r"^https?://[^\s/?#]+[^\s]*$"
_TOPIC = r"^[^#+\s]+$"


@dataclass(frozen=True)
class OfflineRule:
    DESCRIPTION = "a device not heard from for longer than after_s (fires once per silence, resolves when heard)"

    after_s: float = option(
        300.0,
        description="seconds of silence before the alert; at exactly after_s no alert",
        exclusiveMinimum=0,
        maximum=30 * 86400,
    )


@dataclass(frozen=True)
class ErrorRateRule:
    DESCRIPTION = "a device whose errors per inference over the last window_s are above a share"

    above: float = option(
        0.05, description="the share of inferences that failed (0..1); equal to it is no alert", minimum=0, maximum=1
    )
    window_s: float = option(
        300.0,
        description="the window the share is taken over (raw telemetry: keep --retention-raw at least this long)",
        exclusiveMinimum=0,
        maximum=86400,
    )
    min_inferences: int = option(20, description="fewer inferences in the window judge nothing", minimum=1)


@dataclass(frozen=True)
class FailedUpdateRule:
    DESCRIPTION = (
        "a device whose newest final update job failed, was rejected or rolled back (resolves when an "
        "update on it succeeds)"
    )

    job_types: tuple[str, ...] = option(
        ("deploy",),
        description="the job types that count as updates",
        minItems=1,
        items={"enum": ["deploy", "rollback", "remove"]},
    )


@dataclass(frozen=True)
class RolloutRule:
    DESCRIPTION = "a notice for each rollout that enters one of these states"

    states: tuple[str, ...] = option(
        ("paused", "succeeded", "failed", "aborted"),
        description="the states that send a notice",
        minItems=1,
        items={"enum": list(ROLLOUT_STATES)},
    )


@dataclass(frozen=True)
class Delivery:
    DESCRIPTION = "how each sink retries: exponential backoff, bounded"

    max_attempts: int = option(
        8, description="tries per alert before it is given up (audited alert.given_up)", minimum=1, maximum=100
    )
    backoff_s: float = option(
        1.0, description="the wait after the first failure; doubled after each", exclusiveMinimum=0, maximum=3600
    )
    max_backoff_s: float = option(
        300.0, description="the longest wait between two tries", exclusiveMinimum=0, maximum=86400
    )
    queue: int = option(
        1000, description="alerts waiting per sink at most; one more is given up at once", minimum=1, maximum=100_000
    )
    timeout_s: float = option(
        10.0, description="a webhook request's deadline (connect and answer)", exclusiveMinimum=0, maximum=300
    )


@dataclass(frozen=True)
class Webhook:
    DESCRIPTION = "POST each alert as JSON to this URL"

    url: str = option(description="http(s) URL of the receiver", pattern=_URL)
    secret_file: str | None = option(
        None,
        description="file whose bytes sign each body: the header "
        "X-Edgepack-Signature: sha256=HMAC-SHA256(secret, body)",
        minLength=1,
    )
    name: str | None = option(None, description="what the audit calls this sink (default: the URL's host)", minLength=1)


@dataclass(frozen=True)
class MqttSink:
    DESCRIPTION = "publish each alert (QoS 1) on a topic of the server's broker"

    topic: str = option(
        DEFAULT_TOPIC, description="the topic (the server's broker account may write it)", pattern=_TOPIC
    )


@dataclass(frozen=True)
class AlertsConfig:
    DESCRIPTION = "edgepack fleet serve --alerts FILE"
    INTERNAL = ("secrets",)

    offline: OfflineRule | None = None
    error_rate: ErrorRateRule | None = None
    failed_update: FailedUpdateRule | None = None
    rollout: RolloutRule | None = None
    webhooks: tuple[Webhook, ...] = option((), description="receivers of every alert", maxItems=32)
    mqtt: MqttSink | None = None
    delivery: Delivery = field(default_factory=Delivery)
    evaluate_every_s: float = option(
        10.0,
        description="how often the rules are judged (by the server leading the rollouts)",
        minimum=0.05,
        maximum=3600,
    )
    secrets: tuple[bytes | None, ...] = ()  # each webhook's secret, read from its secret_file


ALERTS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://edgepack.dev/schemas/alerts.schema.json",
    "title": "Edgepack fleet server alerts",
    **schema_of(AlertsConfig),
}


def _read_secret(path: Path, where: str) -> bytes:
    try:
        mode = path.stat().st_mode
        with open(path, "rb") as handle:
            data = handle.read(MAX_SECRET_BYTES + 1)
    except OSError as err:
        raise ServerConfigError(f"{where}: cannot read {path}: {err.strerror or err}") from err
    if mode & 0o077:
        raise ServerConfigError(f"{where}: {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    secret = data.strip()
    if not secret or len(data) > MAX_SECRET_BYTES:
        raise ServerConfigError(f"{where}: {path} must hold 1 to {MAX_SECRET_BYTES} bytes")
    return secret


def parse_alerts(document: Any, *, source: str = "the alerts file", base: Path = Path(".")) -> AlertsConfig:
    """Validate and parse an alerts document; secret files resolved against ``base``."""
    if document is None:
        document = {}
    try:
        validate(document, ALERTS_SCHEMA, document=source)
    except SchemaError as err:
        raise ServerConfigError(str(err)) from err
    config = parse(AlertsConfig, document)
    if config.delivery.max_backoff_s < config.delivery.backoff_s:
        raise ServerConfigError(f"{source}: delivery.max_backoff_s is below delivery.backoff_s")
    secrets = tuple(
        None
        if hook.secret_file is None
        else _read_secret(base / Path(hook.secret_file).expanduser(), f"{source}: webhooks[{i}]")
        for i, hook in enumerate(config.webhooks)
    )
    return dataclasses.replace(config, secrets=secrets)


def load_alerts(path: Path) -> AlertsConfig:
    """The alerts file at ``path``, validated up front (one line naming the key otherwise)."""
    document = read_yaml_file(
        path, MAX_FILE_BYTES, lambda problem: ServerConfigError(f"--alerts {path}: {problem}"), kind="alerts"
    )
    return parse_alerts(document, source=str(path), base=path.parent)
