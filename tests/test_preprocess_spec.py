"""The typed preprocessing spec (edgepack_core/preprocess_spec.py): parsed once, frozen, and
written back to the manifest's JSON form unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from edgepack_core.errors import ManifestError
from edgepack_core.manifest import canonical_bytes, check_manifest
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import PreprocessSpec, Resize, normalize_preprocess, parse_preprocess
from sdk.recipe import recipe_from_dict

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def _manifest(preprocess: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": 1,
        "name": "m",
        "version": "1.0.0",
        "created": "2026-01-01T00:00:00Z",
        "files": {"model.onnx": {"size": 1, "sha256": "0" * 64}},
        "model": {"path": "model.onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 3, 4, 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [1, 2]}],
        "preprocess": preprocess,
    }


def test_a_spec_is_frozen() -> None:
    spec = parse_preprocess({"kind": "image", "resize": {"size": [4, 4]}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.scale = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.resize.size = (8, 8)  # type: ignore[misc,union-attr]


def test_parsing_a_typed_spec_returns_it_and_json_round_trips() -> None:
    spec = parse_preprocess({"kind": "image", "color": "gray", "resize": {"size": [8, 6], "mode": "letterbox"}})
    assert parse_preprocess(spec) is spec
    assert parse_preprocess(spec.to_json()) == spec
    assert spec.resize == Resize((8, 6), mode="letterbox")
    assert (spec.channels, spec.mean, spec.std, spec.batch, spec.dtype) == (1, (0.0,), (1.0,), True, "float32")


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_spec_is_its_own_normal_form(recipe: Path) -> None:
    """What a manifest stores parses back to the same value and the same bytes (a device
    parses exactly what the packager wrote)."""
    section = yaml.safe_load(recipe.read_text()).get("preprocess")
    spec = parse_preprocess(section)
    stored = spec.to_json()
    assert parse_preprocess(stored) == spec
    assert canonical_bytes(normalize_preprocess(stored)) == canonical_bytes(stored)


def test_a_recipe_holds_the_typed_spec(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    document = {
        "name": "m",
        "version": "1.0.0",
        "model": {"path": "m.onnx"},
        "validate": {"data": "synthetic"},
        "inputs": {"x": {"role": "image"}},
        "preprocess": {"kind": "image", "scale": 0.5},
    }
    recipe = recipe_from_dict(document, tmp_path)
    assert isinstance(recipe.preprocess, PreprocessSpec)
    assert (recipe.preprocess.scale, recipe.preprocess.input) == (0.5, "x")  # the role's input filled in once
    bare = recipe_from_dict({k: v for k, v in document.items() if k not in ("inputs", "preprocess")}, tmp_path)
    assert bare.preprocess == PreprocessSpec() and bare.preprocess.kind == "tensor"


def test_the_verified_manifest_is_parsed_once_and_its_cross_field_rules_hold() -> None:
    manifest = check_manifest(_manifest({"kind": "image", "mean": [0.1, 0.2, 0.3]}))
    assert manifest.preprocess is manifest.preprocess  # parsed once, at verification
    assert Preprocessor(manifest.preprocess).spec is manifest.preprocess
    with pytest.raises(ManifestError, match=r"preprocess\.mean: has 2 value\(s\) but color rgb has 3"):
        check_manifest(_manifest({"kind": "image", "mean": [0.1, 0.2]}))
    with pytest.raises(ManifestError, match=r"preprocess\.in_graph"):
        check_manifest(_manifest({"kind": "image", "dtype": "uint8", "in_graph": True}))
