"""The pass interface of the packager (after Olive): each step is a small registered unit.

A pass declares its name and whether it applies to a given build; the options it reads are a
frozen dataclass declared next to it (``OptimizeOptions``, ``QuantizeOptions``, ...), which the
typed :class:`~sdk.recipe.Recipe` holds as a section and the recipe's JSON Schema is generated
from (:mod:`sdk.packager.options`). ``run`` transforms the :class:`BuildContext` in place and records what it
did in ``ctx.report[name]``. The pipeline (``sdk.packager.pipeline``) lists pass names in
order, so adding an optimization is: write a pass, register it, put its name in the list.
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import onnx

from edgepack_core.golden_stream import GoldenStreamField
from edgepack_core.manifest import TensorSpec
from edgepack_core.postprocess_spec import PostprocessSpec
from edgepack_core.preprocess_spec import PreprocessSpec
from sdk.packager.ort_worker import holds_float16
from sdk.packager.quant_facts import quant_facts

if TYPE_CHECKING:  # sdk.recipe imports the passes for their options; the results are the passes' own types
    from sdk.packager.passes.golden import GoldenSet
    from sdk.packager.passes.preprocess_graph import PreprocessLowering
    from sdk.packager.passes.runtime_compat import RuntimeRequirement
    from sdk.recipe import Recipe

Progress = Callable[[str], None]
LossyPrecision = Literal["fp16", "int8"]


@dataclass
class BuildContext:
    """Everything a pass may read or change during one build. The facts passes hand each
    other are typed fields, each set by one pass and read by the later ones and by
    ``pipeline.assemble_manifest``, the one place the manifest is written:

    - ``inputs``/``outputs``, ``preprocess``/``postprocess``: the I/O spec, the specs typed as
      the recipe parsed them (io_spec bundles the assets and resolves ``apply_softmax``;
      fix_shapes and preprocess_graph change it);
    - ``lossy``: the precision a lossy pass shipped (fp16, or quantize's decision: int8/fp16),
      None while the model computes what the original did;
    - ``lowering``: ``preprocess.in_graph`` planned (preprocess_graph_plan), then done
      (preprocess_graph);
    - ``ort_member``: the ``.ort`` file's member (ort_format);
    - ``golden``: the golden samples and their tolerances (golden);
    - ``golden_stream``: the golden clip's members, frames and pipeline fragment (golden_stream);
    - ``runtime``: opsets and the minimum onnxruntime of the final graph (runtime_compat);
    - ``original``: the reference validation compares with: the model as loaded, its
      initializers constant (load) and its inputs shaped as the recipe says (shape_inference),
      so onnxruntime computes it as it computes the packaged form;
    - ``model_sizes``: the model's bytes after each pass that ran (the pipeline), which
      artifact_size names when the model grew.
    """

    recipe: Recipe
    workdir: Path
    progress: Progress = lambda message: None
    model: onnx.ModelProto | None = None
    original: onnx.ModelProto | None = None
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    preprocess: PreprocessSpec = field(default_factory=PreprocessSpec)
    postprocess: PostprocessSpec = field(default_factory=PostprocessSpec)
    files: dict[str, bytes] = field(default_factory=dict)
    lossy: LossyPrecision | None = None
    lowering: PreprocessLowering | None = None
    ort_member: str | None = None
    golden: GoldenSet | None = None
    golden_stream: GoldenStreamField | None = None
    runtime: RuntimeRequirement | None = None
    report: dict[str, Any] = field(default_factory=dict)
    model_sizes: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.progress(f"warning: {message}")

    def require_model(self) -> onnx.ModelProto:
        if self.model is None:
            raise RuntimeError("no model loaded: the load pass must run first")
        return self.model

    def model_bytes(self) -> bytes:
        return self.require_model().SerializeToString()

    def precision(self) -> str:
        """What the model computes in: the lossy pass that changed it says so (``int8``,
        ``fp16``); otherwise ``fp16`` when the graph itself holds float16 (a model exported in
        fp16, or with float16 parts) and ``fp32`` else; ``int8`` for a model that came quantized
        (``quant_facts``: QDQ, QLinear*, *Integer, DynamicQuantize*, Cast of int8 weights). The
        manifest records it, the agent picks its session options by it, and golden tolerances
        widen for it."""
        if self.lossy is not None:
            return self.lossy
        model = self.require_model()
        return quant_facts(model).precision or ("fp16" if holds_float16(model) else "fp32")

    def new_tempdir(self, prefix: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.workdir))


class Pass(ABC):
    """One packager step. Subclasses set ``name`` and implement ``run``; a pass reads its
    options from its typed section of ``ctx.recipe`` (``ctx.recipe.optimize``)."""

    name: ClassVar[str]
    # A graph rewrite the pipeline checks after it runs (sdk.packager.pass_guard): "lossless"
    # must keep every output within tolerance, "lossy" must keep the graph valid and runnable.
    guard: ClassVar[Literal["lossless", "lossy"] | None] = None

    def applies(self, ctx: BuildContext) -> bool:
        return True

    @abstractmethod
    def run(self, ctx: BuildContext) -> None: ...


_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available to pipelines by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"pass {cls.name} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get_pass(name: str) -> Pass:
    return _REGISTRY[name]()


def model_label(ctx: BuildContext) -> str:
    """The model's name in messages: its file name, or the recipe's name for an export."""
    path = ctx.recipe.model.path
    return Path(path).name if path else ctx.recipe.name
