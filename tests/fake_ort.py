"""An onnxruntime-gpu stand-in for the provider-chain tests: no GPU exists here, so what
onnxruntime *registers* and *says* on a GPU box is faked, and everything else is real (each
session is a real CPU ``InferenceSession`` on the real model; runs are real runs).

It behaves the way onnxruntime does (onnxruntime 1.16-1.2x, ``onnxruntime_pybind_state.cc``
and ``onnxruntime_inference_collection.py``):

- a provider whose library cannot be loaded (TensorRT without libnvinfer, CUDA without cuDNN)
  is left out of the session **silently**: a native error and warning line on file
  descriptor 2, no exception, and the session runs on what is left;
- a provider that raises while the session is created (an invalid option, an engine that
  cannot be built) makes the Python wrapper print its "EP Error" banner on **stdout** and
  retry once with its own fallback list, ``[CUDA, CPU]`` when TensorRT and CUDA were both
  asked for, else ``[CPU]``, without the options;
- ``distort``: a provider whose numbers drift (TensorRT in fp16) scales the outputs of the
  sessions it heads;
- TensorRT builds its engine on the first run of a session (dynamic shapes): an event is
  recorded, so a test can tell whether the warm-up or a live request paid for the build.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

MISSING_LIBRARY_LOG = {
    TENSORRT: (
        "2026-01-01 10:00:00.000000000 [E:onnxruntime:Default, provider_bridge_ort.cc:1539 "
        "TryGetProviderInfo_TensorRT] /onnxruntime_src/onnxruntime/core/session/provider_bridge_ort.cc:1209 "
        "onnxruntime::Provider& onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : 1 : FAIL : Failed to "
        "load library libonnxruntime_providers_tensorrt.so with error: libnvinfer.so.10: cannot open shared "
        "object file: No such file or directory\n"
        "2026-01-01 10:00:00.000000001 [W:onnxruntime:Default, onnxruntime_pybind_state.cc:1004 "
        "CreateExecutionProviderInstance] Failed to create TensorrtExecutionProvider. Please reference "
        "https://onnxruntime.ai/docs/execution-providers/TensorRT-ExecutionProvider.html#requirements to ensure "
        "all dependencies are met.\n"),
    CUDA: (
        "2026-01-01 10:00:00.000000002 [E:onnxruntime:Default, provider_bridge_ort.cc:1862 "
        "TryGetProviderInfo_CUDA] /onnxruntime_src/onnxruntime/core/session/provider_bridge_ort.cc:1539 "
        "onnxruntime::Provider& onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : 1 : FAIL : Failed to "
        "load library libonnxruntime_providers_cuda.so with error: libcudnn.so.9: cannot open shared object "
        "file: No such file or directory\n"
        "2026-01-01 10:00:00.000000003 [W:onnxruntime:Default, onnxruntime_pybind_state.cc:965 "
        "CreateExecutionProviderInstance] Failed to create CUDAExecutionProvider. Require cuDNN 9.* and CUDA 12.*. "
        "Please install all dependencies as mentioned in the GPU requirements page.\n"),
}


class FakeSession:
    """A real CPU session that reports the providers the fake registered."""

    def __init__(self, real: Any, registered: list[str], owner: FakeGpuOrt) -> None:
        self._real = real
        self.registered = registered
        self.owner = owner
        self.runs = 0
        self.engine_built = False

    def get_providers(self) -> list[str]:
        return list(self.registered)

    def get_inputs(self) -> Any:
        return self._real.get_inputs()

    def get_outputs(self) -> Any:
        return self._real.get_outputs()

    def end_profiling(self) -> str:
        """The real session's profile (its path; "" when it was not profiling), each kernel's
        provider written as the provider heading what the fake registered: a GPU session's profile
        names its provider for the nodes it ran, and there is no GPU here."""
        path = self._real.end_profiling()
        head = self.registered[0]
        if path and head != CPU:
            events = json.loads(Path(path).read_text(encoding="utf-8"))
            for event in events:
                if event.get("cat") == "Node" and "provider" in event.get("args", {}):
                    event["args"]["provider"] = head
            Path(path).write_text(json.dumps(events), encoding="utf-8")
        return path

    def run(self, names: Any, feed: Mapping[str, np.ndarray], *args: Any) -> list[np.ndarray]:
        head = self.registered[0]
        if head == TENSORRT and not self.engine_built:
            self.engine_built = True
            self.owner.events.append(("engine built", id(self)))
        self.runs += 1
        self.owner.events.append(("run", id(self)))
        outputs = self._real.run(names, feed, *args)
        factor = self.owner.distort.get(head)
        return [o * np.asarray(factor, dtype=o.dtype) if factor and o.dtype.kind == "f" else o for o in outputs]


class FakeGpuOrt:
    """``factory(path, options, providers=[...])`` as ``create_session`` calls it."""

    def __init__(self, *, missing: Iterable[str] = (), raising: Mapping[str, str] | None = None,
                 distort: Mapping[str, float] | None = None) -> None:
        self.missing = set(missing)
        self.raising = dict(raising or {})
        self.distort = dict(distort or {})
        self.calls: list[list[tuple[str, dict[str, str]]]] = []
        self.keywords: list[dict[str, Any]] = []  # each call's other keywords (disabled_optimizers)
        self.sessions: list[FakeSession] = []
        self.events: list[tuple[str, int]] = []

    def __call__(self, path: str, options: Any, providers: list[Any], **keywords: Any) -> FakeSession:
        chain = [(p, {}) if isinstance(p, str) else (p[0], dict(p[1])) for p in providers]
        self.calls.append(chain)
        self.keywords.append(keywords)
        names = [name for name, _ in chain]
        failing = next((name for name in names if name in self.raising and name not in self.missing), None)
        if failing is not None:
            fallback = [CUDA, CPU] if TENSORRT in names and CUDA in names else [CPU]
            print("*************** EP Error ***************")
            print(f"EP Error {self.raising[failing]} when using {providers}")
            print(f"Falling back to {fallback} and retrying.")
            print("****************************************")
            names = fallback
        registered = []
        for name in names:
            if name in self.missing:
                os.write(2, MISSING_LIBRARY_LOG[name].encode())
                continue
            registered.append(name)
        real = ort.InferenceSession(path, options, providers=[CPU], **keywords)
        session = FakeSession(real, registered, self)
        self.sessions.append(session)
        self.events.append(("session", id(session)))
        return session

    def heads(self) -> list[str]:
        """The provider each call asked for first."""
        return [chain[0][0] for chain in self.calls]
