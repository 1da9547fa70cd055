"""A small JSON Schema validator for the subset Edgepack's own schemas use.

Why not the ``jsonschema`` package: the device side validates agent.yaml and MQTT commands
too, and must stay light (jsonschema pulls in attrs, referencing and a Rust extension).
The schemas themselves stay standard JSON Schema (draft 2020-12 keywords), so editors can
use the published files; this module only implements the keywords they contain and refuses
any other keyword, so a schema cannot silently ask for a check that is not made.

Supported: type, properties, required, additionalProperties (bool or schema), items,
minItems, maxItems, enum, const, minimum, maximum, exclusiveMinimum, minLength, maxLength,
pattern, oneOf, anyOf, $ref to ``#/$defs/...``, plus the annotations description, title,
default, examples, $schema, $id, $defs.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from edgepack_core.errors import SchemaError

_ANNOTATIONS = {"description", "title", "default", "examples", "$schema", "$id", "$defs", "$comment"}
_CHECKS = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength",
    "pattern", "oneOf", "anyOf", "$ref",
}

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list, tuple),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _type_ok(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[name])


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    for name in ("object", "array", "string", "integer", "number"):
        if _type_ok(value, name):
            return name
    return type(value).__name__


@functools.lru_cache(maxsize=256)
def ecma_pattern(pattern: str) -> re.Pattern[str]:
    """A JSON Schema (ECMA 262) pattern as a Python regex. Why: in ECMA ``$`` matches only at
    the very end, while Python's ``$`` also matches before a final newline, so ``^[a-z]+$``
    would accept ``"name\\n"`` (a name that later becomes a path or a log line)."""
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class Validator:
    """Validates documents against one root schema; ``$ref``s resolve inside that root."""

    def __init__(self, schema: Mapping[str, Any], *, document: str = "") -> None:
        self.root = schema
        self.document = document
        self._check_schema(schema, "#")

    def _check_schema(self, schema: Any, where: str) -> None:
        if not isinstance(schema, Mapping):
            return
        unknown = set(schema) - _ANNOTATIONS - _CHECKS
        if unknown:
            raise ValueError(f"schema at {where} uses unsupported keyword(s) {sorted(unknown)}")
        for key in ("properties", "$defs"):
            for name, sub in schema.get(key, {}).items():
                self._check_schema(sub, f"{where}/{key}/{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), Mapping):
                self._check_schema(schema[key], f"{where}/{key}")
        for key in ("oneOf", "anyOf"):
            for i, sub in enumerate(schema.get(key, [])):
                self._check_schema(sub, f"{where}/{key}/{i}")

    def _fail(self, path: str, problem: str) -> SchemaError:
        return SchemaError(path, problem, document=self.document)

    def _resolve(self, ref: str) -> Mapping[str, Any]:
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref {ref}")
        resolved: Mapping[str, Any] = self.root["$defs"][ref[len("#/$defs/"):]]
        return resolved

    def validate(self, value: Any, schema: Mapping[str, Any] | None = None, path: str = "") -> None:
        """Raise :class:`SchemaError` naming the first offending key path, or return None."""
        schema = self.root if schema is None else schema
        if "$ref" in schema:
            schema = self._resolve(schema["$ref"])
        self._check_kind(value, schema, path)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._check_number(value, schema, path)
        elif isinstance(value, str):
            self._check_string(value, schema, path)
        elif isinstance(value, (list, tuple)):
            self._check_array(value, schema, path)
        elif isinstance(value, dict):
            self._validate_object(value, schema, path)

        if "oneOf" in schema or "anyOf" in schema:
            self._check_options(value, schema.get("oneOf", []) or schema.get("anyOf", []), path)

    def _check_kind(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        """``type``, ``const`` and ``enum``: what any value is held to before its own kind's rules."""
        if "type" in schema:
            names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(_type_ok(value, n) for n in names):
                raise self._fail(path, f"expected {' or '.join(names)}, got {_describe(value)}")
        if "const" in schema and value != schema["const"]:
            raise self._fail(path, f"must be {schema['const']!r}")
        if "enum" in schema and value not in schema["enum"]:
            choices = ", ".join(repr(c) for c in schema["enum"])
            raise self._fail(path, f"{value!r} is not one of {choices}")

    def _check_number(self, value: float, schema: Mapping[str, Any], path: str) -> None:
        # JSON has no NaN or infinity, but Python's json and YAML's .nan/.inf produce them,
        # and NaN slips past every minimum/maximum comparison.
        if not math.isfinite(value):
            raise self._fail(path, f"{value} is not a finite number")
        if "minimum" in schema and value < schema["minimum"]:
            raise self._fail(path, f"{value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise self._fail(path, f"{value} is above the maximum {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise self._fail(path, f"{value} must be greater than {schema['exclusiveMinimum']}")

    def _check_string(self, value: str, schema: Mapping[str, Any], path: str) -> None:
        if "minLength" in schema and len(value) < schema["minLength"]:
            raise self._fail(path, f"must be at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise self._fail(path, f"must be at most {schema['maxLength']} characters")
        if "pattern" in schema and not ecma_pattern(schema["pattern"]).search(value):
            raise self._fail(path, f"{value!r} does not match {schema['pattern']}")

    def _check_array(self, value: list[Any] | tuple[Any, ...], schema: Mapping[str, Any], path: str) -> None:
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise self._fail(path, f"needs at least {schema['minItems']} item(s)")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise self._fail(path, f"takes at most {schema['maxItems']} item(s)")
        if "items" in schema:
            for i, item in enumerate(value):
                self.validate(item, schema["items"], _join(path, i))

    def _check_options(self, value: Any, options: list[Mapping[str, Any]], path: str) -> None:
        errors: list[tuple[bool, SchemaError]] = []
        for option in options:
            try:
                self.validate(value, option, path)
            except SchemaError as err:
                errors.append((self._discriminated(value, option), err))
            else:
                return
        # Report the error of the option the document meant (its ``const`` discriminator,
        # e.g. ``kind``, matched), else of the option that got furthest (deepest key path).
        raise max(errors, key=lambda pair: (pair[0], len(pair[1].path)))[1]

    def _discriminated(self, value: Any, option: Mapping[str, Any]) -> bool:
        """True when ``option`` has ``const`` properties and ``value`` matches all of them."""
        if "$ref" in option:
            option = self._resolve(option["$ref"])
        consts = {k: v["const"] for k, v in option.get("properties", {}).items() if "const" in v}
        return bool(consts) and isinstance(value, dict) and all(value.get(k) == c for k, c in consts.items())

    def _validate_object(self, value: dict[str, Any], schema: Mapping[str, Any], path: str) -> None:
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                raise self._fail(_join(path, key), "is required")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if not isinstance(key, str):
                raise self._fail(path, f"key {key!r} must be a string")
            if key in properties:
                self.validate(item, properties[key], _join(path, key))
            elif extra is False:
                known = ", ".join(sorted(properties)) or "none"
                raise self._fail(_join(path, key), f"unknown key (known keys: {known})")
            elif isinstance(extra, Mapping):
                self.validate(item, extra, _join(path, key))


def json_integers(value: Any, schema: Mapping[str, Any]) -> Any:
    """``value`` with each integral float where ``schema`` asks for an integer made an ``int``
    (through properties and items, no ``$ref``): JSON's ``5.0`` is the integer 5 (JSON Schema
    says so), yet Python reads it as a float, which the validator's ``integer`` refuses."""
    if schema.get("type") == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    properties, items = schema.get("properties"), schema.get("items")
    if isinstance(value, dict) and isinstance(properties, Mapping):
        return {key: json_integers(item, properties.get(key, {})) for key, item in value.items()}
    if isinstance(value, list) and isinstance(items, Mapping):
        return [json_integers(item, items) for item in value]
    return value


def validate(value: Any, schema: Mapping[str, Any], *, document: str = "") -> None:
    """Validate ``value`` against ``schema``; raise :class:`SchemaError` with the key path."""
    Validator(schema, document=document).validate(value)


def validate_by_kind(spec: Any, by_kind: Mapping[str, Mapping[str, Any]], schema: Mapping[str, Any], *,
                     document: str = "", path: str = "") -> dict[str, Any]:
    """Validate a spec whose ``kind`` picks a schema: check against that kind's schema first
    (its errors name the precise key), then against the whole schema. Returns a deep copy."""
    raw = copy.deepcopy(dict(spec)) if isinstance(spec, Mapping) else spec
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if isinstance(kind, str) and kind in by_kind:
        Validator(by_kind[kind], document=document).validate(raw, None, path)
    Validator(schema, document=document).validate(raw, None, path)
    return raw
