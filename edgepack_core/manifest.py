"""The manifest of an ``.edgepkg`` artifact (format 1): schema, canonical bytes, typed view.

manifest.json is the only thing the signature covers; it lists every other file of the
artifact with its size and sha256, so verifying the signature and then every file's hash
proves the whole artifact. The writer emits canonical bytes (sorted keys, compact, UTF-8) so
that the same build gives the same manifest; the reader verifies the exact bytes it received
and never re-serializes before checking.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgepack_core.errors import ManifestError, SchemaError
from edgepack_core.golden_stream import GoldenStreamField, golden_stream_of, manifest_schema
from edgepack_core.postprocess_spec import POSTPROCESS_SCHEMA, PostprocessSpec, parse_postprocess
from edgepack_core.preprocess_spec import PREPROCESS_SCHEMA, PreprocessSpec, parse_preprocess
from edgepack_core.schema import Validator, validate
from edgepack_core.versions import VERSION_PATTERN, Version

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
REPORT_NAME = "report.json"

# A member path: relative, forward slashes, no empty/dot/dot-dot parts, a conservative charset.
MEMBER_PATTERN = r"^(?!.*(^|/)\.{1,2}(/|$))[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*$"
DTYPES = [
    "float32", "float16", "float64", "bfloat16", "int8", "uint8", "int16", "uint16",
    "int32", "uint32", "int64", "uint64", "bool", "string",
]

_TENSOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "dtype", "shape"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "dtype": {"enum": DTYPES},
        "shape": {
            "type": "array",
            "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]},
        },
        "role": {"enum": ["tensor", "constant", "image", "audio", "state"],
                 "description": "constant: the agent feeds `value` on every call; image/audio: fed through the "
                 "preprocessing spec; state: fed the previous call's `output` of its stream (inputs only)"},
        "output": {"type": "string", "minLength": 1,
                   "description": "state inputs: the model output carried into this input on the next call"},
        "init": {"enum": ["zeros"], "description": "state inputs: the value of a stream's first call"},
        "value": {"description": "the value of a constant input: a scalar or nested list of its shape"},
        "allow_non_finite": {"type": "boolean",
                             "description": "an input: takes NaN/inf by design (IsNaN, missing values, -inf "
                             "masks), the agent does not refuse them; an output: NaN/inf are answers by design, "
                             "served flagged (absent: a NaN/inf there is a 500 non_finite_output)"},
    },
}

MANIFEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "edgepack manifest.json (format 1)",
    "type": "object",
    "additionalProperties": False,
    "required": ["format", "name", "version", "created", "files", "model", "inputs", "outputs"],
    "properties": {
        "format": {"const": FORMAT_VERSION},
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
        "version": {"type": "string", "pattern": VERSION_PATTERN},
        "created": {"type": "string"},
        "description": {"type": "string"},
        "files": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["size", "sha256"],
                "properties": {
                    "size": {"type": "integer", "minimum": 0},
                    "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                },
            },
        },
        "model": {
            "type": "object",
            "additionalProperties": False,
            "required": ["path"],
            "properties": {
                "path": {"type": "string", "pattern": MEMBER_PATTERN},
                "ort_path": {"type": "string", "pattern": MEMBER_PATTERN},
                "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                # The ai.onnx opset (absent for an ai.onnx.ml-only graph); every imported domain's
                # opset is in "opsets", pruned to the domains the graph's nodes use.
                "opset": {"type": "integer", "minimum": 1},
                "opsets": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
                # The oldest onnxruntime that runs the final graph (edgepack_core/ort_compat.py);
                # the agent refuses the artifact on an older one.
                "ir_version": {"type": "integer", "minimum": 1},
                "min_onnxruntime": {"type": "string", "pattern": r"^\d+\.\d+(\.\d+)?$"},
                "precision": {"type": "string"},
            },
        },
        "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {"type": "array", "minItems": 1, "items": _TENSOR},
        "preprocess": PREPROCESS_SCHEMA,
        "postprocess": POSTPROCESS_SCHEMA,
        "targets": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"providers": {"type": "array", "items": {"type": "string"}}},
            },
        },
        "golden": {
            "type": "object",
            "additionalProperties": False,
            "required": ["samples"],
            "properties": {
                "samples": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["inputs", "outputs"],
                        "properties": {
                            "inputs": {"type": "string", "pattern": MEMBER_PATTERN},
                            "outputs": {"type": "string", "pattern": MEMBER_PATTERN},
                        },
                    },
                },
                "rtol": {"type": "number", "minimum": 0},
                "atol": {"type": "number", "minimum": 0},
            },
        },
        "golden_stream": manifest_schema(MEMBER_PATTERN),
        "tools": {"type": "object", "additionalProperties": {"type": "string"}},
        "report": {"type": "string", "pattern": MEMBER_PATTERN},
    },
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. ``raw`` keeps the full document for fields not modelled here."""

    raw: Mapping[str, Any]

    @property
    def name(self) -> str:
        name: str = self.raw["name"]  # the schema checked the types of raw's fields
        return name

    @property
    def version(self) -> str:
        version: str = self.raw["version"]
        return version

    @property
    def files(self) -> Mapping[str, Mapping[str, Any]]:
        files: Mapping[str, Mapping[str, Any]] = self.raw["files"]
        return files

    @property
    def model_path(self) -> str:
        path: str = self.raw["model"]["path"]
        return path

    @property
    def model_sha256(self) -> str:
        digest: str = self.files[self.model_path]["sha256"]
        return digest

    @property
    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in self.raw["inputs"]]

    @property
    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in self.raw["outputs"]]

    @functools.cached_property
    def preprocess(self) -> PreprocessSpec:
        """The typed spec (raw tensors when the manifest has none), parsed once per manifest."""
        return parse_preprocess(self.raw.get("preprocess"), document="manifest.json", path="preprocess")

    @functools.cached_property
    def postprocess(self) -> PostprocessSpec:
        """The typed spec (``raw`` when the manifest has none), parsed once per manifest."""
        return parse_postprocess(self.raw.get("postprocess"), document="manifest.json", path="postprocess")

    @property
    def targets(self) -> Mapping[str, Any]:
        targets: Mapping[str, Any] = self.raw.get("targets", {})
        return targets

    @property
    def golden(self) -> Mapping[str, Any]:
        golden: Mapping[str, Any] = self.raw.get("golden", {"samples": []})
        return golden

    @property
    def golden_stream(self) -> GoldenStreamField | None:
        """The golden clip, its expected events and pipeline fragment (None: the artifact has none)."""
        return golden_stream_of(self.raw)

    def to_json(self) -> dict[str, Any]:
        copy: dict[str, Any] = json.loads(json.dumps(self.raw))  # a deep copy the caller may change
        return copy


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """The exact bytes the writer stores and signs: sorted keys, compact, UTF-8, newline."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _referenced(document: Mapping[str, Any]) -> list[str]:
    """Every member the manifest names outside ``files``: each must be listed there."""
    referenced = [document["model"]["path"]]
    if "ort_path" in document["model"]:
        referenced.append(document["model"]["ort_path"])
    if "report" in document:
        referenced.append(document["report"])
    for sample in document.get("golden", {}).get("samples", []):
        referenced += [sample["inputs"], sample["outputs"]]
    if "golden_stream" in document:
        referenced += [document["golden_stream"]["clip"], document["golden_stream"]["events"]]
    return referenced


def check_manifest(document: Any) -> Manifest:
    """Validate a parsed manifest document against the schema and cross-field rules."""
    try:
        validate(document, MANIFEST_SCHEMA, document="manifest.json")
    except SchemaError as err:
        raise ManifestError(str(err)) from err
    Version(document["version"])  # already pattern-checked; parse for ordering later
    files = document["files"]
    member = Validator({"type": "string", "pattern": MEMBER_PATTERN}, document="manifest.json")
    for name in files:
        try:
            member.validate(name, path=f"files.{name}")
        except SchemaError as cause:
            raise ManifestError(f"manifest.json: files: unsafe path {name!r}") from cause
        if name in (MANIFEST_NAME, SIGNATURE_NAME):
            raise ManifestError(f"manifest.json: files: {name} cannot list itself")
    for ref in _referenced(document):
        if ref not in files:
            raise ManifestError(f"manifest.json: {ref} is referenced but not listed in files")
    return _with_specs(Manifest(document))


def _with_specs(manifest: Manifest) -> Manifest:
    """Parse the pre/postprocessing specs now, once: their cross-field rules (a mean per
    channel, in_graph's dtype, detection outputs) refuse the manifest at verification."""
    try:
        _ = manifest.preprocess, manifest.postprocess
    except SchemaError as err:
        raise ManifestError(str(err)) from err
    return manifest


def parse_manifest(data: bytes) -> Manifest:
    """Parse manifest bytes. Call only after the signature over ``data`` has verified."""
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"manifest.json is not valid UTF-8 JSON: {err}") from err
    return check_manifest(document)
