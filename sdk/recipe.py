"""Recipes: the YAML a user writes to describe one build.

A recipe is validated completely before any model is loaded: unknown keys and wrong types
are rejected with the key's dotted path, and every referenced file is checked to exist.
Relative paths are resolved against the recipe file's directory. The schema below is the
single source: ``edgepack schema recipe`` prints it and ``schemas/recipe.schema.json`` is
generated from it (a test keeps the file in sync).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepack_core.manifest import DTYPES
from edgepack_core.postprocess import POSTPROCESS_SCHEMA, normalize_postprocess
from edgepack_core.preprocess import PREPROCESS_SCHEMA, normalize_preprocess
from edgepack_core.schema import validate
from edgepack_core.targets import PROFILES
from edgepack_core.versions import VERSION_PATTERN
from edgepack_core.yamlfile import read_yaml_file
from sdk.errors import RecipeError, SchemaError

MAX_RECIPE_BYTES = 1024 * 1024

_PATH = {"type": "string", "minLength": 1}
_LIMIT = {"type": "integer", "minimum": 1, "description": "use at most this many samples"}
_SAMPLE_AXIS = {
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}],
    "description": "the axis of the array that runs over samples; null: the whole array is one sample",
}
_DATA_SOURCE = {
    "description": "Sample data: {npz: FILE} (arrays keyed by input name), {test_data: DIR} (ONNX test data "
    "sets), {images: DIR} (run through the preprocessing spec), {audio: DIR} (WAV files cut into frames by "
    "the audio preprocessing spec), or the string 'synthetic' (consent to "
    "made-up inputs). docs/packager.md, 'Data', gives the layouts with examples.",
    "oneOf": [
        {"const": "synthetic"},
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["npz"],
            "properties": {
                "npz": {**_PATH, "description": "an .npz: per input, an array of the input's own rank is one "
                        "sample, one more leading axis is a stack of samples; optional 'label' array"},
                "sample_axis": {"type": "object", "additionalProperties": _SAMPLE_AXIS,
                                "description": "per input name, where the layout is ambiguous"},
                "limit": _LIMIT,
            },
        },
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["test_data"],
            "properties": {
                "test_data": {**_PATH, "description": "a folder of test_data_set_*/input_*.pb (and output_*.pb, "
                              "expected outputs the build checks), or one such set"},
                "limit": _LIMIT,
            },
        },
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["images"],
            "properties": {
                "images": {**_PATH, "description": "a folder of images, fed through the preprocessing spec"},
                "labels": {**_PATH, "description": "CSV with columns file,label"},
                "limit": _LIMIT,
            },
        },
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["audio"],
            "properties": {
                "audio": {**_PATH, "description": "a folder of .wav files, cut into frames by the audio "
                          "preprocessing spec; each frame is one sample (state inputs start from init)"},
                "limit": _LIMIT,
            },
        },
    ],
}
_INPUT = {
    "type": "object",
    "additionalProperties": False,
    "description": "What the model's signature leaves open about one input.",
    "properties": {
        "shape": {"type": "array", "description": "fixes symbolic dims (a name keeps a dim symbolic)",
                  "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1}]}},
        "dtype": {"enum": DTYPES, "description": "must agree with the model's element type"},
        "range": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number"},
                  "description": "[low, high] of synthetic values (integers: low <= v < high)"},
        "role": {"enum": ["tensor", "constant", "image", "audio", "state"], "default": "tensor",
                 "description": "constant: the agent feeds `value` on every call; callers do not pass it. "
                 "image/audio: the input the preprocessing spec of that kind feeds. state: the agent feeds the "
                 "previous call's `output` (per stream), `init` on a stream's first call"},
        "output": {"type": "string", "minLength": 1,
                   "description": "role state: the model output (same dtype and shape) carried into this input"},
        "init": {"enum": ["zeros"], "default": "zeros",
                 "description": "role state: the first value of a stream (zeros; symbolic dims become 1)"},
        "value": {"description": "the value of a constant input: a scalar or a nested list of its shape"},
        "allow_non_finite": {"type": "boolean", "default": False,
                             "description": "the model takes NaN/inf in this input by design (IsNaN, missing "
                             "values, -inf attention masks): the agent serves them instead of answering 400"},
        "sample_axis": {**_SAMPLE_AXIS, "description": "default sample axis of this input's npz arrays "
                        "(null: an array is one sample); a data source's sample_axis overrides it"},
    },
}

RECIPE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://edgepack.dev/schemas/recipe.schema.json",
    "title": "Edgepack build recipe",
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "version", "model"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
        "version": {"type": "string", "pattern": VERSION_PATTERN},
        "description": {"type": "string"},
        "model": {
            "type": "object",
            "additionalProperties": False,
            "description": "Exactly one of path (an .onnx file) or pytorch (export a torch.nn.Module).",
            "properties": {
                "path": _PATH,
                "convert_opset": {"type": "integer", "minimum": 1,
                                  "description": "convert the model to this default-domain opset first; the result "
                                  "is validated against the original"},
                "strict_check": {"type": "boolean", "default": False,
                                 "description": "onnx.checker findings become errors instead of warnings"},
                "pytorch": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["factory", "input_shape"],
                    "properties": {
                        "factory": {"type": "string", "pattern": r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                                    "description": "module:callable returning the nn.Module"},
                        "weights": _PATH,
                        "input_shape": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 1}},
                        "input_name": {"type": "string"},
                        "output_names": {"type": "array", "items": {"type": "string"}},
                        "opset": {"type": "integer", "minimum": 13, "maximum": 21},
                        "dynamic_batch": {"type": "boolean"},
                    },
                },
            },
        },
        "inputs": {
            "type": "object",
            "description": "Per input name: shape, dtype, synthetic range, role (tensor, constant, image, "
            "audio, state).",
            "additionalProperties": _INPUT,
        },
        "preprocess": PREPROCESS_SCHEMA,
        "postprocess": POSTPROCESS_SCHEMA,
        "optimize": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "level": {"enum": ["none", "basic", "extended", "all"]},
                "fold_batchnorm": {"type": "boolean"},
                "constant_folding": {"type": "boolean"},
                "fp16": {"type": "boolean"},
                "fixed_shapes": {"type": "boolean"},
                "ort_format": {"type": "boolean"},
            },
        },
        "quantize": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "mode": {"enum": ["none", "dynamic", "static"]},
                "calibration": _DATA_SOURCE,
                "method": {"enum": ["minmax", "entropy", "percentile"]},
                "per_channel": {"type": "boolean"},
                "symmetric_activations": {"type": "boolean"},
                "symmetric_weights": {"type": "boolean"},
                "reduce_range": {"type": "boolean"},
                "preset": {"enum": ["arm64", "x86-avx2", "x86-vnni", "tensorrt"],
                           "description": "activation/weight types for the target's runtime; default: "
                           "derived from targets (rpi/android/apple arm64, jetson tensorrt, x86 x86-vnni "
                           "when the build host has VNNI, else x86-avx2)"},
                "op_types": {"type": "array", "items": {"type": "string"}},
                "exclude_nodes": {"type": "array", "items": {"type": "string", "minLength": 1},
                                  "description": "nodes kept in float: names or glob patterns (fnmatch); a "
                                  "pattern that matches no node is refused"},
                "search": {"type": "boolean", "default": True,
                           "description": "false: try the requested settings only, no search"},
                "min_speedup": {"type": "number", "minimum": 0, "default": 1.0,
                                "description": "an int8 candidate ships only when fp32 latency / its latency "
                                "(host CPU provider, one thread) is above this; 0 ships any speed"},
                "max_candidates": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10,
                                   "description": "the most candidates the search builds and judges"},
                "max_search_s": {"type": "number", "exclusiveMinimum": 0, "default": 900,
                                 "description": "no new candidate starts after this many seconds of search"},
            },
        },
        "validate": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "data": _DATA_SOURCE,
                "metric": {"enum": ["top1", "agreement", "cosine", "max_abs", "detection", "sequence"],
                           "description": "what a quantized or fp16 build is judged by (default: the task's: "
                           "detection, sequence for ctc, top1 for classifiers, cosine per output for raw)"},
                "outputs": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1},
                            "description": "the outputs the metric checks, each on its own (leave recurrent "
                            "state out); default: the postprocess's output, every output for raw"},
                "max_drop": {"type": "number", "minimum": 0},
                "min_cosine": {"type": "number", "minimum": -1, "maximum": 1},
                "max_abs": {"type": "number", "minimum": 0},
                "min_recall": {"type": "number", "minimum": 0, "maximum": 1,
                               "description": "detection: least recall against the fp32 model's detections at "
                               "IoU 0.5 (default 0.95)"},
                "min_precision": {"type": "number", "minimum": 0, "maximum": 1,
                                  "description": "detection: least precision against the fp32 model's "
                                  "detections at IoU 0.5 (default 0.95)"},
                "max_score_diff": {"type": "number", "minimum": 0, "maximum": 1,
                                   "description": "detection: largest mean score shift of the detections that "
                                   "match the fp32 model's (default 0.05; a collapsed score channel keeps "
                                   "recall and precision but moves every score)"},
                "min_agreement": {"type": "number", "minimum": 0, "maximum": 1,
                                  "description": "sequence: least share of time steps whose argmax agrees with "
                                  "the fp32 model (default 0.99)"},
                "min_string_match": {"type": "number", "minimum": 0, "maximum": 1,
                                     "description": "sequence with a ctc postprocess: least share of decoded "
                                     "strings equal to the fp32 model's (default: unset, reported only)"},
                "samples": {"type": "integer", "minimum": 1},
                "allow_failure": {"type": "boolean"},
                "rtol": {"type": "number", "minimum": 0,
                         "description": "relative tolerance of every float output (default by dtype)"},
                "atol": {"type": "number", "minimum": 0,
                         "description": "absolute tolerance of every float output (default by dtype)"},
            },
        },
        "golden": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "count": {"type": "integer", "minimum": 1, "maximum": 64},
                "data": _DATA_SOURCE,
                "rtol": {"type": "number", "minimum": 0},
                "atol": {"type": "number", "minimum": 0},
            },
        },
        "targets": {"type": "array", "minItems": 1, "items": {"enum": sorted(PROFILES)}},
        "target_onnxruntime": {
            "type": "object",
            "additionalProperties": False,
            "description": "the onnxruntime a target's devices really run, when not the profile's default "
                           "(e.g. {rpi: 1.20.0} for Pis that pip-installed a newer wheel); the build refuses "
                           "an artifact that needs more",
            "properties": {name: {"type": "string", "pattern": r"^\d+\.\d+(\.\d+)?$"} for name in sorted(PROFILES)},
        },
        "sign": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"key": _PATH},
        },
        "output": _PATH,
    },
}


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. ``data`` is the document with every path made absolute.

    ``root`` is the folder every path of the recipe had to resolve inside (None when the
    build allowed external paths); loaders of folders check each file against it too, so a
    symlink inside a data folder cannot reach out either."""

    path: Path
    data: Mapping[str, Any]
    root: Path | None = None

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def version(self) -> str:
        return self.data["version"]

    def section(self, key: str) -> Mapping[str, Any]:
        return self.data.get(key) or {}

    @property
    def targets(self) -> list[str]:
        return list(self.data.get("targets") or ["x86"])


# The sections that hold a data source, and the key of the source inside each.
DATA_SOURCES: tuple[tuple[str, str], ...] = (("golden", "data"), ("validate", "data"), ("quantize", "calibration"))

# Keys whose values are file or folder paths, with whether they must already exist.
_PATH_KEYS: list[tuple[tuple[str, ...], bool]] = [
    (("model", "path"), True),
    (("model", "pytorch", "weights"), True),
    (("postprocess", "labels"), True),
    (("postprocess", "charset"), True),
    *[((section, key, kind), True) for section, key in DATA_SOURCES
      for kind in ("images", "npz", "test_data", "labels", "audio")],
    (("sign", "key"), True),
    (("output",), False),
]


def inside(path: Path, root: Path) -> bool:
    """True when ``path`` (already resolved) is ``root`` or below it."""
    return path == root or root in path.parents


def _resolve_paths(data: dict[str, Any], base: Path, recipe: str, root: Path | None) -> None:
    """Make every path absolute with symlinks resolved; refuse one outside ``root``.

    Why: a recipe is often somebody else's file. Without this, ``labels: /etc/passwd`` packs
    the host's password file into a signed artifact that every device serves back, and
    ``output: ../elsewhere/file`` replaces a file the user never meant to touch."""
    for keys, must_exist in _PATH_KEYS:
        node: Any = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        resolved = (base / node[keys[-1]]).resolve()
        where = ".".join(keys)
        if root is not None and not inside(resolved, root):
            raise RecipeError(where, f"{node[keys[-1]]} resolves to {resolved}, outside the recipe's folder {root} "
                              "(build with --allow-external-paths to allow it)", recipe=recipe)
        if must_exist and not resolved.exists():
            raise RecipeError(where, f"{node[keys[-1]]} does not exist (looked at {resolved})", recipe=recipe)
        node[keys[-1]] = str(resolved)


def _check_roles(data: dict[str, Any], recipe: str) -> None:
    """``role: image``/``audio`` names the input the preprocessing spec of that kind feeds (it
    becomes the spec's ``input``); ``role: state`` needs the ``output`` it is carried from."""
    inputs = data.get("inputs") or {}
    fed = [name for name, spec in inputs.items() if spec.get("role") in ("image", "audio")]
    if len(fed) > 1:
        raise RecipeError(f"inputs.{fed[1]}.role", f"only one input is fed by the preprocessing spec ({fed[0]} is)",
                          recipe=recipe)
    for name, spec in inputs.items():
        role = spec.get("role", "tensor")
        for key in ("output", "init"):
            if key in spec and role != "state":
                raise RecipeError(f"inputs.{name}.{key}", "only an input with role: state takes it", recipe=recipe)
        if role == "state" and "output" not in spec:
            raise RecipeError(f"inputs.{name}.output", "an input with role state names the output carried into it",
                              recipe=recipe)
        if role == "state" and ("range" in spec or "sample_axis" in spec):
            raise RecipeError(f"inputs.{name}.{'range' if 'range' in spec else 'sample_axis'}",
                              "a state input takes no data settings (samples start from init)", recipe=recipe)
    if not fed:
        return
    role = inputs[fed[0]]["role"]
    pre = data.get("preprocess") or {}
    if pre.get("kind") != role:
        raise RecipeError(f"inputs.{fed[0]}.role", f"role {role} needs preprocess.kind: {role}", recipe=recipe)
    if pre.get("input", fed[0]) != fed[0]:
        raise RecipeError("preprocess.input", f"is {pre['input']}, but inputs.{fed[0]} has role {role}",
                          recipe=recipe)
    data["preprocess"] = {**pre, "input": fed[0]}


def _check_inputs(inputs: Mapping[str, Any], recipe: str) -> None:
    """Cross-key rules of the ``inputs`` section that the schema cannot say."""
    for name, spec in inputs.items():
        constant = spec.get("role") == "constant"
        if constant and "value" not in spec:
            raise RecipeError(f"inputs.{name}.value", "an input with role constant needs a value", recipe=recipe)
        if "value" in spec and not constant:
            raise RecipeError(f"inputs.{name}.value", "only an input with role: constant takes a value",
                              recipe=recipe)
        if constant and ("range" in spec or "sample_axis" in spec):
            key = "range" if "range" in spec else "sample_axis"
            raise RecipeError(f"inputs.{name}.{key}", "a constant input takes no data settings", recipe=recipe)
        low_high = spec.get("range")
        if low_high is not None and not low_high[0] <= low_high[1]:
            raise RecipeError(f"inputs.{name}.range", f"low {low_high[0]} is above high {low_high[1]}",
                              recipe=recipe)


def _check_data_consent(data: Mapping[str, Any], recipe: str) -> None:
    """Validation and golden samples need data; made-up inputs only when the recipe says so.

    Why: made-up inputs break real models (indices out of range, NaN outputs) and validate
    nothing the user cares about; a build that silently used them looked proven when it was not."""
    sources = [(data.get(section) or {}).get(key) for section, key in DATA_SOURCES]
    if not any(sources):
        raise RecipeError("validate.data", "no data to validate and make golden samples with: give validate.data "
                          "({npz: FILE}, {test_data: DIR}, {images: DIR} or {audio: DIR}), or write validate: "
                          "{data: synthetic} to consent to made-up inputs", recipe=recipe)


def check_recipe(document: Any, path: Path, *, allow_external_paths: bool = False) -> Recipe:
    """Validate a parsed recipe document; resolve and check its paths against the folder of
    ``path`` (every path must stay inside it unless ``allow_external_paths``)."""
    recipe = str(path)
    validate(document, RECIPE_SCHEMA, document=recipe)
    # The spec normalizers check what a schema cannot (e.g. one mean/std value per channel).
    normalize_preprocess(document.get("preprocess"), document=recipe, path="preprocess")
    normalize_postprocess(document.get("postprocess"), document=recipe, path="postprocess")
    data = copy.deepcopy(document)
    model = data["model"]
    if ("path" in model) == ("pytorch" in model):
        raise RecipeError("model", "give exactly one of model.path or model.pytorch", recipe=recipe)
    base = path.parent.resolve()
    root = None if allow_external_paths else base
    _resolve_paths(data, base, recipe, root)
    _check_inputs(data.get("inputs") or {}, recipe)
    _check_roles(data, recipe)
    _check_data_consent(data, recipe)
    quantize = data.get("quantize") or {}
    if quantize.get("mode") == "static" and "calibration" not in quantize:
        raise RecipeError("quantize.calibration", "static quantization needs calibration data", recipe=recipe)
    return Recipe(path=path.resolve(), data=data, root=root)


def load_recipe(path: str | Path, *, allow_external_paths: bool = False) -> Recipe:
    """Read and validate a recipe file. Raises RecipeError/SchemaError naming the key."""
    path = Path(path)
    document = read_yaml_file(path, MAX_RECIPE_BYTES, lambda problem: RecipeError("<file>", problem, recipe=str(path)),
                              kind="recipe")
    if not isinstance(document, dict):
        raise SchemaError("", "a recipe must be a mapping of keys", document=str(path))
    return check_recipe(document, path, allow_external_paths=allow_external_paths)


def recipe_from_dict(data: dict[str, Any], base_dir: Path, *, allow_external_paths: bool = False) -> Recipe:
    """A recipe from an in-memory document, its relative paths resolved against ``base_dir``
    (for drivers that build many models in-process without writing YAML files)."""
    return check_recipe(data, Path(base_dir) / "<recipe>", allow_external_paths=allow_external_paths)
