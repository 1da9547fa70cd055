"""Two ``onnx.backend.base.Backend`` implementations driven by onnx's own backend test runner.

``BareOrtBackend`` is plain onnxruntime (one CPU session, the model as given): the reference
that decides which tests onnxruntime of this version passes at all. ``edgepack_backend(ws)``
returns a backend whose representation goes Edgepack's real path: at its first ``run`` (onnx's
runner hands inputs over only then) it writes the model and the test's own inputs, builds a
signed artifact in-process with a minimal recipe that uses those inputs as validation and
golden data, verifies and extracts it with the device's verifier, loads it with the agent's
loading code (golden smoke test included) and answers through the agent's inference service.
Later ``run`` calls reuse the loaded model, as a device would.

Each failure is raised as a :class:`StageFailure` naming the stage (``build``, ``verify``,
``load``, ``run``) and keeping every line of the underlying error, so the driver can group
failures by cause.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep

# Where the test's own inputs go: the agreed `{test_data: DIR}` source (ONNX test data sets)
# or an npz whose arrays have each input's own rank (one sample).
DATA_SOURCES = ("test_data", "npz")


class StageFailure(Exception):
    """A test failed at one stage of Edgepack's path; ``str()`` is ``stage: Type: message``."""

    def __init__(self, stage: str, error: BaseException) -> None:
        self.stage = stage
        self.error_type = type(error).__name__
        self.detail = str(error).strip()
        super().__init__(f"{stage}: {self.error_type}: {self.detail}")


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Tag any exception raised inside with the stage it came from (and keep it as the cause)."""
    try:
        yield
    except StageFailure:
        raise
    except Exception as err:  # every error of the stage is re-raised, tagged, never swallowed
        raise StageFailure(name, err) from err


def feed_names(model: onnx.ModelProto, count: int) -> list[str]:
    """Names of the inputs a test feeds, in order. IR-3 models also list their initializers as
    graph inputs; onnx's test data then holds values for the real inputs only."""
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input]
    if count == len(names):
        return names
    return [n for n in names if n not in initializers][:count]


class BareOrtRep(BackendRep):
    """One onnxruntime CPU session over the model exactly as the test gives it."""

    def __init__(self, model: onnx.ModelProto) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4  # the driver reports the error itself
        self.model = model
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        # The runner may hand over numpy scalars; onnxruntime's Python API takes arrays.
        feed = {n: np.asarray(v) for n, v in zip(feed_names(self.model, len(inputs)), inputs, strict=True)}
        return tuple(self.session.run(None, feed))


class BareOrtBackend(Backend):
    """Plain onnxruntime: no checker, no conversion, the model as the test gives it."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> BareOrtRep:
        return BareOrtRep(model)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


@dataclass
class Workspace:
    """Per-process scratch space: one signing key pair and a folder per test case."""

    root: Path
    data_source: str = "test_data"
    # The running test's expected outputs (graph output order), set by the driver before each
    # case: onnx's runner gives a backend only the inputs, but a user's test data sets carry
    # outputs too, and the build checks them (output_N.pb in the test_data source).
    expected: list[np.ndarray] | None = None
    _counter: Iterator[int] = field(default_factory=itertools.count)
    _private: Path | None = None
    _trust: Any = None

    @classmethod
    def create(cls, data_source: str = "test_data") -> Workspace:
        if data_source not in DATA_SOURCES:
            raise ValueError(f"data source must be one of {', '.join(DATA_SOURCES)}")
        return cls(Path(tempfile.mkdtemp(prefix="edgepack-conformance-")), data_source)

    def keys(self) -> tuple[Path, Any]:
        """The private key path and the matching trust store, made once."""
        if self._private is None:
            from edgepack_core.signing import TrustStore, load_public_key
            from sdk.keys import write_keypair

            private, public = self.root / "release.key", self.root / "release.pub"
            write_keypair(private, public)
            self._private, self._trust = private, TrustStore([load_public_key(public)])
        return self._private, self._trust

    def case_dir(self) -> Path:
        path = self.root / f"case-{next(self._counter):05d}"
        path.mkdir()
        return path

    def clear_cases(self) -> None:
        """Remove every case folder (called by the driver after each test)."""
        for child in self.root.glob("case-*"):
            shutil.rmtree(child, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _string_safe(array: np.ndarray) -> np.ndarray:
    """npz cannot hold object arrays without pickle: strings become a fixed-width unicode array."""
    return array.astype(str) if array.dtype == object else array


def write_test_data(folder: Path, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray] | None = None
                    ) -> None:
    """Write one ONNX test data set (``test_data_set_0/input_N.pb`` and ``output_N.pb``, each
    tensor named after its model input or output), the layout of onnxruntime's test runner."""
    data_set = folder / "test_data_set_0"
    data_set.mkdir(parents=True)
    for kind, tensors in (("input", inputs), ("output", outputs or {})):
        for n, (name, value) in enumerate(tensors.items()):
            tensor = numpy_helper.from_array(np.asarray(value), name)
            (data_set / f"{kind}_{n}.pb").write_bytes(tensor.SerializeToString())


def non_finite(value: np.ndarray) -> bool:
    return np.asarray(value).dtype.kind == "f" and not np.isfinite(value).all()


def minimal_recipe(model: str, source: dict[str, Any], non_finite_inputs: Sequence[str] = (),
                   non_finite_outputs: Sequence[str] = ()) -> dict[str, Any]:
    """The recipe an ML engineer with one model and one sample would write: raw outputs, default
    optimization, no quantization, the sample as validation and golden data; an input whose
    sample holds NaN/inf is declared to take them (``allow_non_finite``), and an output whose
    expected answer holds NaN/inf to give them (the agent refuses them otherwise), as its owner
    would."""
    document: dict[str, Any] = {
        "name": "conformance",
        "version": "1.0.0",
        "model": {"path": model},
        "postprocess": {"kind": "raw"},
        "validate": {"data": dict(source)},
        "golden": {"data": dict(source)},
    }
    if non_finite_inputs:
        document["inputs"] = {name: {"allow_non_finite": True} for name in non_finite_inputs}
    if non_finite_outputs:
        document["outputs"] = {name: {"allow_non_finite": True} for name in non_finite_outputs}
    return document


def recipe_from_document(document: dict[str, Any], base_dir: Path) -> Any:
    """A validated Recipe from a dict, through the recipe module's own entry point."""
    from sdk import recipe as recipes

    from_dict = getattr(recipes, "recipe_from_dict", None)
    if from_dict is not None:
        return from_dict(document, base_dir)
    return recipes.check_recipe(document, base_dir / "recipe.yaml")


class EdgepackRep(BackendRep):
    """Builds, verifies and loads an artifact at the first ``run``; answers through the agent."""

    def __init__(self, model: onnx.ModelProto, workspace: Workspace) -> None:
        self.model = model
        self.workspace = workspace
        self.service: Any = None
        self.output_names = [o.name for o in model.graph.output]

    def _data_source(self, case: Path, names: Sequence[str], inputs: Sequence[np.ndarray]) -> dict[str, Any]:
        if self.workspace.data_source == "npz":
            np.savez(case / "data.npz", **{n: _string_safe(np.asarray(v)) for n, v in zip(names, inputs, strict=True)})
            return {"npz": "data.npz"}
        expected = self.workspace.expected
        outputs = dict(zip(self.output_names, expected, strict=True)) if expected is not None else None
        write_test_data(case / "data", dict(zip(names, inputs, strict=True)), outputs)
        return {"test_data": "data"}

    def _build_and_load(self, inputs: Sequence[np.ndarray]) -> None:
        from device_agent.runtime import InferenceService, load_model
        from edgepack_core.artifact import extract_artifact
        from sdk.packager.pipeline import build

        private, trust = self.workspace.keys()
        case = self.workspace.case_dir()
        names = feed_names(self.model, len(inputs))
        onnx.save(self.model, str(case / "model.onnx"))
        source = self._data_source(case, names, inputs)
        with stage("build"):
            declared = [n for n, v in zip(names, inputs, strict=True) if non_finite(v)]
            expected = self.workspace.expected if self.workspace.data_source != "npz" else None
            answers = [n for n, v in zip(self.output_names, expected or (), strict=False) if non_finite(v)]
            recipe = recipe_from_document(minimal_recipe("model.onnx", source, declared, answers), case)
            build(recipe, key_paths=[str(private)], output=case / "model.edgepkg")
        with stage("verify"):
            verified = extract_artifact(case / "model.edgepkg", case / "installed", trust)
        with stage("load"):
            loaded = load_model(verified.root, verified.manifest)
        self.service = InferenceService(loaded)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        inputs = [np.asarray(v) for v in inputs]
        if self.service is None:
            self._build_and_load(inputs)
        names = feed_names(self.model, len(inputs))
        with stage("run"):
            specs = self.service.model.input_specs
            feed = {n: v for n, v in zip(names, inputs, strict=True) if n in specs}
            result = self.service.predict_tensors(feed, postprocess=True)
            return tuple(result.outputs[name] for name in self.output_names)


def edgepack_backend(workspace: Callable[[], Workspace]) -> type[Backend]:
    """A Backend class whose representations use ``workspace()`` (onnx's runner calls backends
    through classmethods; the driver makes one workspace per worker process)."""

    class EdgepackBackend(Backend):
        @classmethod
        def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> EdgepackRep:
            return EdgepackRep(model, workspace())

        @classmethod
        def supports_device(cls, device: str) -> bool:
            return device == "CPU"

    return EdgepackBackend
