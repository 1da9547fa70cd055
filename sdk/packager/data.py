"""Sample data for calibration, validation and golden samples.

Three layouts carry real inputs (docs/packager.md, "Data"):

- ``{npz: FILE}``: per input, an array of the input's own rank is one sample and an array with
  one more leading axis is a stack of samples; ``sample_axis`` settles the ambiguous cases.
- ``{test_data: DIR}``: ONNX test data sets (``test_data_set_*/input_*.pb``), the layout of
  onnxruntime's test runner and of the ONNX backend tests; ``output_*.pb`` become expected
  outputs that the build checks.
- ``{images: DIR}``: images through the device's own preprocessing code, so the host measures
  exactly what a device computes.
- ``{audio: DIR}``: WAV files through the audio preprocessing (the device's code too); every
  frame of every file is one sample.

Made-up inputs (``synthetic``) only where the recipe consents; they honour the recipe's
declared shapes, dtypes, ranges and constants and keep index inputs in range. Inputs declared
``role: constant`` are fed their value in every sample, whatever the source; inputs declared
``role: state`` are fed their init value (zeros), as a stream's first call is. Audio samples are
also sequences (a file's frames, in order): :attr:`Samples.sequences` records them, so that
validation can carry a state from frame to frame as the agent does and calibration can see the
state values the model really meets (:mod:`sdk.packager.sequences`); other sources have none.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepack_core import audio
from edgepack_core.errors import PreprocessError
from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import PreprocessSpec
from sdk.errors import RecipeError
from sdk.packager.sources import DataSource, InputOptions, OutputOptions

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}
MAX_PB_BYTES = 1 << 30  # one test-data tensor file; bounded before it is read
Feed = dict[str, np.ndarray]
Declared = Mapping[str, InputOptions]  # the recipe's ``inputs`` section
_UNDECLARED = InputOptions()


@dataclass
class Samples:
    """Model-ready feeds (every input, constants included), optional integer labels and
    optional expected outputs (from test data), one per feed; ``names`` says where each
    sample came from, for messages.

    ``sequences``: ``(first, stop)`` index ranges of feeds that are consecutive frames of one
    stream (an audio file), in order and covering every feed; None where samples stand alone
    (npz, test data, images, synthetic). ``carry``: each ``role: state`` input and the output
    carried into it. Both together make the samples *sequential*: the agent would run each
    range as one stream, its state carried from frame to frame, and so must the checks."""

    feeds: list[Feed]
    labels: list[int] | None = None
    expected: list[dict[str, np.ndarray]] | None = None
    names: list[str] = field(default_factory=list)
    sequences: list[tuple[int, int]] | None = None
    carry: dict[str, str] = field(default_factory=dict)
    # Audio files whose rate was not the spec's and that were resampled to it: name -> their rate.
    resampled: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.feeds)

    @property
    def sequential(self) -> bool:
        """Whether state must be carried across samples: a stateful model on stream data."""
        return bool(self.carry) and self.sequences is not None

    def starts(self) -> list[bool]:
        """Per feed, whether it starts from its own (init) state: the first frame of each
        sequence, or every feed when the samples are not sequential."""
        if not self.sequential:
            return [True] * len(self.feeds)
        flags = [False] * len(self.feeds)
        for first, stop in self.sequences or ():
            if first < stop:
                flags[first] = True
        return flags

    def name(self, index: int) -> str:
        return self.names[index] if index < len(self.names) else f"sample {index}"


def _numpy_dtype(name: str) -> np.dtype:
    if name == "string":
        return np.dtype(str)
    return np.dtype(np.float32 if name == "bfloat16" else name)


def _fixed_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Symbolic dims become 1 (the documented default of synthetic data)."""
    return tuple(d if isinstance(d, int) and d >= 0 else 1 for d in spec.shape)


def _target_input(preprocess: PreprocessSpec, inputs: Sequence[TensorSpec]) -> str:
    return preprocess.input or inputs[0].name


def shape_fits(shape: Sequence[int], declared: Sequence[int | str]) -> bool:
    """Symbolic dims match any size; fixed dims must be equal; the rank must agree."""
    return len(shape) == len(declared) and all(
        not isinstance(d, int) or d < 0 or d == s for s, d in zip(shape, declared, strict=True))


# ---------------------------------------------------------------- dtypes and constants


def as_input_dtype(array: Any, spec: TensorSpec, where: str) -> np.ndarray:
    """``array`` as the dtype of ``spec``, exactly: a cast is allowed only when no value
    changes kind or overflows (float64 data for a float32 input rounds, as any export does).
    Strings become numpy unicode arrays (onnxruntime takes them; npz stores them without pickle)."""
    array = np.asarray(array)
    if spec.dtype == "string":
        if array.dtype.kind == "U":
            return array
        if array.dtype.kind in "SO":
            try:
                return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else str(v), otypes=[str])(array) \
                    if array.size else array.astype(str)
            except UnicodeDecodeError as err:
                raise RecipeError(where, f"input {spec.name}: strings must be UTF-8") from err
        raise RecipeError(where, f"input {spec.name} takes strings, the data is {array.dtype.name}")
    target = _numpy_dtype(spec.dtype)
    if array.dtype == target:
        return array
    if target.kind == "b" or array.dtype.kind not in "biuf" or not np.can_cast(array.dtype, target, "same_kind"):
        raise RecipeError(where, f"input {spec.name} is {spec.dtype}, the data is {array.dtype.name}")
    converted = array.astype(target)
    if target.kind in "iu" and not np.array_equal(converted.astype(array.dtype), array):
        raise RecipeError(where, f"input {spec.name} is {spec.dtype}: the data's values do not fit")
    return converted


def constant_feeds(inputs: Sequence[TensorSpec], declared: Declared) -> Feed:
    """The value of every input declared ``role: constant``, as arrays of the input's dtype
    and shape. Every declaration is checked against the model here (a name it lacks, a dtype
    it disagrees with, a bad value), so a mistake is a recipe error naming the key."""
    by_name = {spec.name: spec for spec in inputs}
    constants: Feed = {}
    for name, decl in declared.items():
        if name not in by_name:
            raise RecipeError(f"inputs.{name}", f"the model has no input {name!r} (inputs: {', '.join(by_name)})")
        spec = by_name[name]
        if decl.dtype is not None and decl.dtype != spec.dtype:
            raise RecipeError(f"inputs.{name}.dtype", f"is {decl.dtype}, the model's input is {spec.dtype}")
        if decl.role != "constant":
            continue
        key = f"inputs.{name}.value"
        try:
            raw = np.asarray(decl.value)
        except ValueError as err:
            raise RecipeError(key, f"not a regular nested list ({err})") from err
        value = as_input_dtype(raw, spec, key)
        if not shape_fits(value.shape, spec.shape):
            raise RecipeError(key, f"has shape {list(value.shape)}, input {name} has shape {list(spec.shape)}")
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise RecipeError(key, "holds NaN or infinity, which the manifest (JSON) cannot carry")
        constants[name] = value
    return constants


def state_feeds(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], declared: Declared) -> Feed:
    """The init value (zeros; symbolic dims 1) of every input declared ``role: state``, after
    checking that the output it is carried from exists with the same dtype and shape (fixed dims
    equal, a symbolic dim matches anything). ``outputs`` empty: the check is left out."""
    by_output = {spec.name: spec for spec in outputs}
    states: Feed = {}
    for spec in inputs:
        decl = declared.get(spec.name, _UNDECLARED)
        if decl.role != "state":
            continue
        source = by_output.get(str(decl.output))
        if outputs and source is None:
            raise RecipeError(f"inputs.{spec.name}.output", f"the model has no output {decl.output!r} "
                              f"(outputs: {', '.join(by_output)})")
        if source is not None and (source.dtype != spec.dtype or len(source.shape) != len(spec.shape) or any(
                isinstance(a, int) and isinstance(b, int) and a != b
                for a, b in zip(source.shape, spec.shape, strict=True))):
            raise RecipeError(f"inputs.{spec.name}.output", f"output {source.name} is {source.dtype} "
                              f"{list(source.shape)}, the state input is {spec.dtype} {list(spec.shape)}")
        states[spec.name] = np.zeros(_fixed_shape(spec), dtype=_numpy_dtype(spec.dtype))
    return states


def carried_outputs(inputs: Sequence[TensorSpec], declared: Declared) -> dict[str, str]:
    """Each input declared ``role: state`` -> the output the agent carries into it."""
    return {spec.name: str(declared[spec.name].output) for spec in inputs
            if declared.get(spec.name, _UNDECLARED).role == "state"}


def carried_feeds(samples: Samples, outputs: Sequence[Mapping[str, np.ndarray]]) -> list[Feed]:
    """``samples``' feeds with every state input set to what a stream would hold there: the
    carried output of the frame before in ``outputs`` (one per feed, from a run that carried
    its own state), init for the first frame of a sequence. Calibration needs this: fed init
    zeros only, a state input's range is 0 and int8 cannot represent any real state. Pure;
    the feeds as they are when the samples are not sequential."""
    if not samples.sequential:
        return list(samples.feeds)
    feeds: list[Feed] = []
    for index, (feed, start) in enumerate(zip(samples.feeds, samples.starts(), strict=True)):
        if start or index == 0:
            feeds.append(feed)
            continue
        previous = outputs[index - 1]
        feeds.append({**feed, **{name: np.asarray(previous[output]) for name, output in samples.carry.items()}})
    return feeds


def _role_fields(decl: InputOptions) -> dict[str, Any]:
    if decl.role in ("image", "audio"):
        return {"role": decl.role}
    if decl.role == "state":
        return {"role": "state", "output": decl.output, "init": decl.init}
    return {}


def manifest_inputs(inputs: Sequence[TensorSpec], declared: Declared) -> list[dict[str, Any]]:
    """The manifest's input specs: constants carry ``role: constant`` and their value (as the
    input's dtype makes it), which the agent feeds on every call; image/audio/state roles are
    recorded (a state input with its ``output`` and ``init``) for the agent to act on."""
    constants = constant_feeds(inputs, declared)
    non_finite = {name for name, decl in declared.items() if decl.allow_non_finite}
    return [{**spec.to_json(), **({"role": "constant", "value": constants[spec.name].tolist()}
                                  if spec.name in constants else _role_fields(declared.get(spec.name, _UNDECLARED))),
             **({"allow_non_finite": True} if spec.name in non_finite else {})} for spec in inputs]


def manifest_outputs(outputs: Sequence[TensorSpec], declared: Mapping[str, OutputOptions]) -> list[dict[str, Any]]:
    """The manifest's output specs: ``allow_non_finite`` where the recipe declares it (the agent
    then serves NaN/inf there, flagged, instead of answering 500)."""
    allowed = {name for name, decl in declared.items() if decl.allow_non_finite}
    return [{**spec.to_json(), **({"allow_non_finite": True} if spec.name in allowed else {})} for spec in outputs]


def tensor_inputs(inputs: Sequence[TensorSpec], declared: Declared) -> list[TensorSpec]:
    """The inputs data must supply: all but the constants and the state inputs."""
    return [s for s in inputs if declared.get(s.name, _UNDECLARED).role not in ("constant", "state")]


# ---------------------------------------------------------------- the entry point


def context_options(ctx: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`load_samples`/:func:`synthetic_samples` for a build."""
    return {"declared": ctx.recipe.inputs, "outputs": ctx.outputs, "root": ctx.recipe.root,
            "graph": ctx.original if ctx.original is not None else ctx.model}


def synthetic_options(ctx: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`synthetic_samples` for a build (its declarations and graph)."""
    return {k: v for k, v in context_options(ctx).items() if k != "root"}


def load_samples(
    source: DataSource, preprocess: PreprocessSpec, inputs: Sequence[TensorSpec], *, key: str,
    limit: int | None = None, declared: Declared | None = None, outputs: Sequence[TensorSpec] = (),
    root: Path | None = None, graph: Any = None,
) -> Samples:
    """Load ``source`` (a recipe data source) as feeds for every input of the model.

    ``declared`` is the recipe's ``inputs`` section (constants, sample axes, ranges);
    ``root`` the folder files must resolve inside (None: anywhere); ``graph`` the ONNX model,
    used by synthetic data to keep index inputs in range."""
    declared = declared or {}
    states = state_feeds(inputs, outputs, declared)
    if source.synthetic:
        return synthetic_samples(limit or 16, preprocess, inputs, declared=declared, graph=graph, outputs=outputs)
    limit = source.limit if source.limit is not None else limit
    constants = {**constant_feeds(inputs, declared), **states}
    if source.kind == "npz":
        samples = _load_npz(Path(str(source.path)), inputs, declared, source.sample_axis, key, limit)
    elif source.kind == "test_data":
        samples = _load_test_data(Path(str(source.path)), inputs, outputs, declared, key, limit, root)
    elif source.kind == "audio":
        samples = _load_audio(source, preprocess, inputs, declared, key, limit, root)
    else:
        samples = _load_images(source, preprocess, inputs, declared, key, limit, root)
    for feed in samples.feeds:
        feed.update(constants)
    samples.carry = carried_outputs(inputs, declared) if states else {}
    return samples


def _inside(path: Path, root: Path | None, key: str) -> Path:
    """Refuse a file (typically a symlink) inside a data folder that resolves outside the root."""
    resolved = path.resolve()
    if root is not None and resolved != root and root not in resolved.parents:
        raise RecipeError(key, f"{path} resolves to {resolved}, outside the recipe's folder {root}")
    return resolved


# ---------------------------------------------------------------- images


def _read_labels_csv(path: Path, key: str) -> dict[str, int]:
    labels: dict[str, int] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                labels[row["file"]] = int(row["label"])
            except (KeyError, ValueError) as err:
                raise RecipeError(key, f"{path}: needs columns file,label with integer labels") from err
    return labels


def _load_images(source: DataSource, preprocess: PreprocessSpec, inputs: Sequence[TensorSpec],
                 declared: Declared, key: str, limit: int | None, root: Path | None) -> Samples:
    folder = Path(str(source.path))
    if preprocess.kind != "image":
        raise RecipeError(f"{key}.images", "image data needs an image preprocessing spec (preprocess.kind: image)")
    name = _target_input(preprocess, inputs)
    others = [s.name for s in tensor_inputs(inputs, declared) if s.name != name]
    if others:
        raise RecipeError(f"{key}.images", f"images feed only input {name}; input(s) {', '.join(others)} need "
                          "npz or test_data, or role: constant")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise RecipeError(f"{key}.images", f"{folder} holds no images")
    files = files[:limit] if limit else files
    labels_map = _read_labels_csv(Path(source.labels), f"{key}.labels") if source.labels is not None else None
    pre = Preprocessor(preprocess)
    feeds: list[Feed] = []
    labels: list[int] = []
    for file in files:
        try:
            feeds.append({name: pre.from_path(_inside(file, root, f"{key}.images"))})
        except PreprocessError as err:
            raise RecipeError(f"{key}.images", f"{file.name}: {err}") from err
        if labels_map is not None:
            if file.name not in labels_map:
                raise RecipeError(f"{key}.labels", f"no label for {file.name}")
            labels.append(labels_map[file.name])
    return Samples(feeds, labels if labels_map is not None else None, names=[f.name for f in files])


def _load_audio(source: DataSource, preprocess: PreprocessSpec, inputs: Sequence[TensorSpec],
                declared: Declared, key: str, limit: int | None, root: Path | None) -> Samples:
    """Every frame of every .wav file (sorted by name) is one sample, until ``limit``; each
    file's frames are one sequence (a stream, as the agent runs a file)."""
    folder, where = Path(str(source.path)), f"{key}.audio"
    if preprocess.kind != "audio":
        raise RecipeError(where, "audio data needs an audio preprocessing spec (preprocess.kind: audio)")
    name = _target_input(preprocess, inputs)
    others = [s.name for s in tensor_inputs(inputs, declared) if s.name != name]
    if others:
        raise RecipeError(where, f"audio feeds only input {name}; input(s) {', '.join(others)} need npz or "
                          "test_data, or role: constant or state")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".wav")
    if not files:
        raise RecipeError(where, f"{folder} holds no .wav files")
    pre = Preprocessor(preprocess)
    feeds: list[Feed] = []
    names: list[str] = []
    sequences: list[tuple[int, int]] = []
    resampled: dict[str, int] = {}
    for file in files:
        frames, rate = _read_wav(pre, _inside(file, root, where), where)
        if rate != preprocess.sample_rate:
            resampled[file.name] = rate
        first = len(feeds)
        for index, frame in enumerate(frames):
            if limit and len(feeds) >= limit:
                break
            feeds.append({name: frame})
            names.append(f"{file.name} frame {index}")
        if len(feeds) > first:
            sequences.append((first, len(feeds)))
    return Samples(feeds, names=names, sequences=sequences, resampled=resampled)


def _read_wav(pre: Preprocessor, path: Path, where: str) -> tuple[np.ndarray, int]:
    """A WAV file's frames through the device's code, and the file's own sample rate."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RecipeError(where, f"{path.name}: cannot read ({err.strerror or err})") from err
    try:
        return pre.from_audio_bytes(data), audio.parse_wav_header(data, pre.max_audio_bytes)[0].rate
    except PreprocessError as err:
        raise RecipeError(where, f"{path.name}: {err}") from err


# ---------------------------------------------------------------- npz


def split_samples(array: np.ndarray, rank: int, axis: int | str | None, *, input_name: str) -> list[np.ndarray]:
    """The samples an npz array holds for an input of rank ``rank``. Pure.

    Without ``axis`` (``"auto"``): the input's own rank is one sample, one more axis is a stack
    along axis 0. ``axis=None``: the whole array is one sample. ``axis=k``: the samples run
    along axis k: dropped from an array of rank+1, kept as size 1 in an array of the input's
    rank (a batch axis: ``[n:n+1]``)."""
    if axis is None:
        return [array]
    if axis == "auto":
        if array.ndim == rank:
            return [array]
        if array.ndim == rank + 1:
            return list(array)
        raise ValueError(f"input {input_name} has rank {rank}: an array of rank {rank} is one sample, of rank "
                         f"{rank + 1} a stack of samples; this one has rank {array.ndim} (set sample_axis)")
    if not isinstance(axis, int) or not 0 <= axis < max(array.ndim, 1) or array.ndim == 0:
        raise ValueError(f"sample_axis {axis} of input {input_name} is not an axis of its array "
                         f"(shape {list(array.shape)})")
    if array.ndim == rank + 1:
        return [np.take(array, n, axis=axis) for n in range(array.shape[axis])]
    if array.ndim == rank:
        return [np.take(array, [n], axis=axis) for n in range(array.shape[axis])]
    raise ValueError(f"input {input_name} has rank {rank}; with sample_axis {axis} its array needs rank {rank} "
                     f"or {rank + 1}, not {array.ndim}")


def _read_npz(path: Path, key: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):
                raise ValueError("a single .npy array, not an .npz archive")
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError) as err:
        raise RecipeError(key, f"{path}: not a readable .npz without pickles ({err})") from err


def _split_npz(arrays: Mapping[str, np.ndarray], wanted: Sequence[TensorSpec], declared: Declared,
               axes: Mapping[str, Any], key: str, file: str) -> dict[str, list[np.ndarray]]:
    """Each wanted input's samples, split along its sample axis (the source's, else the input's)."""
    per_input: dict[str, list[np.ndarray]] = {}
    for spec in wanted:
        axis = axes[spec.name] if spec.name in axes else declared.get(spec.name, _UNDECLARED).sample_axis
        where = f"{key}.sample_axis.{spec.name}" if spec.name in axes else f"{key}.npz"
        try:
            per_input[spec.name] = split_samples(arrays[spec.name], len(spec.shape), axis, input_name=spec.name)
        except ValueError as err:
            raise RecipeError(where, f"{file}: {err}") from err
    return per_input


def _load_npz(path: Path, inputs: Sequence[TensorSpec], declared: Declared, axes: Mapping[str, Any], key: str,
              limit: int | None) -> Samples:
    arrays = _read_npz(path, f"{key}.npz")
    wanted = tensor_inputs(inputs, declared)
    names = {s.name for s in inputs}
    has_labels = "label" in arrays and "label" not in names
    unknown = sorted(set(arrays) - names - ({"label"} if has_labels else set()))
    if unknown:
        raise RecipeError(f"{key}.npz", f"{path.name}: array(s) {', '.join(unknown)} match no model input "
                          f"(inputs: {', '.join(sorted(names))})")
    for name in axes:
        if name not in names:
            raise RecipeError(f"{key}.sample_axis.{name}", "the model has no such input")
    missing = [s.name for s in wanted if s.name not in arrays]
    if missing:
        raise RecipeError(f"{key}.npz", f"{path.name}: no array for input(s) {', '.join(missing)}")
    per_input = _split_npz(arrays, wanted, declared, axes, key, path.name)
    counts = {name: len(values) for name, values in per_input.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name}: {n}" for name, n in counts.items())
        raise RecipeError(f"{key}.npz", f"{path.name}: inputs hold different numbers of samples ({listed})")
    count = next(iter(counts.values()), 0)
    count = min(count, limit) if limit else count
    if count == 0:
        raise RecipeError(f"{key}.npz", f"{path.name} holds no samples")
    feeds = [{s.name: as_input_dtype(per_input[s.name][n], s, f"{key}.npz") for s in wanted} for n in range(count)]
    labels = None
    if has_labels:
        label_array = np.asarray(arrays["label"]).reshape(-1)
        if len(label_array) < count:
            raise RecipeError(f"{key}.npz", f"{path.name}: {len(label_array)} labels for {count} samples")
        labels = [int(v) for v in label_array[:count]]
    return Samples(feeds, labels, names=[f"{path.name} sample {n}" for n in range(count)])


# ---------------------------------------------------------------- ONNX test data sets


def _natural_key(path: Path) -> tuple[Any, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name))


def find_test_data_sets(folder: Path) -> list[Path]:
    """The test data set folders of ``folder``: itself when it holds input_*.pb, else its
    test_data_set_* folders in natural order."""
    if any(folder.glob("input_*.pb")):
        return [folder]
    return sorted((p for p in folder.glob("test_data_set_*") if p.is_dir()), key=_natural_key)


def read_tensor_pb(path: Path) -> tuple[str, np.ndarray]:
    """One serialized onnx.TensorProto -> (its name, the array). Strings become unicode."""
    import onnx
    from onnx import numpy_helper

    size = path.stat().st_size
    if size > MAX_PB_BYTES:
        raise ValueError(f"{size} bytes, over the limit of {MAX_PB_BYTES}")
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(path.read_bytes())
    except Exception as err:  # protobuf's DecodeError
        raise ValueError(f"not a serialized TensorProto ({type(err).__name__}: {err})") from err
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.external_data:
        # Its values would be read from a path the file names: a test data set must not make
        # the build read (and sign into golden samples) a file outside the recipe's folder.
        raise ValueError("stores its values in an external file; test data tensors must hold their data")
    try:
        array = numpy_helper.to_array(tensor)
    except Exception as err:  # protobuf's DecodeError and onnx's ValueError/TypeError
        raise ValueError(f"not a serialized TensorProto ({type(err).__name__}: {err})") from err
    if tensor.data_type == onnx.TensorProto.STRING:
        array = np.vectorize(lambda v: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v),
                             otypes=[str])(array) if array.size else array.astype(str)
    return tensor.name, array


def _match_tensors(files: list[Path], specs: Sequence[TensorSpec], where: str, root: Path | None
                   ) -> dict[str, np.ndarray]:
    """Name each file's tensor after the spec of its TensorProto name, else of its position."""
    by_name = {s.name for s in specs}
    matched: dict[str, np.ndarray] = {}
    for position, file in enumerate(files):
        try:
            name, array = read_tensor_pb(_inside(file, root, where))
        except (OSError, ValueError) as err:
            raise RecipeError(where, f"{file}: {err}") from err
        if name not in by_name:
            if position >= len(specs):
                raise RecipeError(where, f"{file}: the model has only {len(specs)} of these")
            name = specs[position].name
        if name in matched:
            raise RecipeError(where, f"{file.parent.name}: two files for {name}")
        matched[name] = array
    return matched


def _load_test_data(folder: Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], declared: Declared,
                    key: str, limit: int | None, root: Path | None) -> Samples:
    where = f"{key}.test_data"
    sets = find_test_data_sets(folder)
    if not sets:
        raise RecipeError(where, f"{folder} holds no test_data_set_* folder and no input_*.pb")
    sets = sets[:limit] if limit else sets
    wanted = tensor_inputs(inputs, declared)
    feeds: list[Feed] = []
    expected: list[dict[str, np.ndarray]] = []
    for data_set in sets:
        matched = _match_tensors(sorted(data_set.glob("input_*.pb"), key=_natural_key), inputs, where, root)
        missing = [s.name for s in wanted if s.name not in matched]
        if missing:
            raise RecipeError(where, f"{data_set.name}: no tensor for input(s) {', '.join(missing)}")
        feeds.append({s.name: as_input_dtype(matched[s.name], s, where) for s in wanted})
        expected.append(_match_tensors(sorted(data_set.glob("output_*.pb"), key=_natural_key), outputs, where, root))
    return Samples(feeds, expected=expected if any(expected) else None, names=[s.name for s in sets])


# The made-up inputs live in their own module; the old import path keeps working.
from sdk.packager.synthetic import synthetic_samples as synthetic_samples  # noqa: E402
