"""Settings from the fleet server, held on the device: the document last applied, kept in the
store (``<store>/settings.json``, written atomically) so that it survives a restart and wins
over agent.yaml for the keys it carries; the per-key decision (pure); the config it makes.

The document arrives in a signed ``apply-settings`` command (``device_agent/updates/
settings_apply.py`` applies it live). Keys and their bounds: :mod:`edgepack_core.settings_doc`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agent.config import AgentConfig, HealthWindow
from device_agent.errors import ConfigError
from edgepack_core.artifact import Limits
from edgepack_core.errors import SchemaError
from edgepack_core.fsutil import atomic_write

if TYPE_CHECKING:  # imported when a document is held or arrives: most devices never get one
    from edgepack_core.ed25519 import PublicKey
    from edgepack_core.pipeline_spec import PipelineSpec
    from edgepack_core.settings_doc import SettingsDocument

SETTINGS_FILE = "settings.json"
MAX_FILE_BYTES = 256 * 1024
APPLIED = "applied"
_KEY_SETTINGS = ("trust", "operator_keys")  # the settings that hold public keys


@dataclasses.dataclass(frozen=True)
class Held:
    """The document this device applied last (None: none yet), each key's result, and the values
    kept from the document before for keys this one carries but were refused (a refused key keeps
    what the device held, never falls back to agent.yaml behind the operator's back).
    ``kept_pipelines`` and ``kept_keys``: the kept ``pipelines`` and ``trust``/``operator_keys``
    values as parsed when they were applied (never parsed again from ``kept``)."""

    document: SettingsDocument | None = None
    results: tuple[tuple[str, str], ...] = ()
    kept: tuple[tuple[str, Any], ...] = ()
    kept_pipelines: tuple[PipelineSpec, ...] | None = None
    kept_keys: tuple[tuple[str, tuple[PublicKey, ...]], ...] = ()

    @property
    def pipelines(self) -> tuple[PipelineSpec, ...] | None:
        """The pipelines that win over agent.yaml's (None: these settings hold none), as parsed
        with their document: checked against the models and started without parsing again."""
        if self.document is not None and dict(self.results).get("pipelines") == APPLIED:
            return self.document.pipelines
        return self.kept_pipelines

    @property
    def generation(self) -> int:
        return 0 if self.document is None else self.document.generation

    def applied(self) -> dict[str, Any]:
        """The values of the keys that were applied (what wins over agent.yaml)."""
        if self.document is None:
            return {}
        results = dict(self.results)
        return {**dict(self.kept), **{key: value for key, value in self.document.values if results.get(key) == APPLIED}}

    def after(self, document: SettingsDocument, results: dict[str, str]) -> Held:
        """The held settings once ``document`` is decided: a refused key keeps the value it had."""
        before = self.applied()
        kept = {key: before[key] for key, result in results.items() if result != APPLIED and key in before}
        pipelines = self.pipelines if "pipelines" in kept else None
        keys = tuple((key, held_keys(self, key)) for key in _KEY_SETTINGS if key in kept)
        return Held(document, tuple(sorted(results.items())), tuple(sorted(kept.items())), pipelines, keys)


def settings_path(store: Path) -> Path:
    return store / SETTINGS_FILE


def load_held(store: Path) -> Held:
    """The held document, or an empty :class:`Held` when there is none. A file that cannot be read
    back is a :class:`ConfigError` naming it: it was written atomically, so it is not a torn
    write, and starting on agent.yaml's keys instead would silently undo the operator's change."""
    path = settings_path(store)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Held()
    except OSError as err:
        raise ConfigError(str(path), f"cannot read the held settings: {err.strerror}") from err
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(str(path), f"held settings over {MAX_FILE_BYTES} bytes")
    from edgepack_core.settings_doc import checked, parse_document

    try:
        doc = json.loads(data)
        document = parse_document(doc["generation"], doc["settings"])
        results = tuple(sorted((str(k), str(v)) for k, v in doc["results"].items()))
        kept = doc.get("kept", {})
        parsed = {key: checked(key, value) for key, value in kept.items()}
    except (ValueError, KeyError, TypeError, AttributeError, SchemaError) as err:
        raise ConfigError(
            str(path),
            f"held settings are not a settings document ({err}); move the file away to start on agent.yaml alone",
        ) from err
    kept_pipelines = parsed["pipelines"].pipelines if "pipelines" in parsed else None
    kept_keys = tuple((key, parsed[key].keys or ()) for key in _KEY_SETTINGS if key in parsed)
    return Held(document, results, tuple(sorted(kept.items())), kept_pipelines, kept_keys)


def save_held(store: Path, held: Held) -> None:
    """Write the held document atomically (a crash leaves the old one or the new one)."""
    assert held.document is not None
    body = {**held.document.to_json(), "results": dict(held.results), "kept": dict(held.kept)}
    atomic_write(settings_path(store), json.dumps(body, sort_keys=True, indent=1).encode() + b"\n", mode=0o600)


def decide(document: SettingsDocument, config: AgentConfig, unverifiable: tuple[str, ...] = ()) -> dict[str, str]:
    """Each key's result, ``applied`` or ``refused: reason``. Pure. The device's own bounds win
    over the server's values: a health window outside agent.yaml's range is refused, and so is a
    ``trust`` that verifies none of the signatures of the models it serves (``unverifiable``: their
    labels), since the next start could not load them."""
    results: dict[str, str] = {}
    for key, value in document.values:
        results[key] = _refusal(key, value, config) or APPLIED
    if "trust" in results and unverifiable:
        results["trust"] = (
            f"refused: {', '.join(unverifiable)} would verify by none of these keys (the next start "
            "could not load it): roll out an artifact signed by a key kept here first"
        )
    return results


def held_keys(held: Held, key: str) -> tuple[PublicKey, ...]:
    """The public keys of ``trust`` or ``operator_keys`` the device holds from the server (()
    when it holds none of that kind: agent.yaml's then), as parsed with their document or kept
    from the one before (the same precedence as :meth:`Held.applied`)."""
    document = held.document
    if document is not None and dict(held.results).get(key) == APPLIED:
        return document.release_keys if key == "trust" else document.operator_keys
    return dict(held.kept_keys).get(key, ())


def _refusal(key: str, value: Any, config: AgentConfig) -> str:
    window = config.updates.health_window_s
    if key == "updates.health_window_s" and not window.min <= value <= window.max:
        return (
            f"refused: {value:g} s is outside this device's range [{window.min:g}, {window.max:g}] "
            "(updates.health_window_s in agent.yaml)"
        )
    if key in ("mqtt.groups", "mqtt.telemetry_interval") and config.mqtt is None:
        return "refused: this device has no mqtt section"
    limits = config.limits
    if key == "limits.max_member_bytes" and value > limits.max_total_bytes:
        return f"refused: over limits.max_total_bytes ({limits.max_total_bytes})"
    return ""


_SECTIONS = ("mqtt", "updates", "limits")


def overlay(
    config: AgentConfig, values: dict[str, Any], pipelines: tuple[PipelineSpec, ...] | None = None
) -> AgentConfig:
    """``config`` with the applied ``values`` over its keys (``trust`` and ``operator_keys`` are
    public keys the daemon holds itself, not paths: they are skipped here), and ``pipelines``
    (:attr:`Held.pipelines`, already parsed; ``values``' raw ``pipelines`` is never parsed
    again) over agent.yaml's when not None. Pure."""
    changes: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    top: dict[str, Any] = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section in _SECTIONS and name:
            changes[section][name] = _typed(name, value)
        elif key == "log_level":
            top[key] = value
    if pipelines is not None:
        top["pipelines"] = pipelines
    if changes["updates"].get("health_window_s") is not None:
        window = config.updates.health_window_s
        changes["updates"]["health_window_s"] = HealthWindow(
            changes["updates"]["health_window_s"], window.min, window.max
        )
    sections = {
        name: dataclasses.replace(getattr(config, name), **fields)
        for name, fields in changes.items()
        if fields and getattr(config, name) is not None
    }
    return dataclasses.replace(config, **sections, **top)


def limits_for(config: AgentConfig, values: dict[str, Any], model: str | None) -> Limits:
    """The artifact limits of ``model``'s store: ``limits.*`` (agent.yaml, or the document over
    it, already in ``config``) with the document's ``models.NAME.limits.*`` over them. Pure."""
    if not values:  # no document held: agent.yaml's limits (settings_doc is not loaded for nothing)
        return config.limits.reader_limits()
    from edgepack_core.settings_doc import model_limits

    own = model_limits(values).get(model or "", {})
    return dataclasses.replace(config.limits, **own).reader_limits()


def _typed(name: str, value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if name in (
        "telemetry_interval",
        "health_window_s",
        "max_error_rate",
        "max_latency_factor",
        "min_latency_increase_ms",
    ):
        return float(value)
    return value
