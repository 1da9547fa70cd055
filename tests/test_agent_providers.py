"""Provider choice is a pure function (tested per profile with made-up provider lists, since no
NNAPI device or Jetson exists here); session fallback is tested on this machine's real build."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from device_agent.errors import ProviderError
from device_agent.providers import (
    COREML,
    CUDA,
    NNAPI,
    TENSORRT,
    XNNPACK,
    ModelTraits,
    ProviderChoice,
    ProviderPlan,
    choose_providers,
    create_session,
)
from edgepack_core.targets import CPU
from tests.artifacts import scale_model

EVERYTHING = [TENSORRT, CUDA, XNNPACK, NNAPI, COREML, CPU]


def _names(plan: ProviderPlan) -> list[str]:
    return [c.name for c in plan.choices]


def test_rpi_prefers_xnnpack_then_cpu_and_sizes_its_threads():
    plan = choose_providers("rpi", [XNNPACK, CPU], threads=4)
    assert _names(plan) == [XNNPACK, CPU]
    assert plan.choices[0].options == {"intra_op_num_threads": "4"}


def test_rpi_on_the_pypi_aarch64_wheel_reports_why_xnnpack_is_not_used():
    plan = choose_providers("rpi", ["CPUExecutionProvider"])
    assert _names(plan) == [CPU]
    assert plan.skipped[0][0] == XNNPACK and "not in this onnxruntime build" in plan.skipped[0][1]


def test_jetson_uses_tensorrt_fp16_with_engine_cache_then_cuda_then_cpu(tmp_path):
    plan = choose_providers("jetson", [TENSORRT, CUDA, CPU], cache_dir=tmp_path)
    assert _names(plan) == [TENSORRT, CUDA, CPU]
    trt = plan.choices[0].options
    assert trt["trt_fp16_enable"] == "True" and trt["trt_engine_cache_enable"] == "True"
    assert trt["trt_engine_cache_path"] == str(tmp_path / "tensorrt")


def test_jetson_int8_model_asks_tensorrt_for_int8_not_fp16(tmp_path):
    plan = choose_providers("jetson", [TENSORRT, CUDA, CPU], ModelTraits(precision="int8"), cache_dir=tmp_path)
    assert plan.choices[0].options["trt_int8_enable"] == "True"
    assert plan.choices[0].options["trt_fp16_enable"] == "False"


def test_jetson_without_gpu_build_falls_to_cpu():
    plan = choose_providers("jetson", [CPU])
    assert _names(plan) == [CPU] and {s[0] for s in plan.skipped} == {TENSORRT, CUDA}


def test_android_uses_nnapi_only_for_static_shapes():
    static = choose_providers("android", EVERYTHING, ModelTraits(static_shapes=True))
    assert _names(static) == [NNAPI, XNNPACK, CPU]
    assert static.choices[0].options == {"NNAPI_FLAG_CPU_DISABLED": "1"}
    dynamic = choose_providers("android", EVERYTHING, ModelTraits(static_shapes=False))
    assert _names(dynamic) == [XNNPACK, CPU]
    assert "static input shapes" in dict(dynamic.skipped)[NNAPI]


def test_apple_uses_coreml_mlprogram_with_cache(tmp_path):
    plan = choose_providers("apple", [COREML, CPU], ModelTraits(static_shapes=True), cache_dir=tmp_path,
                            ort_version="1.21.1")
    assert _names(plan) == [COREML, CPU]
    assert plan.choices[0].options["ModelFormat"] == "MLProgram"
    assert plan.choices[0].options["ModelCacheDirectory"] == str(tmp_path / "coreml")


def test_x86_is_cpu_only_and_cpu_always_ends_the_list():
    for profile in ("x86", "rpi", "jetson", "android", "apple"):
        assert _names(choose_providers(profile, EVERYTHING, ModelTraits(static_shapes=True)))[-1] == CPU
    assert _names(choose_providers("x86", EVERYTHING)) == [CPU]


def test_int8_models_skip_xnnpack():
    plan = choose_providers("rpi", [XNNPACK, CPU], ModelTraits(precision="int8"))
    assert _names(plan) == [CPU] and "int8" in dict(plan.skipped)[XNNPACK]


def test_unavailable_provider_falls_back_to_cpu_and_says_so(tmp_path):
    model = scale_model(tmp_path / "m.onnx")
    plan = ProviderPlan([ProviderChoice(XNNPACK, {"intra_op_num_threads": "1"}), ProviderChoice(CPU)], [])
    result = create_session(model, plan)
    assert result.provider == CPU == result.session.get_providers()[0]
    assert XNNPACK not in ort.get_available_providers()
    assert result.fallbacks and result.fallbacks[0][0] == XNNPACK


def test_provider_that_fails_to_create_a_session_is_logged_and_the_next_one_tried(tmp_path, caplog):
    """A Jetson whose CUDA libraries are broken: TensorRT and CUDA raise at session creation
    (simulated, since no GPU exists here); the real CPU session is created and reported."""
    model = scale_model(tmp_path / "m.onnx")

    def jetson_with_broken_cuda(path, options, providers):
        if providers[0][0] in (TENSORRT, CUDA):
            raise RuntimeError(f"{providers[0][0]}: libcudart.so.12: cannot open shared object file")
        return ort.InferenceSession(path, options, providers=providers)

    plan = choose_providers("jetson", [TENSORRT, CUDA, CPU], cache_dir=tmp_path)
    with caplog.at_level("WARNING"):
        result = create_session(model, plan, factory=jetson_with_broken_cuda)
    assert result.provider == CPU
    assert [name for name, _ in result.fallbacks] == [TENSORRT, CUDA]
    assert all("libcudart" in reason for _, reason in result.fallbacks)
    assert "provider TensorrtExecutionProvider failed" in caplog.text


def test_no_provider_can_load_a_corrupt_model(tmp_path):
    bad = Path(tmp_path / "bad.onnx")
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(ProviderError, match=r"no provider could load bad\.onnx"):
        create_session(bad, choose_providers("x86", [CPU]))
