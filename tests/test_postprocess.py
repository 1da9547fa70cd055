"""The postprocessing spec: softmax and top-k against plain numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgepack_core.errors import SchemaError
from edgepack_core.postprocess import (
    PostprocessError,
    Postprocessor,
    load_labels,
)
from edgepack_core.postprocess_spec import POSTPROCESS_SCHEMA, normalize_postprocess
from edgepack_core.schema import validate

RNG = np.random.default_rng(7)


def _reference_softmax(row: np.ndarray) -> np.ndarray:
    exps = np.array([math.exp(float(v)) for v in row])
    return exps / exps.sum()


# ----------------------------------------------------------------------------- spec


def test_defaults_are_written_out_and_idempotent() -> None:
    assert normalize_postprocess(None) == {"kind": "raw", "version": 1}
    assert normalize_postprocess({"kind": "softmax", "output": "probs"}) == {
        "kind": "softmax", "version": 1, "output": "probs"}
    topk = normalize_postprocess({"kind": "topk", "labels": "assets/labels.txt"})
    assert topk == {"kind": "topk", "version": 1, "k": 5, "apply_softmax": True, "labels": "assets/labels.txt"}
    assert normalize_postprocess(topk) == topk
    assert normalize_postprocess({"kind": "topk"})["labels"] is None


@pytest.mark.parametrize(
    ("spec", "path", "fragment"),
    [
        ({"kind": "softmax", "k": 3}, "k", "unknown key"),
        ({"kind": "raw", "labels": "labels.txt"}, "labels", "unknown key"),
        ({"kind": "topk", "k": 0}, "k", "below the minimum"),
        ({"kind": "topk", "lables": "x"}, "lables", "unknown key"),
        ({"kind": "argmax"}, "kind", "not one of"),
        ({}, "kind", "is required"),
    ],
)
def test_bad_spec_is_refused_naming_the_key(spec: dict, path: str, fragment: str) -> None:
    with pytest.raises(SchemaError) as info:
        normalize_postprocess(spec, path="postprocess")
    assert info.value.path == f"postprocess.{path}"
    assert fragment in info.value.problem


def test_schema_embeds_in_other_schemas() -> None:
    outer = {"type": "object", "properties": {"postprocess": POSTPROCESS_SCHEMA}}
    validate({"postprocess": {"kind": "topk", "k": 2, "labels": "labels.txt", "apply_softmax": False}}, outer)
    with pytest.raises(SchemaError) as info:
        validate({"postprocess": {"kind": "topk", "k": "two"}}, outer)
    assert info.value.path == "postprocess.k"


# ----------------------------------------------------------------------------- softmax


def test_softmax_sums_to_one_and_matches_the_reference() -> None:
    logits = RNG.standard_normal((4, 10)).astype(np.float32) * 3
    result = Postprocessor({"kind": "softmax"})({"logits": logits})
    assert isinstance(result, list) and len(result) == 4
    for row, probabilities in zip(logits, result, strict=True):
        assert all(isinstance(p, float) for p in probabilities)
        assert math.isclose(sum(probabilities), 1.0, abs_tol=1e-12)
        np.testing.assert_allclose(probabilities, _reference_softmax(row), rtol=1e-9)


def test_softmax_of_one_sample_is_a_flat_list() -> None:
    logits = RNG.standard_normal(6)
    for output in (logits, logits[None, :]):
        result = Postprocessor({"kind": "softmax"})({"y": output})
        assert isinstance(result[0], float)
        np.testing.assert_allclose(result, _reference_softmax(logits), rtol=1e-9)


def test_softmax_is_stable_with_huge_logits() -> None:
    logits = np.array([[1e4, 1e4 - 1.0, -1e4, 0.0]], dtype=np.float32)
    result = Postprocessor({"kind": "softmax"})({"y": logits})
    assert all(math.isfinite(p) for p in result)
    shifted = _reference_softmax(np.array([0.0, -1.0, -2e4, -1e4]))
    np.testing.assert_allclose(result, shifted, rtol=1e-12, atol=1e-300)
    assert math.isclose(sum(result), 1.0, abs_tol=1e-12)


# ----------------------------------------------------------------------------- topk


def test_topk_orders_by_score_with_labels() -> None:
    logits = np.array([[0.1, 2.0, -1.0, 1.5, 0.3]])
    labels = ["zero", "one", "two", "three", "four"]
    result = Postprocessor({"kind": "topk", "k": 3}, labels)({"y": logits})
    probabilities = _reference_softmax(logits[0])
    assert [r["index"] for r in result] == [1, 3, 4]
    assert [r["label"] for r in result] == ["one", "three", "four"]
    np.testing.assert_allclose([r["score"] for r in result], probabilities[[1, 3, 4]], rtol=1e-9)
    assert all(type(r["index"]) is int and type(r["score"]) is float for r in result)


def test_topk_ties_go_to_the_lower_index_and_k_is_capped() -> None:
    result = Postprocessor({"kind": "topk", "k": 10})({"y": np.array([1.0, 3.0, 3.0, 1.0])})
    assert [r["index"] for r in result] == [1, 2, 0, 3]
    # Enough equal scores that an unstable sort would shuffle them.
    scores = np.zeros(200)
    scores[::7] = 1.0
    result = Postprocessor({"kind": "topk", "k": 12, "apply_softmax": False})({"y": scores})
    assert [r["index"] for r in result] == list(range(0, 84, 7))


def test_topk_without_softmax_reports_raw_values_and_missing_labels_as_none() -> None:
    scores = np.array([[0.2, 0.7, 0.1]], dtype=np.float32)
    result = Postprocessor({"kind": "topk", "k": 2, "apply_softmax": False}, ["a"])({"y": scores})
    assert result == [{"index": 1, "label": None, "score": pytest.approx(0.7)},
                      {"index": 0, "label": "a", "score": pytest.approx(0.2)}]


def test_topk_for_a_batch_gives_one_list_per_row() -> None:
    logits = np.array([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]])
    result = Postprocessor({"kind": "topk", "k": 1})({"y": logits})
    assert [[r["index"] for r in row] for row in result] == [[1], [0]]


def test_classifier_heads_with_trailing_unit_dims_are_flattened() -> None:
    logits = np.zeros((1, 7, 1, 1), dtype=np.float32)
    logits[0, 4] = 3.0
    result = Postprocessor({"kind": "topk", "k": 1})({"y": logits})
    assert result[0]["index"] == 4


def test_topk_is_stable_with_huge_logits() -> None:
    result = Postprocessor({"kind": "topk", "k": 2})({"y": np.array([[-1e4, 1e4, 1e4 - 2.0]])})
    assert [r["index"] for r in result] == [1, 2]
    assert result[0]["score"] == pytest.approx(1 / (1 + math.exp(-2.0)), rel=1e-12)


# ----------------------------------------------------------------------------- outputs and labels


def test_raw_gives_none() -> None:
    assert Postprocessor(None)({"y": np.ones(3)}) is None


def test_named_output_is_read_and_a_missing_one_is_an_error() -> None:
    outputs = {"features": np.array([[9.0, 0.0]]), "logits": np.array([[0.0, 9.0]])}
    assert Postprocessor({"kind": "topk", "k": 1, "output": "logits"})(outputs)[0]["index"] == 1
    assert Postprocessor({"kind": "topk", "k": 1})(outputs)[0]["index"] == 0  # first output by default
    with pytest.raises(PostprocessError, match="no model output named 'probs' \\(outputs: features, logits\\)"):
        Postprocessor({"kind": "softmax", "output": "probs"})(outputs)


@pytest.mark.parametrize("output", [np.float32(1.0), np.zeros((0,)), np.zeros((2, 0))], ids=["scalar", "empty",
                                                                                             "no-classes"])
def test_outputs_without_class_scores_are_refused(output: np.ndarray) -> None:
    with pytest.raises(PostprocessError, match="holds no class scores"):
        Postprocessor({"kind": "softmax"})({"y": output})


def test_load_labels_keeps_line_positions() -> None:
    text = "\ufeffcat\r\ndog  \n\nbird\n\n\n"
    assert load_labels(text) == ["cat", "dog", "", "bird"]
    assert load_labels("") == []
