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

from edgepack_core.postprocess import POSTPROCESS_SCHEMA, normalize_postprocess
from edgepack_core.preprocess import PREPROCESS_SCHEMA, normalize_preprocess
from edgepack_core.schema import validate
from edgepack_core.targets import PROFILES
from edgepack_core.versions import VERSION_PATTERN
from edgepack_core.yamlfile import read_yaml_file
from sdk.errors import RecipeError, SchemaError

MAX_RECIPE_BYTES = 1024 * 1024

_PATH = {"type": "string", "minLength": 1}
_DATA_SOURCE = {
    "type": "object",
    "additionalProperties": False,
    "description": "Sample data: a folder of images (run through the preprocessing spec) or an .npz of "
    "ready model inputs keyed by input name.",
    "properties": {
        "images": _PATH,
        "npz": _PATH,
        "labels": {**_PATH, "description": "CSV with columns file,label (images) or the npz key 'label'"},
        "limit": {"type": "integer", "minimum": 1},
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
            "description": "Override input shapes/dtypes by input name.",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "shape": {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 1},
                                                                  {"type": "string", "minLength": 1}]}},
                    "dtype": {"type": "string"},
                },
            },
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
                "preset": {"enum": ["arm64", "x86-avx2", "x86-vnni", "tensorrt"]},
                "op_types": {"type": "array", "items": {"type": "string"}},
                "exclude_nodes": {"type": "array", "items": {"type": "string"}},
                "search": {"type": "boolean"},
            },
        },
        "validate": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "data": _DATA_SOURCE,
                "metric": {"enum": ["top1", "agreement", "cosine", "max_abs"]},
                "max_drop": {"type": "number", "minimum": 0},
                "min_cosine": {"type": "number", "minimum": -1, "maximum": 1},
                "max_abs": {"type": "number", "minimum": 0},
                "samples": {"type": "integer", "minimum": 1},
                "allow_failure": {"type": "boolean"},
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
    """A validated recipe. ``data`` is the document with every path made absolute."""

    path: Path
    data: Mapping[str, Any]

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


# Keys whose values are file or folder paths, with whether they must already exist.
_PATH_KEYS: list[tuple[tuple[str, ...], bool]] = [
    (("model", "path"), True),
    (("model", "pytorch", "weights"), True),
    (("postprocess", "labels"), True),
    (("quantize", "calibration", "images"), True),
    (("quantize", "calibration", "npz"), True),
    (("quantize", "calibration", "labels"), True),
    (("validate", "data", "images"), True),
    (("validate", "data", "npz"), True),
    (("validate", "data", "labels"), True),
    (("golden", "data", "images"), True),
    (("golden", "data", "npz"), True),
    (("golden", "data", "labels"), True),
    (("sign", "key"), True),
    (("output",), False),
]


def _resolve_paths(data: dict[str, Any], base: Path, recipe: str) -> None:
    for keys, must_exist in _PATH_KEYS:
        node: Any = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        resolved = (base / node[keys[-1]]).resolve()
        if must_exist and not resolved.exists():
            raise RecipeError(".".join(keys), f"{node[keys[-1]]} does not exist (looked at {resolved})",
                              recipe=recipe)
        node[keys[-1]] = str(resolved)


def check_recipe(document: Any, path: Path) -> Recipe:
    """Validate a parsed recipe document; resolve and check its paths."""
    recipe = str(path)
    validate(document, RECIPE_SCHEMA, document=recipe)
    # The spec normalizers check what a schema cannot (e.g. one mean/std value per channel).
    normalize_preprocess(document.get("preprocess"), document=recipe, path="preprocess")
    normalize_postprocess(document.get("postprocess"), document=recipe, path="postprocess")
    data = copy.deepcopy(document)
    model = data["model"]
    if ("path" in model) == ("pytorch" in model):
        raise RecipeError("model", "give exactly one of model.path or model.pytorch", recipe=recipe)
    _resolve_paths(data, path.parent, recipe)
    for section in ("quantize", "validate", "golden"):
        source = (data.get(section) or {}).get("calibration" if section == "quantize" else "data")
        if source is not None and ("images" in source) == ("npz" in source):
            key = f"{section}.{'calibration' if section == 'quantize' else 'data'}"
            raise RecipeError(key, "give exactly one of images or npz", recipe=recipe)
    quantize = data.get("quantize") or {}
    if quantize.get("mode") == "static" and "calibration" not in quantize:
        raise RecipeError("quantize.calibration", "static quantization needs calibration data", recipe=recipe)
    return Recipe(path=path.resolve(), data=data)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file. Raises RecipeError/SchemaError naming the key."""
    path = Path(path)
    document = read_yaml_file(path, MAX_RECIPE_BYTES, lambda problem: RecipeError("<file>", problem, recipe=str(path)),
                              kind="recipe")
    if not isinstance(document, dict):
        raise SchemaError("", "a recipe must be a mapping of keys", document=str(path))
    return check_recipe(document, path)
