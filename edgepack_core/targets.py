"""Named target profiles: a device class and the onnxruntime providers it may use, best first.

Shared data: the packager records each target's providers in the manifest and checks ops
against them; the device agent picks among them at load time (``device_agent.providers``).
CPU is always the last fallback.
"""

from __future__ import annotations

CPU = "CPUExecutionProvider"

PROFILES: dict[str, tuple[str, ...]] = {
    "rpi": ("XnnpackExecutionProvider", CPU),
    "jetson": ("TensorrtExecutionProvider", "CUDAExecutionProvider", CPU),
    "android": ("NnapiExecutionProvider", "XnnpackExecutionProvider", CPU),
    "apple": ("CoreMLExecutionProvider", CPU),
    "x86": (CPU,),
}

# Targets whose accelerators need every tensor shape fixed at load time.
STATIC_SHAPE_TARGETS = frozenset({"android", "apple"})
# Targets that can use the compact .ort format (onnxruntime mobile builds).
MOBILE_TARGETS = frozenset({"android", "apple"})


# The onnxruntime each profile's devices run, by default (docs/packager.md, "Runtime
# compatibility"): ``edgepack build`` refuses, before signing, an artifact that needs a newer one.
# - rpi: Raspberry Pi OS ships no onnxruntime; devices pip-install aarch64 wheels, and the agent
#   extra admits onnxruntime 1.16 (the first with Python 3.11 wheels for Raspberry Pi OS bookworm).
# - jetson: NVIDIA's JetPack wheels: JetPack 5 (1.16 is its oldest build with current
#   TensorRT support) and JetPack 6 (1.17 and later); 1.16 runs on both.
# - android, apple: the onnxruntime-android / onnxruntime-objc package an app bundles; 1.16 is the
#   oldest the agent supports.
# - x86: pip's onnxruntime for x86-64, which installs the current release: the build host's own
#   onnxruntime (None here), on which the build validated the artifact.
MIN_AGENT_ONNXRUNTIME = "1.16.0"
PROFILE_ONNXRUNTIME: dict[str, str | None] = {
    "rpi": MIN_AGENT_ONNXRUNTIME,
    "jetson": MIN_AGENT_ONNXRUNTIME,
    "android": MIN_AGENT_ONNXRUNTIME,
    "apple": MIN_AGENT_ONNXRUNTIME,
    "x86": None,
}


def profile_onnxruntime(profile: str, host: str) -> str:
    """The onnxruntime a profile's devices run; ``host`` (the build host's version) stands in for
    profiles that follow the current release."""
    return PROFILE_ONNXRUNTIME[profile] or host


def profile_providers(profile: str) -> tuple[str, ...]:
    """The ordered provider list of a profile; KeyError for an unknown name (validated earlier)."""
    return PROFILES[profile]
