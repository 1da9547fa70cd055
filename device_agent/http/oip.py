"""The Open Inference Protocol (KServe v2 REST, spoken by Triton, KServe, MLServer and OpenVINO
Model Server): model metadata, and infer requests and answers, with the binary tensor data
extension (``Inference-Header-Content-Length``) that ``tritonclient`` uses by default.

Pure: bytes and specs in, arrays or bytes out; the endpoints live in ``device_agent/http/app.py``.
Every request is bounded before anything is allocated: the JSON header by ``max_json_bytes``
and its depth, each input's declared shape and datatype against the model's input spec, its
bytes (``binary_data_size`` or ``shape`` times the element size) against what is left of
``max_decoded_bytes``, the binary section against the sizes declared for it, byte for byte.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_agent.errors import BadRequest
from device_agent.http import bodies
from device_agent.smoke import shape_matches
from edgepack_core import wire_json

HEADER_LENGTH_HEADER = "Inference-Header-Content-Length"
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ("binary_tensor_data",)
MAX_RANK = 32

# numpy dtype name -> the protocol's datatype (strings are BYTES).
DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
             "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "float16": "FP16",
             "float32": "FP32", "float64": "FP64", "bfloat16": "BF16", "string": "BYTES"}


def datatype_of(dtype: np.dtype | str) -> str:
    """The protocol's datatype of a numpy dtype or a manifest dtype name (pure)."""
    if isinstance(dtype, str):
        return DATATYPES.get(dtype, dtype.upper())
    if dtype.kind in "OUS":
        return "BYTES"
    return DATATYPES.get(dtype.name, dtype.name.upper())


def _dims(shape: Sequence[int | str]) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def server_metadata(version: str) -> dict[str, Any]:
    return {"name": "edgepack-agent", "version": version, "extensions": list(EXTENSIONS)}


def model_metadata(model: Any) -> dict[str, Any]:
    """``GET /v2/models/NAME``: the inputs a caller feeds (constants and state inputs are the
    agent's) and every output, symbolic dims as -1."""
    manifest = model.manifest
    return {
        "name": manifest.name, "versions": [manifest.version], "platform": PLATFORM,
        "inputs": [{"name": name, "datatype": datatype_of(dtype), "shape": _dims(shape)}
                   for name, (dtype, shape) in model.input_specs.items()],
        "outputs": [{"name": spec.name, "datatype": datatype_of(spec.dtype), "shape": _dims(spec.shape)}
                    for spec in manifest.outputs],
    }


@dataclass
class InferRequest:
    """A parsed infer request: the feed, and which outputs to answer, in which encoding."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]] | None  # (name, binary); None: every output
    binary_outputs: bool = False  # the request's binary_data_output, for every output not named
    parameters: dict[str, Any] = field(default_factory=dict)


def _bad(message: str, kind: str = "bad_input") -> BadRequest:
    return BadRequest(kind, message)


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
        raise _bad(f"{where}: parameters must be an object of strings, numbers and booleans")
    return value


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_RANK or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in value):
        raise _bad(f"input {name}: shape must be a list of at most {MAX_RANK} non-negative integers")
    return tuple(value)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary section of a body."""
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not text.isdigit() or len(text) > 20 or int(text) > len(body):
        raise _bad(f"{HEADER_LENGTH_HEADER} must be a byte count within the body ({len(body)} bytes)")
    size = int(text)
    return body[:size], memoryview(body)[size:]


def _bytes_elements(data: memoryview, count: int, name: str) -> np.ndarray:
    """``count`` length-prefixed elements (4-byte little-endian length, then the bytes),
    filling ``data`` exactly, as UTF-8 strings (what ONNX string inputs take)."""
    elements, offset = [], 0
    for _ in range(count):
        if offset + 4 > len(data):
            raise _bad(f"input {name}: BYTES data ends inside an element's length")
        (size,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + size > len(data):
            raise _bad(f"input {name}: a BYTES element of {size} bytes runs past the data")
        try:
            elements.append(bytes(data[offset:offset + size]).decode("utf-8"))
        except UnicodeDecodeError as err:
            raise _bad(f"input {name}: a BYTES element is not UTF-8 text") from err
        offset += size
    if offset != len(data):
        raise _bad(f"input {name}: {len(data) - offset} bytes after its {count} BYTES elements")
    return np.array(elements, dtype=object)


def _binary_tensor(data: memoryview, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=object))
    if dtype.kind == "O":
        return _bytes_elements(data, count, name).reshape(shape)
    if len(data) != count * dtype.itemsize:
        raise _bad(f"input {name}: binary_data_size {len(data)} is not {count} x {dtype.itemsize} bytes of "
                   f"shape {list(shape)}")
    array = np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=count).reshape(shape)
    if dtype == np.bool_ and (array.view(np.uint8) > 1).any():
        raise _bad(f"input {name}: BOOL bytes must be 0 or 1")
    return array if dtype.byteorder in ("=", "|", "<") else array.astype(dtype)


def _json_tensor(data: Any, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    if not isinstance(data, list):
        raise _bad(f"input {name}: data must be a list (flat or nested)")
    try:
        array = np.asarray(data, dtype=object if dtype.kind == "O" else dtype)
    except (ValueError, TypeError, OverflowError) as err:
        raise _bad(f"input {name}: cannot convert data to {datatype_of(dtype)}: {str(err)[:200]}") from err
    count = int(np.prod(shape, dtype=object))
    if array.size != count:
        raise _bad(f"input {name}: {array.size} values for shape {list(shape)} ({count} values)")
    if dtype.kind == "O" and not all(isinstance(v, str) for v in array.reshape(-1)):
        raise _bad(f"input {name}: BYTES data in JSON must be strings")
    return array.reshape(shape)


def _input(item: Any, specs: Mapping[str, Any], binary: memoryview, offset: int,
           budget: int, limits: bodies.BodyLimits) -> tuple[str, np.ndarray, int, int]:
    """One ``$request_input`` -> (name, array, new binary offset, bytes left in the budget)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise _bad("each input must be an object with a name")
    name = item["name"]
    if name not in specs:
        raise _bad(f"unknown input {name[:100]!r} (inputs: {', '.join(specs)})", "unknown_input")
    dtype, declared = specs[name]
    if item.get("datatype") != datatype_of(dtype):
        raise _bad(f"input {name} is {datatype_of(dtype)}, got datatype {str(item.get('datatype'))[:20]}", "dtype")
    shape = _shape(item.get("shape"), name)
    if not shape_matches(shape, declared):
        raise _bad(f"input {name} must have shape {_dims(declared)}, got {list(shape)}", "shape")
    parameters = _parameters(item.get("parameters"), f"input {name}")
    size = parameters.get("binary_data_size")
    count = int(np.prod(shape, dtype=object))
    nbytes = size if dtype.kind == "O" and isinstance(size, int) else count * dtype.itemsize
    if nbytes > budget:
        raise bodies.too_large(f"input {name}", nbytes, budget, " (api.max_decoded_bytes)")
    bodies.check_batch(name, nbytes, specs[name], limits)
    if size is None:
        return name, _json_tensor(item.get("data"), dtype, shape, name), offset, budget - nbytes
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
        raise _bad(f"input {name}: binary_data_size {size!r} does not fit the {len(binary) - offset} bytes left")
    if "data" in item:
        raise _bad(f"input {name}: both data and binary_data_size")
    array = _binary_tensor(binary[offset:offset + size], dtype, shape, name)
    return name, array, offset + size, budget - nbytes


def _requested_outputs(value: Any, output_names: Sequence[str]) -> list[tuple[str, bool | None]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("outputs must be a list of {name, parameters}")
    wanted: list[tuple[str, bool | None]] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _bad("each requested output must be an object with a name")
        if item["name"] not in output_names:
            raise _bad(f"unknown output {item['name'][:100]!r} (outputs: {', '.join(output_names)})",
                       "unknown_output")
        binary = _parameters(item.get("parameters"), f"output {item['name']}").get("binary_data")
        wanted.append((item["name"], None if binary is None else bool(binary)))
    return wanted


def parse_infer_request(body: bytes, header_length: str | None, specs: Mapping[str, Any],
                        output_names: Sequence[str], limits: bodies.BodyLimits) -> InferRequest:
    """``POST /v2/models/NAME/infer``'s body -> the feed and the outputs wanted (pure)."""
    text, binary = _split(body, header_length)
    document = bodies.parse_json(text, limits)
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise _bad('an infer request is {"inputs": [{name, shape, datatype, data}], ...}')
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _bad("id must be a string")
    parameters = _parameters(document.get("parameters"), "request")
    feed: dict[str, np.ndarray] = {}
    offset, budget = 0, limits.max_decoded_bytes
    for item in document["inputs"]:
        name, array, offset, budget = _input(item, specs, binary, offset, budget, limits)
        if name in feed:
            raise _bad(f"input {name} given twice")
        feed[name] = array
    if offset != len(binary):
        raise _bad(f"{len(binary) - offset} bytes of binary data that no input declares")
    default = bool(parameters.get("binary_data_output", False))
    wanted = _requested_outputs(document.get("outputs"), output_names)
    return InferRequest(request_id, feed, None if wanted is None else
                        [(name, default if binary is None else binary) for name, binary in wanted],
                        default, parameters)


def _binary(array: np.ndarray) -> bytes:
    """A tensor in the binary tensor data extension's layout: little-endian, row major; BOOL one
    byte; BYTES a 4-byte length before each element."""
    if array.dtype.kind in "OUS":
        parts = []
        for value in array.reshape(-1).tolist():
            data = value if isinstance(value, bytes) else str(value).encode("utf-8")
            parts += [struct.pack("<I", len(data)), data]
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encode_infer_response(model_name: str, model_version: str, request: InferRequest,
                          outputs: Mapping[str, np.ndarray], limits: bodies.BodyLimits | None = None,
                          non_finite: Sequence[str] = ()) -> tuple[bytes, dict[str, str]]:
    """The answer's body and headers (``Inference-Header-Content-Length`` when any output goes
    binary). JSON data is flat, by the agent's wire convention (non-finite floats as
    ``"NaN"``/``"Infinity"``/``"-Infinity"``, which numpy and tritonclient read back). Outputs
    answered as JSON are bounded by ``max_json_output_bytes`` first (413). ``non_finite``: the
    outputs the recipe allows to hold NaN/inf that do, said in the answer's ``parameters``
    (``non_finite_outputs``), as ``/predict`` says them."""
    chosen = request.outputs if request.outputs is not None else [(n, request.binary_outputs) for n in outputs]
    bodies.check_json_outputs(sum(np.asarray(outputs[name]).nbytes for name, binary in chosen if not binary),
                              limits or bodies.BodyLimits(),
                              'ask for them as binary data (parameters: {"binary_data_output": true})')
    described, tails = [], []
    for name, binary in chosen:
        array = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype), "shape": list(array.shape)}
        if binary:
            data = _binary(array)
            entry["parameters"] = {"binary_data_size": len(data)}
            tails.append(data)
        else:
            entry["data"] = wire_json.array_to_wire(array.reshape(-1))
        described.append(entry)
    document: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": described}
    if request.id is not None:
        document["id"] = request.id
    if non_finite:
        document["parameters"] = {"non_finite_outputs": ",".join(non_finite)}
    header = wire_json.dumps(document)
    if not tails:
        return header, {}
    return header + b"".join(tails), {HEADER_LENGTH_HEADER: str(len(header))}
