"""Several named models on one device: a :class:`ModelSlot` per model name (its own store, so its
own version history, rejected versions and rollback target, and its own inference service, so
its own request statistics, health window and hot-swap), the daemon's :class:`ModelSet` of them,
and the pure decisions that pick the slot a request or a command is for.

Store layout (docs/agent.md, "Several models"): the store root keeps today's single-model
layout (``models/``, ``cache/``, ``state.json``, ``rejected.json``), and that root store is the
slot of the model it holds, so an agent whose store predates named models keeps working and
keeps its history. Every other model has a store of the same layout under
``slots/<name>/``. A name is a model name (``^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$``), so a slot
directory is always a plain entry of ``slots/``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_agent.config import MAX_MODELS
from device_agent.errors import BadRequest, NoModelError
from device_agent.runtime import InferenceService, LoadedModel
from device_agent.store import ModelStore
from edgepack_core.protocol.ids import is_valid_id

SLOTS_DIR = "slots"
__all__ = [
    "MAX_MODELS",
    "ModelSet",
    "ModelSlot",
    "choose",
    "deploy_refusal",
    "deploy_target",
    "describe_service",
    "model_bytes",
    "slot_directory",
    "state_entry",
]


@dataclass(frozen=True)
class ModelSlot:
    """One named model: where it is stored and what serves it."""

    name: str
    store: ModelStore
    service: InferenceService


@dataclass(frozen=True)
class ModelSet:
    """The models a device holds, in the order they were installed (the first one is what the
    single ``model`` field of the state message reports, for readers that know one model)."""

    slots: tuple[ModelSlot, ...] = ()

    def __iter__(self) -> Iterator[ModelSlot]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.slots)

    def get(self, name: str) -> ModelSlot | None:
        return next((slot for slot in self.slots if slot.name == name), None)

    def with_slot(self, slot: ModelSlot) -> ModelSet:
        """This set with ``slot`` added (or replacing the slot of its name)."""
        if self.get(slot.name) is not None:
            return ModelSet(tuple(slot if s.name == slot.name else s for s in self.slots))
        return ModelSet((*self.slots, slot))

    def services(self) -> dict[str, InferenceService]:
        return {slot.name: slot.service for slot in self.slots}


def slot_directory(root: Path, name: str) -> Path:
    """``<store>/slots/<name>``: the store of a model that is not the root store's."""
    if not is_valid_id(name):
        raise ValueError(f"{name[:80]!r} is not a model name")
    return root / SLOTS_DIR / name


def installed_names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


def choose(names: tuple[str, ...], wanted: str | None) -> str:
    """The model a request is for. Pure. ``wanted`` None (``POST /predict``): the only model;
    several: 400 ``model_required`` naming them; none: no model (503). A name not installed:
    404 ``unknown_model`` naming the installed ones."""
    if wanted is None:
        if len(names) == 1:
            return names[0]
        if not names:
            raise NoModelError("no model is active")
        raise BadRequest(
            "model_required",
            f"this agent serves several models ({installed_names(names)}): name one, as in POST /predict/{{name}}",
        )
    if wanted in names:
        return wanted
    raise BadRequest(
        "unknown_model",
        f"no model {wanted[:100]!r} on this agent (installed: {installed_names(names)})",
        http_status=404,
    )


def deploy_refusal(held: tuple[str, ...], name: str | None, allowed: frozenset[str] | None) -> str | None:
    """Why a deploy of model ``name`` (None: the command names none) cannot go to any slot, or
    None. Pure. A name held goes to its slot; a name not held gets a new slot when the device
    holds nothing yet (``allowed`` None) or ``updates.allowed_names`` lists it; a deploy that
    names no model goes to the only model, and is refused on a device holding several."""
    if name is None:
        if len(held) > 1:
            return f"this device holds several models ({installed_names(held)}): the deploy must name one"
        return None
    if name in held or (not held and allowed is None):
        return None
    if len(held) + 1 > MAX_MODELS:
        return f"this device holds {len(held)} models, the most it takes"
    if allowed is not None and name in allowed:
        return None
    names = installed_names(tuple(sorted(allowed)) if allowed is not None else held)
    return (f"model name {name!r} is not allowed on this device (allowed: {names}; a model not installed needs "
            "updates.allowed_names)")


def deploy_target(held: tuple[str, ...], name: str | None) -> str | None:
    """The slot a deploy that passed :func:`deploy_refusal` goes to: its name, the only model's
    when it names none, None on an empty device (the slot is named by the artifact). Pure."""
    if name is not None:
        return name
    return held[0] if len(held) == 1 else None


def describe_service(name: str, service: InferenceService) -> dict[str, Any]:
    """One model as /healthz lists it: its name, version, provider, whether it serves and the
    bytes of its files (:func:`model_bytes`)."""
    model = service.model
    if model is None:
        return {"name": name, "state": "no model"}
    return {**model.describe(), "state": "serving", "model_bytes": model_bytes(model.root), **card_entry(model)}


@functools.lru_cache(maxsize=4 * MAX_MODELS)
def model_bytes(root: Path) -> int:
    """Bytes of a model directory's files: the weights its session holds in memory. One process
    serves every model, so this is the per-model figure (the process's RSS is in telemetry).
    Cached: an installed model directory never changes (a new version is a new directory)."""
    total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total


def state_entry(slot: ModelSlot) -> dict[str, Any]:
    """One model as the state message lists it (``models``: the state schema's item)."""
    model = slot.service.model
    if model is None:
        return {"name": slot.name, "version": None, "sha256": None, "state": "no model"}
    return {
        "name": slot.name,
        "version": model.manifest.version,
        "sha256": model.manifest.model_sha256,
        "provider": model.provider,
        "state": "serving",
        "model_bytes": model_bytes(model.root),
        **card_entry(model),
    }


def card_entry(model: LoadedModel) -> dict[str, Any]:
    """``report_card`` of a model entry (/healthz, the state message), where the load measured one."""
    return {} if model.report_card is None else {"report_card": model.report_card.to_json()}
