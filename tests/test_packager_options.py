"""Typed pass options (issue 22, item 1): each pass declares its options as a frozen dataclass,
the recipe's JSON Schema is generated from those declarations, and a recipe is parsed once into
typed, frozen sections that the passes read instead of the recipe's dicts."""

from __future__ import annotations

import ast
import dataclasses
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from edgepack_core.schema import validate
from sdk.errors import SchemaError
from sdk.packager.options import given, option, parse, parse_fields, schema_of
from sdk.packager.passes.quantize import QuantizeOptions
from sdk.packager.sources import DataSource, InputOptions
from sdk.recipe import RECIPE_SCHEMA, Recipe, recipe_from_dict

REPO = Path(__file__).resolve().parent.parent
PACKAGER = REPO / "sdk" / "packager"


@dataclass(frozen=True)
class _Inner:
    flag: bool = option(True, description="a flag")


@dataclass(frozen=True)
class _Planted:
    DESCRIPTION = "a planted section"

    size: int = option(description="required: no default", minimum=1, maximum=8)
    mode: Literal["a", "b"] = option("a", description="an enum")
    ratio: float | None = option(None, exclusiveMinimum=0)
    names: tuple[str, ...] = option(("x",), items={"minLength": 1})
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    by_name: dict[str, int] | None = None


def test_a_declared_option_becomes_its_schema_with_type_bounds_enum_default_and_description():
    assert schema_of(_Planted) == {
        "type": "object",
        "additionalProperties": False,
        "description": "a planted section",
        "required": ["size"],
        "properties": {
            "size": {"type": "integer", "minimum": 1, "maximum": 8, "description": "required: no default"},
            "mode": {"enum": ["a", "b"], "default": "a", "description": "an enum"},
            "ratio": {"type": "number", "exclusiveMinimum": 0},
            "names": {"type": "array", "items": {"type": "string", "minLength": 1}, "default": ["x"]},
            "inner": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"flag": {"type": "boolean", "default": True, "description": "a flag"}},
            },
            "by_name": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }


def test_the_declared_bounds_are_the_validated_ones_at_the_limit_and_one_past_it():
    schema = schema_of(_Planted)
    validate({"size": 8}, schema)
    validate({"size": 1}, schema)
    for value in (0, 9):
        with pytest.raises(SchemaError, match="size"):
            validate({"size": value}, schema)
    with pytest.raises(SchemaError, match="ratio"):
        validate({"size": 1, "ratio": 0}, schema)


def test_parsing_gives_a_frozen_value_with_the_declared_defaults():
    value = parse(_Planted, {"size": 2, "ratio": 1, "names": ["p", "q"], "inner": {"flag": False}, "by_name": {"k": 1}})
    assert value == _Planted(size=2, ratio=1.0, names=("p", "q"), inner=_Inner(False), by_name={"k": 1})
    assert isinstance(value.ratio, float) and isinstance(value.names, tuple)
    assert isinstance(value.by_name, types.MappingProxyType)
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.size = 3  # type: ignore[misc]
    assert parse(_Planted, {"size": 1}).mode == "a"
    assert given(value) == {"size": 2, "ratio": 1.0, "names": ["p", "q"], "inner": {"flag": False}, "by_name": {"k": 1}}


def test_a_mutable_default_or_an_unknown_keyword_is_refused_where_the_option_is_declared():
    with pytest.raises(TypeError, match="mutable"):
        option([1])
    with pytest.raises(TypeError, match="minimun"):
        option(1, minimun=0)


def _recipe_document(**sections) -> dict:
    return {"name": "r", "version": "1.0.0", "model": {"path": "m.onnx"}, "validate": {"data": "synthetic"}, **sections}


@pytest.mark.parametrize(
    "section",
    [
        {"quantize": {"mode": "static", "bogus": 1}},
        {"validate": {"samples": 1, "bogus": 1}},
        {"golden": {"data": "synthetic", "bogus": 1}},
        {"inputs": {"x": {"bogus": 1}}},
        {"model": {"pytorch": {"factory": "m:f", "input_shape": [1], "bogus": 1}}},
        {"optimize": {"bogus": True}},
    ],
)
def test_an_unknown_key_in_any_section_is_refused_naming_it(section):
    with pytest.raises(SchemaError, match="bogus"):
        validate(_recipe_document(**section), RECIPE_SCHEMA)


@pytest.mark.parametrize(("value", "ok"), [(1, True), (50, True), (0, False), (51, False)])
def test_the_search_budget_bound_declared_on_the_quantize_options_holds_at_its_limits(value, ok):
    document = _recipe_document(quantize={"max_candidates": value})
    if ok:
        validate(document, RECIPE_SCHEMA)
        assert parse(QuantizeOptions, document["quantize"]).max_candidates == value
    else:
        with pytest.raises(SchemaError, match=r"quantize\.max_candidates"):
            validate(document, RECIPE_SCHEMA)


def test_a_recipe_is_parsed_once_into_typed_frozen_sections(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"")
    (tmp_path / "d.npz").write_bytes(b"")
    recipe = recipe_from_dict(
        _recipe_document(
            inputs={"x": {"shape": [1, "n"], "range": [0, 2]}, "k": {"role": "constant", "value": 3}},
            quantize={"mode": "dynamic", "exclude_nodes": ["a*"], "calibration": {"npz": "d.npz", "limit": 5}},
            validate={"data": {"npz": "d.npz", "sample_axis": {"x": None}}, "max_drop": 0},
            targets=["rpi"],
        ),
        tmp_path,
    )
    assert recipe.targets == ("rpi",)
    assert recipe.inputs["x"] == InputOptions(shape=(1, "n"), range=(0.0, 2.0))
    assert recipe.inputs["k"].role == "constant" and recipe.inputs["k"].sample_axis == "auto"
    assert recipe.quantize.exclude_nodes == ("a*",) and recipe.quantize.max_candidates == 10
    assert recipe.quantize.calibration == DataSource("npz", str(tmp_path / "d.npz"), limit=5)
    assert recipe.validate.data is not None and dict(recipe.validate.data.sample_axis) == {"x": None}
    assert recipe.validate.budget() == {"max_drop": 0.0}
    assert recipe.optimize.fold_batchnorm and recipe.golden.count == 4 and recipe.sign.key is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.quantize.mode = "static"  # type: ignore[misc]


def _shipped_recipes() -> list[Path]:
    return sorted([*(REPO / "recipes").glob("*.yaml"), *(REPO / "recipes" / "templates").glob("*.yaml")])


@pytest.mark.parametrize("path", _shipped_recipes(), ids=lambda p: p.name)
def test_every_shipped_recipe_and_template_parses_into_the_typed_sections(path):
    document = yaml.safe_load(path.read_text())
    validate(document, RECIPE_SCHEMA)
    sections = parse_fields(Recipe, document)
    for key in document:
        assert key in sections, key
    for source in (sections.get("validate"), sections.get("golden")):
        assert source is None or source.data is None or isinstance(source.data, DataSource)


def _recipe_reads(tree: ast.AST) -> list[str]:
    """Reads of ``X.recipe.data`` or ``X.recipe.section(...)`` in a module."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("data", "section")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "recipe"
        ):
            found.append(f"recipe.{node.attr} (line {node.lineno})")
    return found


def test_no_pass_reads_the_recipe_document_only_its_typed_sections():
    modules = [*PACKAGER.glob("*.py"), *(PACKAGER / "passes").glob("*.py")]
    reads = {str(path.relative_to(REPO)): _recipe_reads(ast.parse(path.read_text())) for path in modules}
    assert {path: found for path, found in reads.items() if found} == {}
    planted = ast.parse("def f(ctx):\n    return ctx.recipe.data['model'], ctx.recipe.section('quantize')\n")
    assert len(_recipe_reads(planted)) == 2
