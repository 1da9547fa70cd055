"""Reading an artifact for display. Without a trust store nothing is verified, and the name
of the reader says so: ``read_unverified_for_display`` never feeds a device or a build."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepack_core.artifact import Limits, verify_artifact
from edgepack_core.errors import ArtifactError, ManifestError, TruncatedArchiveError
from edgepack_core.manifest import MANIFEST_NAME, REPORT_NAME, SIGNATURE_NAME
from edgepack_core.signing import TrustStore


@dataclass
class ArtifactView:
    path: Path
    manifest: dict[str, Any]
    signature_key_ids: list[str]
    report: dict[str, Any] | None
    verified_by: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": str(self.path),
            "verified": self.verified_by is not None,
            "verified_by": self.verified_by,
            "signature_key_ids": self.signature_key_ids,
            "manifest": self.manifest,
            "report": self.report,
        }


def read_unverified_for_display(path: Path, limits: Limits | None = None) -> ArtifactView:
    """Manifest, signature key ids and report of an artifact, NOT verified (display only)."""
    limits = limits or Limits()
    wanted = {MANIFEST_NAME: limits.max_manifest_bytes, SIGNATURE_NAME: 64 * 1024, REPORT_NAME: 16 * 1024**2}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if member.name in wanted and member.isfile() and member.size <= wanted[member.name]:
                    stream = tar.extractfile(member)
                    assert stream is not None
                    found[member.name] = stream.read()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such artifact") from None  # the message names the missing file
    except (tarfile.TarError, EOFError, OSError) as err:
        raise TruncatedArchiveError(f"{path}: not a complete tar archive ({err})") from err
    if MANIFEST_NAME not in found:
        raise ManifestError(f"{path}: no {MANIFEST_NAME}")
    try:
        manifest = json.loads(found[MANIFEST_NAME])
        signature = json.loads(found.get(SIGNATURE_NAME, b"{}"))
        report = json.loads(found[REPORT_NAME]) if REPORT_NAME in found else None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{path}: unreadable JSON ({err})") from err
    key_ids = [s.get("key_id", "?") for s in signature.get("signatures", []) if isinstance(s, dict)]
    return ArtifactView(path, manifest, key_ids, report, None)


def inspect_artifact(path: Path, trust: TrustStore | None) -> ArtifactView:
    """With a trust store, verify fully first and show what was verified."""
    verified_by = verify_artifact(path, trust).key_id if trust is not None else None
    view = read_unverified_for_display(path)
    view.verified_by = verified_by
    return view


def _shape(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_view(view: ArtifactView) -> str:
    """The human summary printed by ``edgepack inspect``."""
    m = view.manifest
    lines = [
        f"{m.get('name')} {m.get('version')}  ({view.path})",
        f"  created      {m.get('created')}",
        f"  signed by    {', '.join(view.signature_key_ids) or 'UNSIGNED'}"
        + (f"  (verified with key {view.verified_by})" if view.verified_by else "  (not verified: pass --trust)"),
        f"  model        {m.get('model', {}).get('path')}  opset {m.get('model', {}).get('opset')}  "
        f"precision {m.get('model', {}).get('precision', 'fp32')}  "
        f"onnxruntime >= {m.get('model', {}).get('min_onnxruntime')}",
        "  inputs",
        *[f"    {t['name']:<20} {t['dtype']:<8} {_shape(t['shape'])}" for t in m.get("inputs", [])],
        "  outputs",
        *[f"    {t['name']:<20} {t['dtype']:<8} {_shape(t['shape'])}" for t in m.get("outputs", [])],
        f"  preprocess   {json.dumps(m.get('preprocess'), sort_keys=True)}",
        f"  postprocess  {json.dumps(m.get('postprocess'), sort_keys=True)}",
        "  targets      " + ", ".join(f"{t} ({' > '.join(v.get('providers', []))})"
                                      for t, v in m.get("targets", {}).items()),
        f"  golden       {len(m.get('golden', {}).get('samples', []))} sample(s)",
        "  files",
        *[f"    {name:<32} {entry['size']:>12,d}  sha256 {entry['sha256'][:16]}…"
          for name, entry in sorted(m.get("files", {}).items())],
    ]
    report = view.report or {}
    if report:
        lines.append("  build report")
        for name, data in report.get("passes", {}).items():
            lines.append(f"    {name:<16} {json.dumps(data, sort_keys=True, default=str)[:160]}")
        for warning in report.get("warnings", []):
            lines.append(f"    warning: {warning}")
    return "\n".join(lines)


# -- models: any ONNX file, or the model inside an artifact ------------------------------------

MAX_SUBGRAPH_DEPTH = 32


def is_tar_archive(path: Path) -> bool:
    """An artifact is a tar archive; anything else is treated as an ONNX model."""
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def load_model_for_display(path: Path, trust: TrustStore | None = None) -> Any:
    """The ONNX model of ``path`` (a .onnx file, or the model inside an artifact, verified first
    when a trust store is given), without external weights: only the structure is shown."""
    import onnx

    from sdk.errors import ModelError

    if not path.exists():
        raise ModelError(str(path), "no such file")
    if is_tar_archive(path):
        data = _artifact_model_bytes(path, trust)
        source = f"{path} (model inside)"
    else:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ModelError(str(path), f"cannot read: {err.strerror}") from err
        source = str(path)
    try:
        return onnx.load_model_from_string(data)
    except Exception as err:  # protobuf's DecodeError and friends: not an ONNX model
        raise ModelError(source, f"not an ONNX model ({type(err).__name__}: {str(err)[:200]})") from err


def _artifact_model_bytes(path: Path, trust: TrustStore | None) -> bytes:
    if trust is not None:
        import tempfile

        from edgepack_core.artifact import extract_artifact

        with tempfile.TemporaryDirectory() as tmp:
            verified = extract_artifact(path, Path(tmp) / "x", trust)
            return (Path(tmp) / "x" / verified.manifest.model_path).read_bytes()
    view = read_unverified_for_display(path)
    member = str(view.manifest.get("model", {}).get("path", "model/model.onnx"))
    limit = Limits().max_member_bytes
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for entry in tar:
                if entry.name == member and entry.isfile() and entry.size <= limit:
                    stream = tar.extractfile(entry)
                    assert stream is not None
                    return stream.read()
    except (tarfile.TarError, EOFError, OSError) as err:
        raise TruncatedArchiveError(f"{path}: not a complete tar archive ({err})") from err
    raise ArtifactError(f"{path}: no {member} inside within the size limit")


def _type_text(type_proto: Any) -> tuple[str, list[Any] | None]:
    """(dtype, shape) of an ONNX TypeProto for display; shape None when unknown."""
    import onnx

    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        tensor = getattr(type_proto, kind)
        dtype = onnx.TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else "?"
        if not tensor.HasField("shape"):
            return dtype, None
        return dtype, [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
    if kind == "sequence_type":
        return f"seq({_type_text(type_proto.sequence_type.elem_type)[0]})", None
    if kind == "optional_type":
        return f"optional({_type_text(type_proto.optional_type.elem_type)[0]})", None
    if kind == "map_type":
        return "map", None
    return "?", None


def _known_types(graph: Any, known: dict[str, tuple[str, list[Any] | None]]) -> None:
    import onnx

    for init in graph.initializer:
        known[init.name] = (onnx.TensorProto.DataType.Name(init.data_type).lower(), list(init.dims))
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.WhichOneof("value"):
            known[value.name] = _type_text(value.type)


def node_table(model: Any) -> tuple[list[dict[str, Any]], str | None]:
    """Every node (subgraph nodes too, named ``parent/child``) with op type, domain and the
    dtype and shape of each input and output, from onnx shape inference. The second value says
    why shapes are missing when shape inference failed."""
    import onnx

    note = None
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as err:  # onnx raises several untyped errors on graphs it cannot infer
        inferred, note = model, f"shape inference failed: {str(err).splitlines()[0][:200] if str(err) else err}"
    rows: list[dict[str, Any]] = []
    _walk(inferred.graph, "", {}, rows, 0)
    return rows, note


def _walk(graph: Any, prefix: str, outer: dict[str, tuple[str, list[Any] | None]], rows: list[dict[str, Any]],
          depth: int) -> None:
    import onnx

    known = dict(outer)
    _known_types(graph, known)
    initializers = {i.name for i in graph.initializer}

    def tensor(name: str) -> dict[str, Any]:
        dtype, shape = known.get(name, ("?", None))
        return {"name": name, "dtype": dtype, "shape": shape, **({"initializer": True} if name in initializers else {})}

    for index, node in enumerate(graph.node):
        name = f"{prefix}{node.name or f'#{index}'}"
        rows.append({"name": name, "op_type": node.op_type, "domain": node.domain or "ai.onnx",
                     "inputs": [tensor(i) for i in node.input if i], "outputs": [tensor(o) for o in node.output if o]})
        if depth >= MAX_SUBGRAPH_DEPTH:
            continue
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                _walk(sub, f"{name}/{attr.name}/", known, rows, depth + 1)


def _tensor_text(entry: dict[str, Any]) -> str:
    shape = "[?]" if entry["shape"] is None else _shape(["?" if d is None else d for d in entry["shape"]])
    return f"{entry['name']}:{entry['dtype']}{shape}"


def format_nodes(rows: list[dict[str, Any]], note: str | None) -> str:
    """One line per node: name, op type (with its domain when not ai.onnx), inputs -> outputs."""
    lines = [f"{len(rows)} node(s)" + (f"  ({note})" if note else "")]
    for row in rows:
        op = row["op_type"] if row["domain"] == "ai.onnx" else f"{row['domain']}.{row['op_type']}"
        lines.append(f"  {row['name']:<28} {op:<20} {', '.join(_tensor_text(t) for t in row['inputs'])}"
                     f" -> {', '.join(_tensor_text(t) for t in row['outputs'])}")
    return "\n".join(lines)


def model_summary(model: Any, path: Path) -> dict[str, Any]:
    """IR version, opset imports, inputs and outputs (initializers excluded), op-type counts."""
    known: dict[str, tuple[str, list[Any] | None]] = {}
    _known_types(model.graph, known)
    initializers = {i.name for i in model.graph.initializer}
    ops: dict[str, int] = {}
    for node in model.graph.node:
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        ops[op] = ops.get(op, 0) + 1

    def io(values: Any) -> list[dict[str, Any]]:
        return [{"name": v.name, "dtype": known[v.name][0], "shape": known[v.name][1]}
                for v in values if v.name not in initializers]

    return {"model": str(path), "ir_version": int(model.ir_version), "producer": model.producer_name,
            "opsets": {o.domain or "ai.onnx": int(o.version) for o in model.opset_import},
            "inputs": io(model.graph.input), "outputs": io(model.graph.output),
            "nodes": len(model.graph.node), "op_types": dict(sorted(ops.items()))}


def format_model_summary(summary: dict[str, Any]) -> str:
    opsets = ", ".join(f"{domain} {version}" for domain, version in summary["opsets"].items())
    return "\n".join([
        f"{summary['model']}  (ONNX IR {summary['ir_version']}, opsets {opsets or 'none'})",
        f"  producer     {summary['producer'] or '?'}",
        "  inputs", *[f"    {_tensor_text(t)}" for t in summary["inputs"]],
        "  outputs", *[f"    {_tensor_text(t)}" for t in summary["outputs"]],
        f"  nodes        {summary['nodes']}: "
        + ", ".join(f"{op} x{count}" for op, count in summary["op_types"].items()),
    ])
