"""The typed postprocessing spec (edgepack_core/postprocess_spec.py): parsed once, frozen, and
written back to the manifest's JSON form unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from edgepack_core.manifest import canonical_bytes
from edgepack_core.postprocess import Postprocessor
from edgepack_core.postprocess_spec import DetectionOutputs, PostprocessSpec, normalize_postprocess, parse_postprocess

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_a_spec_is_frozen_and_a_typed_spec_parses_to_itself() -> None:
    spec = parse_postprocess({"kind": "detection", "format": "boxes_scores", "outputs": {"boxes": "b", "scores": "s"}})
    assert spec.outputs == DetectionOutputs("b", "s")
    assert parse_postprocess(spec) is spec and Postprocessor(spec).spec is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.k = 3  # type: ignore[misc]


def test_values_keep_their_json_type_so_the_manifest_bytes_do_not_change() -> None:
    """A threshold written as 0 stays the integer 0 in the manifest (as before the typed spec)."""
    stored = normalize_postprocess({"kind": "detection", "score_threshold": 0, "iou_threshold": 1})
    assert canonical_bytes(stored) == canonical_bytes(
        {
            "kind": "detection",
            "version": 1,
            "format": "yolov8",
            "score_threshold": 0,
            "iou_threshold": 1,
            "max_detections": 100,
            "labels": None,
        }
    )


def test_an_unresolved_apply_softmax_is_none_and_reads_as_true() -> None:
    """The packager resolves it from the graph (it must know the recipe left it out); an
    executor, like a manifest without the key, takes softmax probabilities."""
    spec = parse_postprocess({"kind": "topk"})
    assert spec.apply_softmax is None and spec.softmax is True
    assert spec.to_json()["apply_softmax"] is True
    assert parse_postprocess({"kind": "ctc", "apply_softmax": False}).softmax is False
    assert PostprocessSpec(kind="topk", apply_softmax=False).to_json()["apply_softmax"] is False


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_spec_is_its_own_normal_form(recipe: Path) -> None:
    spec = parse_postprocess(yaml.safe_load(recipe.read_text()).get("postprocess"))
    stored = spec.to_json()
    assert parse_postprocess(stored).to_json() == stored
    assert canonical_bytes(normalize_postprocess(stored)) == canonical_bytes(stored)
