"""Recipes: the YAML a user writes to describe one build.

A recipe is validated completely before any model is loaded: unknown keys and wrong types
are rejected with the key's dotted path, and every referenced file is checked to exist.
Relative paths are resolved against the recipe file's directory. Then it is parsed once into
a typed, frozen :class:`Recipe` whose sections are the passes' own option dataclasses. The
JSON Schema is generated from those declarations (:mod:`sdk.packager.options`):
``edgepack schema recipe`` prints it and ``schemas/recipe.schema.json`` is that output (a test
keeps the file and docs/packager.md's key table in sync).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgepack_core.postprocess_spec import POSTPROCESS_SCHEMA, PostprocessSpec, parse_postprocess
from edgepack_core.preprocess_spec import PREPROCESS_SCHEMA, PreprocessSpec, parse_preprocess
from edgepack_core.schema import validate
from edgepack_core.targets import PROFILES
from edgepack_core.versions import VERSION_PATTERN
from edgepack_core.yamlfile import read_yaml_file
from sdk.errors import RecipeError, SchemaError
from sdk.packager.declared import gaps_problem
from sdk.packager.options import option, parse_fields, schema_of
from sdk.packager.passes.golden import GoldenOptions
from sdk.packager.passes.golden_stream import GoldenStreamOptions, check_section
from sdk.packager.passes.load import ModelOptions
from sdk.packager.passes.optimize_options import OptimizeOptions
from sdk.packager.passes.quantize import QuantizeOptions
from sdk.packager.passes.validate import ValidateOptions
from sdk.packager.sources import InputOptions, OutputOptions

MAX_RECIPE_BYTES = 1024 * 1024

_TARGET_ONNXRUNTIME = {
    "type": "object",
    "additionalProperties": False,
    "description": "the onnxruntime a target's devices really run, when not the profile's default "
                   "(e.g. {rpi: 1.20.0} for Pis that pip-installed a newer wheel); the build refuses "
                   "an artifact that needs more",
    "properties": {name: {"type": "string", "pattern": r"^\d+\.\d+(\.\d+)?$"} for name in sorted(PROFILES)},
}
_NO_KEYS: Mapping[str, Any] = types.MappingProxyType({})


@dataclass(frozen=True)
class SignOptions:
    """``sign``: read by the build before any pass (``--key`` wins)."""

    key: str | None = option(None, description="the private key that signs the artifact", minLength=1)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe, parsed once into typed, frozen sections: each pass reads its own
    (``recipe.optimize``, ``recipe.quantize``, ...), declared next to the pass. The recipe's
    JSON Schema is generated from this class (:data:`RECIPE_SCHEMA`).

    ``path``: the recipe file. ``data``: the validated document with every path made absolute,
    for tools that derive a new recipe from it (passes read the typed sections). ``root``: the
    folder every path of the recipe had to resolve inside (None when the build allowed
    external paths); loaders of folders check each file against it too, so a symlink inside a
    data folder cannot reach out either."""

    INTERNAL = ("path", "data", "root")  # not recipe keys

    path: Path
    data: Mapping[str, Any]
    name: str = option(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    version: str = option(pattern=VERSION_PATTERN)
    model: ModelOptions = option()
    description: str | None = None
    inputs: Mapping[str, InputOptions] = option(_NO_KEYS, description="Per input name: shape, dtype, synthetic "
                                                "range, role (tensor, constant, image, audio, state).")
    outputs: Mapping[str, OutputOptions] = option(_NO_KEYS, description="Per output name: whether NaN/inf are "
                                                  "answers there (allow_non_finite).")
    preprocess: PreprocessSpec = option(PreprocessSpec(), schema=PREPROCESS_SCHEMA, parse=parse_preprocess)
    postprocess: PostprocessSpec = option(PostprocessSpec(), schema=POSTPROCESS_SCHEMA, parse=parse_postprocess)
    optimize: OptimizeOptions = field(default_factory=OptimizeOptions)
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)
    validate: ValidateOptions = field(default_factory=ValidateOptions)
    golden: GoldenOptions = field(default_factory=GoldenOptions)
    golden_stream: GoldenStreamOptions = field(default_factory=GoldenStreamOptions)
    targets: tuple[str, ...] = option(("x86",), description="the device profiles the artifact is for", minItems=1,
                                      items={"enum": sorted(PROFILES)})
    target_onnxruntime: Mapping[str, str] = option(_NO_KEYS, schema=_TARGET_ONNXRUNTIME,
                                                   parse=types.MappingProxyType)
    sign: SignOptions = field(default_factory=SignOptions)
    output: str | None = option(None, description="where the artifact is written (--output wins)", minLength=1)
    root: Path | None = None


RECIPE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://edgepack.dev/schemas/recipe.schema.json",
    "title": "Edgepack build recipe",
    **schema_of(Recipe),
}


# The sections parsed by edgepack_core's own spec parsers (with the recipe's name in their errors).
_SPECS = ("preprocess", "postprocess")

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
    (("golden_stream", "clip"), True),
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
    data = copy.deepcopy(document)
    model = data["model"]
    if ("path" in model) == ("pytorch" in model):
        raise RecipeError("model", "give exactly one of model.path or model.pytorch", recipe=recipe)
    base = path.parent.resolve()
    root = None if allow_external_paths else base
    _resolve_paths(data, base, recipe, root)
    _check_inputs(data.get("inputs") or {}, recipe)
    _check_roles(data, recipe)
    # Parsed once, with the paths resolved and the role's input in: the typed parsers check what a
    # schema cannot (one mean/std value per channel, detection outputs), naming the recipe's key.
    preprocess = parse_preprocess(data.get("preprocess"), document=recipe, path="preprocess")
    gaps = gaps_problem(preprocess)
    if gaps is not None:
        raise RecipeError("preprocess.hop", gaps, recipe=recipe)
    postprocess = parse_postprocess(data.get("postprocess"), document=recipe, path="postprocess")
    _check_data_consent(data, recipe)
    check_section(data, str(data["name"]), recipe)
    quantize = data.get("quantize") or {}
    if quantize.get("mode") == "static" and "calibration" not in quantize:
        raise RecipeError("quantize.calibration", "static quantization needs calibration data", recipe=recipe)
    fields = parse_fields(Recipe, {key: value for key, value in data.items() if key not in _SPECS})
    return Recipe(path=path.resolve(), data=data, root=root, preprocess=preprocess, postprocess=postprocess, **fields)


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
