"""Secrets never reach a log line: the redaction every log record of the agent goes through
before it is kept (the log ring, ``device_agent/logring.py``) or printed (stderr, the journal).

What is redacted: the configured secrets (the MQTT password, the base64 lines of the MQTT
client key file), any PEM private key block, a bearer token, and the value after a
``token``/``password``/``secret`` key in ``key=value`` or ``"key": "value"`` text. A configured
secret shorter than :data:`MIN_SECRET_CHARS` is not searched for (it would blank every word
holding those letters); the key-value rules still cover it where it is named. :class:`Redactor`
is pure; :class:`RedactingFilter` applies it to a :class:`logging.LogRecord` in place.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MIN_SECRET_CHARS = 4
MAX_KEY_FILE_BYTES = 64 * 1024
REDACTED = "[redacted]"

_PEM_PRIVATE = re.compile(r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END \1PRIVATE KEY-----|\Z)", re.S)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}")
_KEY_VALUE = re.compile(r"""(?i)\b((?:[a-z_]*_)?(?:token|password|passwd|secret))(["']?\s*[:=]\s*["']?)[^\s"',;}]+""")
_PEM_BODY = re.compile(r"^[A-Za-z0-9+/=]{16,}$")


class Redactor:
    """Replaces secrets in text. Pure; built once from the agent's configuration."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        kept = {s for s in secrets if len(s) >= MIN_SECRET_CHARS}
        self.secrets = tuple(sorted(kept, key=len, reverse=True))  # a longer secret holding a shorter one first

    def __call__(self, text: str) -> str:
        text = _PEM_PRIVATE.sub("[redacted private key]", text)
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
        return _KEY_VALUE.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)


def key_material(path: Path) -> list[str]:
    """The base64 lines of a PEM key file (what would give the key away if logged), read with a
    bound; [] when the file cannot be read (the MQTT client reports that itself)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES)
    except OSError:
        return []
    lines = data.decode("ascii", errors="replace").splitlines()
    return [line.strip() for line in lines if _PEM_BODY.match(line.strip())]


def configured_secrets(config: Any) -> list[str]:
    """The secrets an agent.yaml names: the MQTT password and the MQTT client key's material."""
    mqtt = getattr(config, "mqtt", None)
    if mqtt is None:
        return []
    found = [mqtt.password] if mqtt.password else []
    if mqtt.tls is not None and mqtt.tls.key:
        found.extend(key_material(Path(mqtt.tls.key)))
    return found


class RedactingFilter(logging.Filter):
    """A handler filter that rewrites each record's message, exception and stack text through a
    :class:`Redactor` (idempotent: a record already redacted by another handler stays the same)."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the format: kept as given
            message = f"{record.msg} {record.args}"
        record.msg, record.args = self.redactor(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redactor(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redactor(record.stack_info)
        return True
