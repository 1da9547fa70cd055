"""Typed options: frozen dataclasses that are also their documents' JSON Schema (recipes, pipelines).

Each pass declares the options it reads as a frozen dataclass next to it (after Olive's
per-pass configs), defaults included. Two pure functions make the rest of the packager typed:
:func:`schema_of` writes the JSON Schema of such a declaration (types, ``None`` for "not set",
enums from ``Literal``, bounds and descriptions from :func:`option`'s metadata), so the schema
a recipe is validated against cannot drift from what the passes read; :func:`parse` turns a
document already validated against that schema into the frozen value, once, at the boundary.

Why not pydantic: the recipe is validated by ``edgepack_core.schema`` (the device's light
validator, whose errors name the key path), so a second validating layer would only add a
dependency and import time; these two walks over ``dataclasses.fields`` are all that is needed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")

# Metadata keys that are JSON Schema keywords of the field's value (bounds, lengths, patterns).
_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "pattern", "minItems", "maxItems")
_PRIMITIVES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def option(
    default: Any = dataclasses.MISSING,
    *,
    description: str | None = None,
    schema: Mapping[str, Any] | None = None,
    parse: Callable[[Any], Any] | None = None,
    items: Mapping[str, Any] | None = None,
    key: str | None = None,
    **keywords: Any,
) -> Any:
    """A dataclass field with what the schema says about it: ``description``, JSON Schema
    ``keywords`` (``minimum=0``, ``pattern=...``), ``items`` (keywords of an array's items),
    or a whole ``schema`` fragment with its ``parse`` for a value the walk cannot express.
    ``key`` is the document's name of the field where it cannot be the Python name (``from``)."""
    unknown = set(keywords) - set(_KEYWORDS)
    if unknown:
        raise TypeError(f"not a schema keyword of an option: {', '.join(sorted(unknown))}")
    metadata = {"description": description, "schema": schema, "parse": parse, "items": items, "keywords": keywords,
                "key": key}
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default: use a tuple or a read-only Mapping")
    if isinstance(default, types.MappingProxyType):  # read-only, but unhashable: dataclasses want a factory
        return dataclasses.field(default_factory=lambda: default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def document_key(field: dataclasses.Field[Any]) -> str:
    """The name of ``field`` in a document: its ``key`` where one was given, else its own."""
    return str(field.metadata.get("key") or field.name)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def _without_none(tp: Any) -> Any:
    """``X | None`` -> X (None is "not set", never written in a recipe); anything else as it is."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
    return tp


def _type_schema(tp: Any) -> dict[str, Any]:
    """The schema of a value of type ``tp`` (a dataclass, Literal, tuple, Mapping, primitive)."""
    tp = _without_none(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return schema_of(tp)  # type: ignore[arg-type]
    if origin is Literal:
        return {"enum": list(args)}
    if origin is tuple:
        return {"type": "array", "items": _type_schema(args[0])}
    if origin in (Mapping, dict, typing.Mapping):
        return {"type": "object", "additionalProperties": _type_schema(args[1])}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_type_schema(a) for a in args]}
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if tp is Any:
        return {}
    raise TypeError(f"no schema for the option type {tp!r}")


def _json_default(value: Any) -> Any:
    """A default as the schema shows it; None for none worth showing (not set, a section)."""
    if isinstance(value, tuple):
        return list(value)
    return value if isinstance(value, (bool, int, float, str)) else None


def field_schema(field: dataclasses.Field[Any], tp: Any) -> dict[str, Any]:
    """One option's schema: its type's, then its metadata's keywords, default and description."""
    meta = field.metadata
    schema = dict(meta["schema"]) if meta.get("schema") is not None else _type_schema(tp)
    schema.update(meta.get("keywords") or {})
    if meta.get("items"):
        schema["items"] = {**schema["items"], **meta["items"]}
    if meta.get("schema") is None and _json_default(field.default) is not None:
        schema["default"] = _json_default(field.default)
    if meta.get("description"):
        schema["description"] = meta["description"]
    return schema


def schema_of(cls: type) -> dict[str, Any]:
    """The JSON Schema of a document section declared by the dataclass ``cls``: an object
    refusing unknown keys, a property per field (fields named in ``cls.INTERNAL`` left out),
    fields without a default required, the class's ``DESCRIPTION`` as its description."""
    hints = _hints(cls)
    internal = set(getattr(cls, "INTERNAL", ()))
    fields = [f for f in dataclasses.fields(cls) if f.name not in internal]
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False}
    if getattr(cls, "DESCRIPTION", None):
        schema["description"] = cls.DESCRIPTION  # type: ignore[attr-defined]
    required = [document_key(f) for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        schema["required"] = required
    schema["properties"] = {document_key(f): field_schema(f, hints[f.name]) for f in fields}
    return schema


def _parse_value(tp: Any, value: Any) -> Any:
    tp = _without_none(tp)
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return parse(tp, value)  # type: ignore[arg-type]
    if origin is tuple:
        return tuple(_parse_value(args[0], item) for item in value)
    if origin in (Mapping, dict, typing.Mapping):
        return types.MappingProxyType({key: _parse_value(args[1], item) for key, item in value.items()})
    if tp is float:
        return float(value)
    return value


def parse_fields(cls: type, document: Mapping[str, Any]) -> dict[str, Any]:
    """The typed value of every key of ``document`` (validated against ``schema_of(cls)``)
    that is a field of ``cls``: nested sections and lists become dataclasses and tuples."""
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if document_key(field) not in document:
            continue
        reader = field.metadata.get("parse")
        raw = document[document_key(field)]
        values[field.name] = (
            reader(raw) if reader is not None and raw is not None else _parse_value(hints[field.name], raw)
        )
    return values


def parse(cls: type[T], document: Mapping[str, Any]) -> T:
    """The frozen value of a section already validated against ``schema_of(cls)``; absent
    keys take the declared defaults."""
    return cls(**parse_fields(cls, document))


def given(value: Any) -> dict[str, Any]:
    """The options of ``value`` that differ from their defaults, as a document (for reports:
    what the recipe set). Nested dataclasses and values with ``to_json`` are written out."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        current = getattr(value, field.name)
        if field.default is not dataclasses.MISSING and current == field.default:
            continue
        out[document_key(field)] = _document(current)
    return out


def _document(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return given(value)
    if isinstance(value, tuple):
        return [_document(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _document(item) for key, item in value.items()}
    return value
