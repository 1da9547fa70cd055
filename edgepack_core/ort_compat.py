"""Which onnxruntime an artifact needs, from what its final graph holds. Pure: no onnx, no
onnxruntime, so the packager and the device agent decide alike.

onnxruntime refuses a model whose opset for ``ai.onnx`` or ``ai.onnx.ml`` is newer than the
last one it was released with (session option ``session.allow_released_opsets_only`` is on by
default), and a model whose IR version it does not know. So the minimum onnxruntime of an
artifact is the oldest release whose row in onnxruntime's own compatibility table
(docs/reference/compatibility.md, "ONNX opset support") covers every opset and the IR version
the graph declares, raised by the contrib ops (``com.microsoft``) the graph uses and by the
``.ort`` format. The packager first prunes opset imports no node uses, so the minimum reflects
the graph and not the tools that touched it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from edgepack_core.errors import RuntimeTooOld
from edgepack_core.errors import RuntimeTooOldError as RuntimeTooOldError  # the old import path

DEFAULT_DOMAIN = "ai.onnx"
ML_DOMAIN = "ai.onnx.ml"
CONTRIB_DOMAIN = "com.microsoft"
# The operator domains a stock onnxruntime build runs. Anything else needs a custom-op library.
SUPPORTED_DOMAINS = frozenset({DEFAULT_DOMAIN, ML_DOMAIN, CONTRIB_DOMAIN})
# onnxruntime guarantees ai.onnx opsets from 7 on; older ones load when their ops still resolve.
GUARANTEED_MIN_OPSET = 7


@dataclass(frozen=True)
class RuntimeRow:
    """One onnxruntime release: the newest ai.onnx opset, ai.onnx.ml opset and IR version it runs."""

    version: str
    opset: int
    ml_opset: int
    ir_version: int


# onnxruntime's compatibility table, oldest first: up to 1.20 as its docs give it
# (docs/reference/compatibility.md); from 1.21 as each release answers itself (a model stamped
# opset/IR 999 is refused naming the newest it runs; asked of the PyPI wheels the way
# ``sdk.packager.passes.runtime_compat.host_runtime_row`` asks the build host's, which also adds
# releases newer than the last row). Where a release's own answer is wider than its docs (1.15
# says IR 9, 1.18-1.20 say ai.onnx.ml 5), the docs' narrower row stays: kernels may lag the
# schemas a release knows. A release absent here runs what the previous row says.
COMPATIBILITY: tuple[RuntimeRow, ...] = (
    RuntimeRow("1.0.0", 11, 2, 6),
    RuntimeRow("1.3.0", 12, 2, 7),
    RuntimeRow("1.6.0", 13, 2, 7),
    RuntimeRow("1.8.0", 14, 2, 7),
    RuntimeRow("1.9.0", 15, 2, 8),
    RuntimeRow("1.11.0", 16, 2, 8),
    RuntimeRow("1.12.0", 17, 3, 8),
    RuntimeRow("1.14.0", 18, 3, 8),
    RuntimeRow("1.15.0", 19, 3, 8),
    RuntimeRow("1.16.0", 19, 3, 9),
    RuntimeRow("1.17.0", 20, 4, 9),
    RuntimeRow("1.18.0", 21, 4, 10),
    RuntimeRow("1.19.0", 21, 4, 10),
    RuntimeRow("1.20.0", 21, 4, 10),
    RuntimeRow("1.21.0", 22, 5, 10),
    RuntimeRow("1.23.0", 23, 5, 11),
    RuntimeRow("1.24.1", 25, 5, 13),
    RuntimeRow("1.25.0", 26, 5, 13),
)

# Contrib ops (com.microsoft) and the first onnxruntime release that has their CPU kernel.
# Ops written by onnxruntime's own offline optimizer and quantizer since 1.10 or earlier share the
# floor 1.10.0; an op missing here needs the release that built the artifact (the only one proven
# to run it), so the table only ever errs on the safe side.
_OLD = "1.10.0"
CONTRIB_OPS: dict[str, str] = {
    **dict.fromkeys((
        "Attention", "BiasGelu", "FastGelu", "Gelu", "FusedConv", "FusedGemm", "FusedMatMul", "NhwcMaxPool",
        "SkipLayerNormalization", "EmbedLayerNormalization", "QuantizeLinear", "DequantizeLinear", "QLinearAdd",
        "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool", "QLinearGlobalAveragePool",
        "QLinearConcat", "DynamicQuantizeMatMul", "MatMulInteger16", "MatMulIntegerToFloat", "QAttention",
        "DynamicQuantizeLSTM", "Range", "Trilu", "Inverse", "CropAndResize", "ExpandDims", "GridSample", "Rfft",
        "Irfft", "BiasSoftmax", "BifurcationDetector", "CDist", "ConvTransposeWithDynamicPads", "FastGeluGrad",
        "Gemm", "MaxpoolWithMask", "MurmurHash3", "Pad", "Unique", "WordConvEmbedding", "Tokenizer",
        "NGramRepeatBlock", "SampleOp", "TransposeMatMul", "Crop", "ImageScaler", "Affine", "ParametricSoftplus",
        "ScaledTanh", "ThresholdedRelu", "DynamicSlice", "Scale", "GivenTensorFill", "MeanVarianceNormalization",
    ), _OLD),
    "QGemm": "1.11.0",
    "QLinearSoftmax": "1.11.0",
    "QuickGelu": "1.15.0",
    "MultiHeadAttention": "1.14.0",
    "DecoderMaskedMultiHeadAttention": "1.15.0",
    "SkipSimplifiedLayerNormalization": "1.16.0",
    "GroupQueryAttention": "1.17.0",
    "RotaryEmbedding": "1.17.0",
    "MatMulNBits": "1.17.0",
}
# The .ort format's own version (a string field of the file) -> the first onnxruntime that
# reads it. Version 6 files from onnxruntime 1.32 load on 1.16 (tools/oldest_ort_check.sh runs
# one); a format missing here needs the release that converted it (``builder``).
ORT_FORMAT_READERS: dict[str, str] = {"5": "1.13.0", "6": "1.16.0"}

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """``1.16.3``, ``1.17`` or ``1.18.0+cu118`` -> (1, 16, 3); ValueError when it is none of these."""
    match = _VERSION.match(text.strip())
    if match is None:
        raise ValueError(f"not an onnxruntime version: {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def format_version(version: tuple[int, int, int]) -> str:
    return ".".join(str(part) for part in version)


def newer(a: str, b: str) -> str:
    """The newer of two versions (as written)."""
    return a if parse_version(a) >= parse_version(b) else b


def satisfies(installed: str, required: str) -> bool:
    """True when ``installed`` is ``required`` or newer (patch levels count)."""
    return parse_version(installed) >= parse_version(required)


def normalize_domain(domain: str) -> str:
    """ONNX writes the default domain as "" or "ai.onnx"; one name for both."""
    return DEFAULT_DOMAIN if domain in ("", DEFAULT_DOMAIN) else domain


def _rows(extra: Iterable[RuntimeRow]) -> list[RuntimeRow]:
    return sorted([*COMPATIBILITY, *extra], key=lambda row: parse_version(row.version))


def _first_row(rows: list[RuntimeRow], what: str, needed: int, field: str) -> tuple[str, str]:
    for row in rows:
        if getattr(row, field) >= needed:
            return row.version, what
    newest = rows[-1]
    raise RuntimeTooOld(f"{what} is newer than any onnxruntime Edgepack knows (onnxruntime {newest.version} "
                        f"runs up to {field.replace('_', ' ')} {getattr(newest, field)})")


def _from_table(known: str | None, builder: str | None, what: str) -> tuple[str, str]:
    """A requirement from one of the tables above; missing there, the building onnxruntime (the
    oldest proven to run it); with neither, RuntimeTooOld."""
    if known is not None:
        return known, what
    if builder is not None:
        return builder, f"{what} (not in Edgepack's table: the building onnxruntime is the oldest proven to run it)"
    raise RuntimeTooOld(f"{what} is not in Edgepack's table")


def required_onnxruntime(
    opsets: Mapping[str, int],
    op_types: set[tuple[str, str]],
    ort_format: bool,
    *,
    ort_format_version: str | None = None,
    ir_version: int | None = None,
    extra_rows: Iterable[RuntimeRow] = (),
    builder: str | None = None,
) -> tuple[str, str]:
    """The oldest onnxruntime that runs a graph, and why: (version, reason naming the op or
    opset that sets it). ``opsets`` maps domain -> version (pruned to the domains nodes use);
    ``op_types`` holds (domain, op_type) of every node; ``extra_rows`` adds releases newer than
    the table (the build host's); ``builder`` is the onnxruntime that built the artifact, the
    floor for contrib ops missing from the table and for the ``.ort`` format. Raises
    :class:`RuntimeTooOld` when no known release runs it."""
    rows = _rows(extra_rows)
    found: list[tuple[str, str]] = []
    for domain, opset in sorted(opsets.items()):
        domain = normalize_domain(domain)
        if domain == DEFAULT_DOMAIN:
            found.append(_first_row(rows, f"opset {opset} ({DEFAULT_DOMAIN})", opset, "opset"))
        elif domain == ML_DOMAIN:
            found.append(_first_row(rows, f"opset {opset} ({ML_DOMAIN})", opset, "ml_opset"))
    if ir_version is not None:
        found.append(_first_row(rows, f"IR version {ir_version}", ir_version, "ir_version"))
    for domain, op_type in sorted(op_types):
        if normalize_domain(domain) == CONTRIB_DOMAIN:
            found.append(_from_table(CONTRIB_OPS.get(op_type), builder, f"contrib op {CONTRIB_DOMAIN}.{op_type}"))
        elif domain.startswith(CONTRIB_DOMAIN + "."):  # layouts of optimize.level all (com.microsoft.nchwc)
            found.append(_from_table(None, builder, f"onnxruntime-internal op {domain}.{op_type}"))
    if ort_format:
        found.append(_from_table(ORT_FORMAT_READERS.get(ort_format_version or ""), builder,
                                 f"the .ort format version {ort_format_version or '(unknown)'}"))
    # max() keeps the first of equals, so a named requirement beats the table's floor.
    found.append((rows[0].version, "the oldest release in onnxruntime's compatibility table"))
    version, reason = max(found, key=lambda item: parse_version(item[0]))
    return format_version(parse_version(version)), reason


def ort_format_version(data: bytes) -> str | None:
    """The format version string an ``.ort`` file declares (its root table's first field,
    ``ort_version``), or None when the bytes are not a readable ORT-format file. Bounded: reads
    a few offsets, each checked against the length before use."""
    import struct

    def u32(at: int) -> int | None:
        return struct.unpack_from("<I", data, at)[0] if 0 <= at <= len(data) - 4 else None

    if len(data) < 12 or data[4:8] != b"ORTM":
        return None
    root = u32(0)
    if root is None or root + 4 > len(data):
        return None
    vtable = root - struct.unpack_from("<i", data, root)[0]
    if not 0 <= vtable <= len(data) - 6:
        return None
    vtable_len, field = struct.unpack_from("<HH", data, vtable)[0], struct.unpack_from("<H", data, vtable + 4)[0]
    if vtable_len < 6 or field == 0:
        return None
    start = root + field
    relative = u32(start)
    length = u32(start + relative) if relative is not None else None
    if relative is None or length is None or length > 16 or start + relative + 4 + length > len(data):
        return None
    text = data[start + relative + 4:start + relative + 4 + length]
    return text.decode("ascii") if text.isdigit() else None


def unsupported_domains(domains: Iterable[str]) -> list[str]:
    """Operator domains a stock onnxruntime does not run (custom ops), sorted."""
    return sorted({d for d in domains if normalize_domain(d) not in SUPPORTED_DOMAINS})


def target_shortfalls(required: str, reason: str, runtimes: Mapping[str, str]) -> list[str]:
    """One line per target whose onnxruntime is older than ``required``; empty when all run it."""
    return [f"target {target} runs onnxruntime {runtime}, but {reason} needs onnxruntime >= {required}"
            for target, runtime in sorted(runtimes.items()) if not satisfies(runtime, required)]


def runtime_refusal(artifact: str, required: str, installed: str) -> str | None:
    """The agent's one-line refusal when the installed onnxruntime is older than the artifact
    needs; None when it runs it. A malformed ``required`` is refused too."""
    try:
        if satisfies(installed, required):
            return None
    except ValueError:
        return f"{artifact} declares min_onnxruntime {required!r}, which is not a version"
    return f"{artifact} needs onnxruntime >= {required}, but this device has onnxruntime {installed}"
