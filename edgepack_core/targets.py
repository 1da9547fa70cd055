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


def profile_providers(profile: str) -> tuple[str, ...]:
    """The ordered provider list of a profile; KeyError for an unknown name (validated earlier)."""
    return PROFILES[profile]
