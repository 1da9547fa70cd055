"""The ``runtime_compat`` pass, the last before signing: the artifact's real minimum onnxruntime
(``RuntimeRequirement``, from the final graph and the build host's own onnxruntime) and the targets' check.
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from edgepack_core.errors import RuntimeTooOld
from edgepack_core.ort_compat import (
    DEFAULT_DOMAIN,
    ML_DOMAIN,
    RuntimeRow,
    format_version,
    ort_format_version,
    parse_version,
    required_onnxruntime,
    target_shortfalls,
)
from edgepack_core.targets import profile_onnxruntime
from sdk.errors import BuildError, ModelError
from sdk.packager.onnx_graph import (
    lower_ir_version,
    opset_versions,
    prune_opset_imports,
    used_op_types,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register


@dataclass(frozen=True)
class RuntimeRequirement:
    """What the final graph needs of onnxruntime (the runtime_compat pass's result, for the
    manifest): its opset imports by domain and the oldest onnxruntime that runs it, and why."""

    opsets: Mapping[str, int]
    min_onnxruntime: str
    reason: str

    @property
    def opset(self) -> int | None:
        """The ai.onnx opset; None for a model that imports only other domains (ai.onnx.ml)."""
        return self.opsets.get(DEFAULT_DOMAIN)


_HOST_ROW: list[RuntimeRow | None] = []


def host_runtime_row() -> RuntimeRow | None:
    """The build host's onnxruntime as a compatibility-table row, asked of onnxruntime itself: it
    refuses a model stamped with opset/IR 999 and names the newest it runs. None when it answers
    otherwise. Cached per process."""
    if _HOST_ROW:
        return _HOST_ROW[0]
    import onnxruntime as ort

    def refusal(opsets: list[tuple[str, int]], ir_version: int) -> str:
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
        model.ir_version = ir_version
        options = ort.SessionOptions()
        options.log_severity_level = 4
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises untyped errors; the text is what we parse
            return str(err)
        return ""

    opset = re.search(r"till opset (\d+)", refusal([("", 999)], 8))
    ml = re.search(r"till opset (\d+)", refusal([("", 13), (ML_DOMAIN, 999)], 8))
    ir = re.search(r"max supported IR version: (\d+)", refusal([("", 13)], 999))
    row = None
    if opset and ml and ir:
        version = format_version(parse_version(ort.__version__))
        row = RuntimeRow(version, int(opset.group(1)), int(ml.group(1)), int(ir.group(1)))
    _HOST_ROW.append(row)
    return row


def graph_requirement(
    model: onnx.ModelProto, *, ort_format: bool = False, ort_format_version: str | None = None
) -> tuple[str, str]:
    """(minimum onnxruntime, reason) for what the graph holds. Raises RuntimeTooOld."""
    import onnxruntime as ort

    host = host_runtime_row()
    return required_onnxruntime(
        opset_versions(model),
        used_op_types(model),
        ort_format,
        ort_format_version=ort_format_version,
        ir_version=int(model.ir_version),
        extra_rows=[host] if host else [],
        builder=ort.__version__,
    )


@register
class RuntimeCompatPass(Pass):
    """The last step before signing: prune opset imports no node uses, compute the artifact's
    real minimum onnxruntime from the final graph (opsets, IR, contrib ops, .ort format), and
    refuse a build that a target's onnxruntime cannot run, naming what needs a newer one."""

    name = "runtime_compat"

    def run(self, ctx: BuildContext) -> None:
        import onnxruntime as ort

        model = ctx.require_model()
        label = model_label(ctx)
        pruned = prune_opset_imports(model)
        lowered_from = lower_ir_version(model)
        ort_bytes = ctx.files.get(ctx.ort_member) if ctx.ort_member else None
        try:
            version, reason = graph_requirement(
                model, ort_format=ort_bytes is not None, ort_format_version=ort_format_version(ort_bytes or b"")
            )
        except RuntimeTooOld as err:
            raise ModelError(label, str(err)) from err
        declared = ctx.recipe.target_onnxruntime
        runtimes = {
            t: declared.get(t) or profile_onnxruntime(t, format_version(parse_version(ort.__version__)))
            for t in ctx.recipe.targets
        }
        shortfalls = target_shortfalls(version, reason, runtimes)
        if shortfalls:
            raise BuildError(
                self.name,
                f"{label}: {shortfalls[0]}"
                + (f" (and {len(shortfalls) - 1} more target(s))" if len(shortfalls) > 1 else ""),
            )
        opsets = opset_versions(model)
        ctx.runtime = RuntimeRequirement(types.MappingProxyType(opsets), version, reason)
        ctx.report[self.name] = {
            "opsets": opsets,
            "pruned_opset_imports": pruned,
            "ir_version": int(model.ir_version),
            "ir_lowered_from": lowered_from,
            "min_onnxruntime": version,
            "reason": reason,
            "targets_onnxruntime": runtimes,
        }
