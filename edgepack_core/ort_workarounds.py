"""onnxruntime bugs that every session of ours works around, decided in one place so the packager
(its onnxruntime worker, :mod:`sdk.packager.ort_worker`) and the device agent
(:mod:`device_agent.providers`) create sessions alike. Pure: no onnx, no onnxruntime.

``NchwcTransformer`` on float16 graphs (microsoft/onnxruntime issue 28392, "NchwcTransformer
null deref via IsSupportedOptypeVersionAndDomain on ... Cast(fp16->fp32)"): the CPU provider
runs the float16 nodes it has no float16 kernel for (Conv, LSTM, MatMul... on x86-64) between
Casts that onnxruntime inserts itself, and at ``ORT_ENABLE_ALL`` (the default level) the NCHWc
layout transformer then dereferences a null pointer on those inserted nodes: a SIGSEGV while the
session is created, e.g. for the fp16 conversion of a CRNN recognizer (Conv + LSTM + MatMul +
Softmax). The transformer exists only where MLAS has NCHWc kernels, which is x86-64
(``MLAS_TARGET_AMD64`` sets ``NchwcBlockSize``; 32-bit x86 and arm64 have none), so it is turned
off by name (``InferenceSession(..., disabled_optimizers=[...])``, in the Python API since
onnxruntime 1.8, microsoft/onnxruntime PR 7126) for float16 models on x86-64 only. fp32 models
keep it: it is what makes their Convs fast on x86-64.

The execution provider is deliberately not an input. onnxruntime registers the CPU provider
behind every accelerator, and the transformer rewrites exactly the nodes assigned to it: a
float16 node that TensorRT or CUDA declines lands on the CPU between inserted Casts, the same
crash. Disabling it costs an accelerator's nodes nothing, and float16 nodes on the CPU run
through casts anyway. Unknown names are ignored by onnxruntime, so the list is safe on any build.
When a fixed onnxruntime release is known, gate the rule on its version here.
"""

from __future__ import annotations

NCHWC_TRANSFORMER = "NchwcTransformer"

# platform.machine() of an x86-64 host: Linux/macOS "x86_64", Windows "AMD64", BSDs "amd64".
_X86_64 = frozenset({"x86_64", "amd64", "x64", "em64t"})


def is_x86_64(machine: str) -> bool:
    """Whether ``platform.machine()`` names an x86-64 CPU (any spelling, any case)."""
    return machine.strip().lower() in _X86_64


def disabled_optimizers(*, float16: bool, machine: str) -> tuple[str, ...]:
    """The graph optimizers a session must not run, by name, for a model that does (``float16``)
    or does not hold float16 compute, on a host whose ``platform.machine()`` is ``machine``.
    Empty when nothing needs turning off; pass a non-empty answer as the ``disabled_optimizers``
    keyword of ``onnxruntime.InferenceSession``."""
    if float16 and is_x86_64(machine):
        return (NCHWC_TRANSFORMER,)
    return ()
