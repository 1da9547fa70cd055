"""The small JSON Schema validator names the offending key and refuses unknown keywords."""

from __future__ import annotations

import pytest

from edgepack_core.errors import SchemaError
from edgepack_core.schema import Validator, json_integers, validate

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "mode": {"enum": ["a", "b"]},
        "nested": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"items": {"type": "array", "items": {"type": "number"}}},
        },
        "either": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {"x": {"type": "integer"}},
                                                  "additionalProperties": False}]},
    },
}


@pytest.mark.parametrize(
    ("document", "path", "problem"),
    [
        ({}, "name", "is required"),
        ({"name": "x", "colour": 1}, "colour", "unknown key"),
        ({"name": "x", "port": "80"}, "port", "expected integer, got string"),
        ({"name": "x", "port": True}, "port", "expected integer, got boolean"),
        ({"name": "x", "port": 70000}, "port", "above the maximum"),
        ({"name": "x", "mode": "c"}, "mode", "is not one of"),
        ({"name": "x", "nested": {"items": [1, "two"]}}, "nested.items[1]", "expected number"),
        ({"name": "x", "nested": {"bogus": 1}}, "nested.bogus", "unknown key"),
        ({"name": "x", "either": {"x": "s"}}, "either.x", "expected integer"),
    ],
)
def test_errors_name_the_offending_key(document, path, problem):
    with pytest.raises(SchemaError) as caught:
        validate(document, SCHEMA, document="doc.yaml")
    assert caught.value.path == path
    assert problem in caught.value.problem
    assert str(caught.value).startswith(f"doc.yaml: {path}: ")


def test_valid_document_passes():
    validate({"name": "x", "port": 1883, "mode": "a", "nested": {"items": [1, 2.5]}, "either": {"x": 1}}, SCHEMA)


def test_schema_with_unsupported_keyword_is_refused():
    with pytest.raises(ValueError, match="unsupported keyword"):
        Validator({"type": "object", "patternProperties": {}})


def test_name_with_a_trailing_newline_is_refused_by_a_dollar_anchored_pattern():
    """Python's ``$`` matches before a final newline; JSON Schema's does not."""
    schema = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"}
    validate("model-1", schema)
    with pytest.raises(SchemaError, match="does not match"):
        validate("model-1\n", schema)
    validate("cost$", {"type": "string", "pattern": r"\$$"})  # an escaped dollar stays a literal


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused_even_without_bounds(value):
    with pytest.raises(SchemaError, match="not a finite number"):
        validate(value, {"type": "number"})
    with pytest.raises(SchemaError, match="not a finite number"):
        validate({"t": value}, {"type": "object", "properties": {"t": {"type": "number", "minimum": 0}}})


def test_an_integral_float_where_an_integer_is_asked_is_that_integer_and_nothing_else_changes():
    """JSON's 7978.0 is the integer 7978 (JSON Schema says so); a fraction, a float where a
    number is asked, a boolean and an infinity stay as they were, so the validator judges them."""
    schema = {"type": "object", "properties": {
        "lines": {"type": "integer", "maximum": 10},
        "since": {"type": "number"},
        "waves": {"type": "array", "items": {"type": "integer"}},
        "nested": {"type": "object", "properties": {"n": {"type": "integer"}}},
    }}
    got = json_integers({"lines": 10.0, "since": 3.0, "waves": [1.0, 2.5, True], "nested": {"n": -0.0},
                         "other": 4.0}, schema)
    assert got == {"lines": 10, "since": 3.0, "waves": [1, 2.5, True], "nested": {"n": 0}, "other": 4.0}
    assert [type(v) for v in (got["lines"], got["since"], got["waves"][0], got["nested"]["n"], got["other"])] == [
        int, float, int, int, float]
    validate(json_integers({"lines": 10.0, "waves": [1.0, 2.0]}, schema), schema)  # the limit passes
    with pytest.raises(SchemaError, match="lines"):  # the bound still holds: 11.0 is 11
        validate(json_integers({"lines": 11.0}, schema), schema)
    assert json_integers(float("inf"), {"type": "integer"}) == float("inf")
    with pytest.raises(SchemaError, match="expected integer"):
        validate(json_integers({"lines": 9.5}, schema), schema)
