"""CTC greedy decoding (pure) against hand-computed references: the blank and charset
conventions (PaddleOCR's blank 0, a blank last), scores of probabilities and of logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgepack_core.errors import PostprocessError, SchemaError
from edgepack_core.postprocess import Postprocessor, ctc_greedy, load_charset
from edgepack_core.postprocess_spec import normalize_postprocess

# Classes: 0 blank, 1 "a", 2 "b", 3 "c" (PaddleOCR's convention). Argmax per step:
# a a blank a b blank -> "a" (repeat collapsed) "a" (after a blank) "b" = "aab"
PROBS = np.array([
    [0.10, 0.70, 0.10, 0.10],
    [0.10, 0.60, 0.20, 0.10],
    [0.80, 0.10, 0.05, 0.05],
    [0.20, 0.50, 0.20, 0.10],
    [0.05, 0.05, 0.90, 0.00],
    [0.40, 0.30, 0.20, 0.10],
], dtype=np.float32)
KEPT_MAXIMA = [0.70, 0.50, 0.90]  # steps 0, 3 and 4


def test_ctc_defaults_are_written_out_and_idempotent() -> None:
    spec = normalize_postprocess({"kind": "ctc", "charset": "assets/charset.txt"})
    assert spec == {"kind": "ctc", "version": 1, "blank": 0, "charset": "assets/charset.txt", "append_space": False,
                    "layout": "NTC", "apply_softmax": True}
    assert normalize_postprocess(spec) == spec


@pytest.mark.parametrize(
    ("spec", "path", "fragment"),
    [({"kind": "ctc", "blank": -1}, "blank", "below the minimum"),
     ({"kind": "ctc", "layout": "NCT"}, "layout", "not one of"),
     ({"kind": "ctc", "k": 1}, "k", "unknown key"),
     ({"kind": "ctc", "labels": "l.txt"}, "labels", "unknown key")],
)
def test_bad_ctc_spec_is_refused_naming_the_key(spec: dict, path: str, fragment: str) -> None:
    with pytest.raises(SchemaError) as info:
        normalize_postprocess(spec, path="postprocess")
    assert info.value.path == f"postprocess.{path}" and fragment in info.value.problem


def test_greedy_decode_of_probabilities_hand_computed() -> None:
    result = Postprocessor({"kind": "ctc", "apply_softmax": False}, charset=["a", "b", "c"])({"y": PROBS[None]})
    assert result["text"] == "aab"
    assert result["score"] == pytest.approx(sum(KEPT_MAXIMA) / 3, rel=1e-6)


def test_greedy_decode_of_logits_scores_their_softmax() -> None:
    logits = np.log(PROBS + 1e-3) * 2.5  # same argmax per step, different maxima after softmax
    result = Postprocessor({"kind": "ctc"}, charset=["a", "b", "c"])({"y": logits[None]})
    expected = []
    for step in (0, 3, 4):
        exps = [math.exp(float(v)) for v in logits[step]]
        expected.append(max(exps) / sum(exps))
    assert result == {"text": "aab", "score": pytest.approx(sum(expected) / 3, rel=1e-9)}


def test_blank_last_maps_classes_to_lines_directly() -> None:
    # move the blank column to the end: classes 0 "a", 1 "b", 2 "c", 3 blank
    probs = PROBS[:, [1, 2, 3, 0]]
    assert ctc_greedy(probs, 3, ["a", "b", "c"], apply_softmax=False)["text"] == "aab"
    # blank in the middle: classes 0 "a", 1 blank, 2 "b", 3 "c"
    probs = PROBS[:, [1, 0, 2, 3]]
    assert ctc_greedy(probs, 1, ["a", "b", "c"], apply_softmax=False)["text"] == "aab"


def test_nothing_but_blanks_is_empty_text_with_score_zero() -> None:
    probs = np.tile([[0.9, 0.05, 0.05]], (5, 1))
    assert ctc_greedy(probs, 0, ["x", "y"], apply_softmax=False) == {"text": "", "score": 0.0}


def test_a_batch_and_the_steps_first_layout() -> None:
    other = PROBS[:, [0, 3, 2, 1]]  # a<->c swapped: "ccb"
    batch = np.stack([PROBS, other])
    spec = {"kind": "ctc", "apply_softmax": False}
    assert [r["text"] for r in Postprocessor(spec, charset=list("abc"))({"y": batch})] == ["aab", "ccb"]
    tnc = {**spec, "layout": "TNC"}
    assert [r["text"] for r in Postprocessor(tnc, charset=list("abc"))({"y": batch.transpose(1, 0, 2)})] == [
        "aab", "ccb"]
    assert Postprocessor(tnc, charset=list("abc"))({"y": PROBS})["text"] == "aab"  # [T, C]: one sample


def test_without_a_charset_class_indices_are_shown() -> None:
    assert ctc_greedy(PROBS, 0, None, apply_softmax=False)["text"] == "[1][1][2]"


def test_charset_of_the_wrong_size_is_one_error() -> None:
    with pytest.raises(PostprocessError, match=r"charset has 4 symbols but the output has 4 classes"):
        ctc_greedy(PROBS, 0, list("abcd"), apply_softmax=False)
    with pytest.raises(PostprocessError, match="blank 4 is not a class"):
        ctc_greedy(PROBS, 4, list("abc"), apply_softmax=False)
    with pytest.raises(PostprocessError, match="must be"):
        Postprocessor({"kind": "ctc"})({"y": np.zeros((1, 2, 3, 4), np.float32)})


def test_charset_file_lines_are_symbols_exactly() -> None:
    assert load_charset("\ufeffa\r\n \nb\n") == ["a", " ", "b"]  # a space line is a symbol
    assert load_charset("a\nb") == ["a", "b"]
    assert load_charset("a\nb\n", append_space=True) == ["a", "b", " "]
    assert load_charset("") == []
