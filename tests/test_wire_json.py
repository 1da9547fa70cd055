"""The wire encoding of model outputs (pure): strict JSON by one convention, exact npz, and the
/predict media-type choice."""

from __future__ import annotations

import io
import json
import math

import ml_dtypes
import numpy as np
import pytest

from device_agent.http.negotiation import MAX_ACCEPT_CHARS, choose_answer_type
from edgepack_core.errors import EdgepackError
from edgepack_core.wire_json import (
    NPZ_MEDIA_TYPE,
    WireEncodingError,
    array_to_wire,
    dumps,
    from_wire,
    npz_bytes,
    to_wire,
)


def strict_loads(data: bytes) -> object:
    """A parser as strict as JavaScript's JSON.parse: NaN/Infinity tokens are refused."""

    def refuse(token: str) -> None:
        raise ValueError(f"non-JSON token {token}")

    return json.loads(data, parse_constant=refuse)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_non_finite_floats_become_the_documented_strings_in_every_float_dtype(dtype):
    array = np.array([[1.5, np.nan], [np.inf, -np.inf]]).astype(dtype)
    assert array_to_wire(array) == [[1.5, "NaN"], ["Infinity", "-Infinity"]]
    assert strict_loads(dumps({"y": array})) == {"y": [[1.5, "NaN"], ["Infinity", "-Infinity"]]}


def test_finite_floats_keep_their_exact_value_and_zero_d_tensors_are_scalars():
    value = np.float32(0.1)
    assert to_wire(np.array([value])) == [float(value)]  # the float32's exact value, not 0.1
    assert to_wire(np.array(np.nan, np.float32)) == "NaN"
    assert to_wire(np.array(-2.5, np.float64)) == -2.5
    assert to_wire(np.float32("-inf")) == "-Infinity"
    assert to_wire(float("inf")) == "Infinity" and to_wire(1e308) == 1e308


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.array([2**63 - 1, -(2**63)], np.int64), [9223372036854775807, -9223372036854775808]),
        (np.array([2**64 - 1], np.uint64), [18446744073709551615]),
        (np.array([2**53 + 1], np.int64), [9007199254740993]),  # not a float64: ints are never floats
        (np.array([[True, False]]), [[True, False]]),
        (np.array(7, np.int8), 7),
    ],
)
def test_integers_and_booleans_stay_typed_to_the_last_digit(array, expected):
    encoded = to_wire(array)
    assert encoded == expected
    decoded = strict_loads(dumps(encoded))
    flat = decoded if isinstance(decoded, list) else [decoded]
    while flat and isinstance(flat[0], list):
        flat = [v for row in flat for v in row]
    assert all(type(v) is type(e) for v, e in zip(flat, np.asarray(expected).ravel().tolist(), strict=True))
    assert decoded == expected


def test_strings_stay_strings_even_when_they_read_nan():
    array = np.array([["NaN", b"caf\xc3\xa9"], [b"\xff", "x"]], dtype=object)
    assert to_wire(array) == [["NaN", "café"], ["\ufffd", "x"]]
    assert to_wire(np.array(["a", "bc"])) == ["a", "bc"]
    assert to_wire(np.array([b"a"], dtype="S1")) == ["a"]
    assert strict_loads(dumps(np.array(["NaN"], dtype=object))) == ["NaN"]


def test_dumps_never_writes_a_bare_nan_and_keeps_finite_documents_as_they_are():
    document = {"outputs": {"y": [[float("nan"), 1.0]]}, "result": {"score": np.float32("inf"), "n": np.int64(3)},
                "latency_ms": 0.5}
    text = dumps(document)
    assert b"NaN" in text and b'"NaN"' in text and b": NaN" not in text
    assert strict_loads(text) == {"outputs": {"y": [["NaN", 1.0]]}, "result": {"score": "Infinity", "n": 3},
                                  "latency_ms": 0.5}
    plain = {"a": [1, 2.5, "s", True, None]}
    assert dumps(plain) == json.dumps(plain).encode()


def test_values_without_an_encoding_are_a_typed_error_not_invalid_json():
    with pytest.raises(WireEncodingError, match="complex64 tensor has no JSON encoding") as caught:
        dumps({"z": np.array([1 + 2j], np.complex64)})
    assert isinstance(caught.value, EdgepackError) and NPZ_MEDIA_TYPE in str(caught.value)
    with pytest.raises(WireEncodingError, match="set has no JSON encoding"):
        to_wire({1, 2})


def test_from_wire_is_the_inverse_for_float_outputs():
    decoded = from_wire(strict_loads(dumps({"y": np.array([np.nan, np.inf, -np.inf, 2.0], np.float32)})))
    values = decoded["y"]
    assert math.isnan(values[0]) and values[1:] == [math.inf, -math.inf, 2.0]


def test_npz_bytes_hold_the_exact_tensors_strings_included_without_pickle():
    arrays = {"f": np.array([[np.nan, -0.0, 1e-45]], np.float32), "i": np.array([2**63 - 1], np.int64),
              "b": np.array([True]), "s": np.array([["NaN", "café"]], dtype=object), "h": np.array([1.5], np.float16),
              "scalar": np.array("one", dtype=object)}
    with np.load(io.BytesIO(npz_bytes(arrays)), allow_pickle=False) as loaded:
        got = {name: loaded[name] for name in loaded.files}
    assert set(got) == set(arrays)
    for name in ("f", "i", "b", "h"):
        assert got[name].dtype == arrays[name].dtype and got[name].tobytes() == arrays[name].tobytes()
    assert got["s"].tolist() == [["NaN", "café"]] and got["s"].shape == (1, 2)
    assert got["scalar"].shape == () and got["scalar"].item() == "one"


@pytest.mark.parametrize("name", ["allow_pickle", "file", "arr_0"])
def test_an_output_named_like_a_savez_argument_is_kept_in_the_npz_answer(name):
    # np.savez(buffer, **arrays) took an output named allow_pickle as its own argument and
    # dropped it from the answer (found by mypy: numpy's stub types that keyword as bool).
    arrays = {name: np.arange(3, dtype=np.int32), "other": np.ones(2, np.float32)}
    with np.load(io.BytesIO(npz_bytes(arrays)), allow_pickle=False) as loaded:
        assert sorted(loaded.files) == sorted(arrays)
        assert loaded[name].tolist() == [0, 1, 2] and loaded[name].dtype == np.int32


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (None, "application/json"),
        ("", "application/json"),
        ("*/*", "application/json"),
        ("application/json", "application/json"),
        ("application/x-npz", "application/x-npz"),
        ("APPLICATION/X-NPZ; charset=whatever", "application/x-npz"),
        ("application/json;q=0.5, application/x-npz", "application/x-npz"),
        ("application/json;q=0.9, application/x-npz;q=0.9", "application/json"),  # a tie goes to JSON
        ("application/*;q=0.2, application/x-npz;q=0.3", "application/x-npz"),
        ("application/x-npz;q=0, */*", "application/json"),
        ("application/json;q=0", None),  # JSON refused and npz not named: nothing acceptable
        ("text/html", None),
        ("application/json;q=0, application/x-npz;q=0", None),
        ("application/x-npz;q=bogus", None),
    ],
)
def test_answer_type_follows_accept_q_values(accept, expected):
    assert choose_answer_type(accept) == expected


def test_oversized_accept_header_is_read_only_to_its_bound():
    padding = "text/plain, " * (MAX_ACCEPT_CHARS // 12 + 10)
    assert choose_answer_type(padding + "application/x-npz") is None
    assert choose_answer_type("application/x-npz, " + padding) == "application/x-npz"
