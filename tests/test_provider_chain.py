"""The provider chain: what onnxruntime is given for each choice (pure, every profile), and the
walk down it when onnxruntime falls back silently, raises, or runs a provider whose numbers
miss the golden samples. No GPU exists here: ``tests/fake_ort.py`` behaves like onnxruntime-gpu
on a GPU box (real CPU sessions; what it registers and prints is what onnxruntime does)."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

from device_agent.errors import ProviderError, SmokeTestError
from device_agent.providers import (
    COREML,
    CUDA,
    NNAPI,
    REASON_CHARS,
    TENSORRT,
    TENSORRT_MAX_BATCH,
    XNNPACK,
    ModelTraits,
    cache_key,
    capture_provider_log,
    choose_providers,
    create_session,
    device_label,
    fallback_reason,
    provider_log_reason,
    provider_options,
    tensorrt_profile,
)
from edgepack_core.targets import CPU, PROFILES
from tests.artifacts import scale_model
from tests.fake_ort import MISSING_LIBRARY_LOG, FakeGpuOrt

EVERYTHING = [TENSORRT, CUDA, XNNPACK, NNAPI, COREML, CPU]
IMAGE = ModelTraits(static_shapes=False, inputs=(("input", ("batch", 3, 224, 224)),))

# The provider options onnxruntime 1.16 accepts from Python (onnxruntime_pybind_state.cc,
# CreateExecutionProviderInstance; any other name is "Invalid TensorRT EP option" and the
# provider is refused) and CUDAExecutionProviderInfo::FromProviderOptions.
TENSORRT_1_16 = {
    "device_id", "trt_max_partition_iterations", "trt_min_subgraph_size", "trt_max_workspace_size",
    "trt_fp16_enable", "trt_int8_enable", "trt_int8_calibration_table_name", "trt_int8_use_native_calibration_table",
    "trt_dla_enable", "trt_dla_core", "trt_dump_subgraphs", "trt_engine_cache_enable", "trt_engine_cache_path",
    "trt_engine_decryption_enable", "trt_engine_decryption_lib_path", "trt_force_sequential_engine_build",
    "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback", "trt_timing_cache_enable",
    "trt_force_timing_cache", "trt_detailed_build_log", "trt_build_heuristics_enable", "trt_sparsity_enable",
    "trt_builder_optimization_level", "trt_auxiliary_streams", "trt_tactic_sources", "trt_extra_plugin_lib_paths",
    "trt_profile_min_shapes", "trt_profile_max_shapes", "trt_profile_opt_shapes", "trt_cuda_graph_enable",
}
CUDA_1_16 = {"device_id", "gpu_mem_limit", "arena_extend_strategy", "cudnn_conv_algo_search",
             "do_copy_in_default_stream", "cudnn_conv_use_max_workspace", "cudnn_conv1d_pad_to_nc1d",
             "enable_cuda_graph", "tunable_op_enable", "tunable_op_tuning_enable"}


def names(chain):
    return [name for name, _ in chain]


# ---------------------------------------------------------------- the plan, pure


@pytest.mark.parametrize(("profile", "available", "traits", "expected"), [
    ("jetson", [TENSORRT, CUDA, CPU], IMAGE, [[TENSORRT, CUDA, CPU], [CUDA, CPU], [CPU]]),
    ("jetson", [CUDA, CPU], IMAGE, [[CUDA, CPU], [CPU]]),  # onnxruntime-gpu built without TensorRT
    ("jetson", [CPU], IMAGE, [[CPU]]),  # the CPU wheel on a Jetson
    ("rpi", [XNNPACK, CPU], IMAGE, [[XNNPACK, CPU], [CPU]]),
    ("rpi", [CPU], IMAGE, [[CPU]]),
    ("android", EVERYTHING, ModelTraits(static_shapes=True), [[NNAPI, XNNPACK, CPU], [XNNPACK, CPU], [CPU]]),
    ("android", EVERYTHING, IMAGE, [[XNNPACK, CPU], [CPU]]),
    ("apple", EVERYTHING, ModelTraits(static_shapes=True), [[COREML, CPU], [CPU]]),
    ("apple", EVERYTHING, IMAGE, [[CPU]]),
    ("x86", EVERYTHING, IMAGE, [[CPU]]),
])
def test_each_choice_is_given_the_whole_remaining_chain(profile, available, traits, expected, tmp_path):
    plan = choose_providers(profile, available, traits, cache_dir=tmp_path, ort_version="1.21.0")
    chains = [plan.chain(index) for index in range(len(plan.choices))]
    assert [names(chain) for chain in chains] == expected
    options = {choice.name: dict(choice.options) for choice in plan.choices}
    for chain in chains:  # every provider of a chain carries its own options, not the head's
        assert all(opts == options[name] for name, opts in chain)
    assert all(profile_name in PROFILES for profile_name in [profile])


def test_the_jetson_chain_carries_tensorrt_and_cuda_options_onnxruntime_1_16_accepts(tmp_path):
    plan = choose_providers("jetson", [TENSORRT, CUDA, CPU], IMAGE, cache_dir=tmp_path, ort_version="1.16.3")
    (trt, trt_options), (cuda, cuda_options), (cpu, cpu_options) = plan.chain(0)
    assert (trt, cuda, cpu) == (TENSORRT, CUDA, CPU)
    assert set(trt_options) <= TENSORRT_1_16, set(trt_options) - TENSORRT_1_16
    assert set(cuda_options) <= CUDA_1_16, set(cuda_options) - CUDA_1_16
    assert cpu_options == {}
    assert all(trt_options[k] in ("True", "False") for k in trt_options if k.endswith("_enable"))
    assert cuda_options["cudnn_conv_algo_search"] in ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
    assert trt_options["trt_engine_cache_path"] == str(tmp_path / "tensorrt")
    assert trt_options["trt_profile_max_shapes"] == f"input:{TENSORRT_MAX_BATCH}x3x224x224"


@pytest.mark.parametrize(("version", "expected"), [
    ("1.16.3", {}),  # 1.16-1.19 take no CoreML options from Python
    ("1.19.2", {}),
    ("1.20.0", {"ModelFormat": "MLProgram", "MLComputeUnits": "ALL"}),
    ("1.21.0", {"ModelFormat": "MLProgram", "MLComputeUnits": "ALL", "ModelCacheDirectory": "CACHE/coreml"}),
    ("garbage", {}),  # unreadable: treated as the oldest supported
])
def test_coreml_options_follow_the_onnxruntime_version(version, expected, tmp_path):
    options = provider_options(COREML, threads=0, cache_dir=tmp_path, traits=ModelTraits(static_shapes=True),
                               ort_version=version)
    assert options == {k: v.replace("CACHE", str(tmp_path)) for k, v in expected.items()}


def test_tensorrt_profile_only_for_a_dynamic_batch_dim():
    assert tensorrt_profile([("x", ("n", 4)), ("k", (1,))]) == {
        "trt_profile_min_shapes": "x:1x4", "trt_profile_opt_shapes": "x:1x4", "trt_profile_max_shapes": "x:8x4"}
    assert tensorrt_profile([("a", ("n", 2)), ("b", ("n", 3, 3))], max_batch=2)["trt_profile_max_shapes"] == \
        "a:2x2,b:2x3x3"
    assert tensorrt_profile([("x", (1, 4))]) == {}  # static: the engine is built at load
    assert tensorrt_profile([("x", ("n", "t", 4))]) == {}  # a dynamic dim past the batch
    assert tensorrt_profile([("x:0", ("n", 4))]) == {}  # a name the option's syntax cannot carry
    assert tensorrt_profile([("a,b", ("n", 4))]) == {}


def test_no_cache_dir_no_cache_options_and_the_plan_says_so(tmp_path):
    plan = choose_providers("jetson", [TENSORRT, CUDA, CPU], IMAGE)
    assert "trt_engine_cache_path" not in plan.choices[0].options
    assert plan.needs_cache
    assert not choose_providers("jetson", [CUDA, CPU], IMAGE).needs_cache
    assert not choose_providers("rpi", [XNNPACK, CPU], IMAGE).needs_cache


def test_cache_key_changes_with_model_runtime_and_device_and_stays_a_plain_name():
    base = cache_key("a" * 64, "1.16.3", "Orin sm_87 L4T R36.3.0")
    assert base.startswith("a" * 16 + "-ort1.16.3-")
    others = {cache_key("b" * 64, "1.16.3", "Orin sm_87 L4T R36.3.0"), cache_key("a" * 64, "1.17.0", "Orin sm_87"),
              cache_key("a" * 64, "1.16.3", "Orin sm_87 L4T R36.4.0"), cache_key("a" * 64, "1.16.3", "Orin/sm_87")}
    assert base not in others and len(others) == 4
    hostile = cache_key("c" * 64, "1.16.3; rm -rf /", "../../etc/passwd\x00 " + "x" * 500)
    assert "/" not in hostile and ".." not in hostile and "\x00" not in hostile and len(hostile) <= 120
    assert hostile == cache_key("c" * 64, "1.16.3; rm -rf /", "../../etc/passwd\x00 " + "x" * 500)


def test_device_label_prefers_the_gpu_then_the_jetson_then_the_host():
    assert device_label(gpu="NVIDIA H100 sm_90", node="box", system="Linux", machine="x86_64") == "NVIDIA H100 sm_90"
    assert device_label(jetson_model="NVIDIA Jetson AGX Orin", l4t_release="L4T R36.3.0", node="j") == \
        "NVIDIA Jetson AGX Orin L4T R36.3.0"
    assert device_label(node="pi", system="Linux", machine="aarch64") == "pi Linux aarch64"
    assert device_label() == "unknown-device"


# ---------------------------------------------------------------- onnxruntime's words, pure


def test_the_fallback_banner_gives_the_reason_without_the_provider_dump():
    printed = ("*************** EP Error ***************\n"
               "EP Error /onnxruntime_src/x.cc:42 void f() [ONNXRuntimeError] : 1 : FAIL : TensorRT EP failed to "
               "create engine from network. when using [('TensorrtExecutionProvider', {'trt_fp16_enable': 'True'})]\n"
               "Falling back to ['CUDAExecutionProvider', 'CPUExecutionProvider'] and retrying.\n"
               "****************************************\n")
    assert provider_log_reason(printed, TENSORRT) == "TensorRT EP failed to create engine from network."


def test_the_log_line_naming_the_provider_is_the_reason():
    text = ("2026-01-01 [W:onnxruntime:Default, x.cc:1 f] Some unrelated warning\n" + MISSING_LIBRARY_LOG[CUDA])
    assert provider_log_reason(text, CUDA) == ("Failed to load library libonnxruntime_providers_cuda.so with error: "
                                               "libcudnn.so.9: cannot open shared object file: No such file or "
                                               "directory")
    assert provider_log_reason("[E:onnxruntime:Default, a.cc:1 g] out of memory\n", TENSORRT) == "out of memory"
    assert provider_log_reason("[W:onnxruntime:Default, a.cc:1 g] unrelated\nplain text\n", TENSORRT) == ""
    assert provider_log_reason("", TENSORRT) == ""


def test_a_long_reason_is_cut_at_the_limit():
    at_limit = "[E:onnxruntime:Default, a.cc:1 g] " + "x" * REASON_CHARS
    over = at_limit + "y"
    assert provider_log_reason(at_limit, TENSORRT) == "x" * REASON_CHARS
    assert provider_log_reason(over, TENSORRT) == "x" * REASON_CHARS


def test_fallback_reason_names_what_onnxruntime_fell_back_to():
    assert fallback_reason(TENSORRT, [CUDA, CPU], "libnvinfer.so.10 missing") == \
        "onnxruntime fell back to CUDA/CPU for TensorRT: libnvinfer.so.10 missing"
    assert fallback_reason(CUDA, [CPU], "") == "onnxruntime fell back to CPU for CUDA (it logged no reason)"


def test_capture_tees_native_stderr_and_keeps_the_banner_off_stdout(capfd):
    with capture_provider_log() as said:
        os.write(2, b"[E:onnxruntime:Default, a.cc:1 g] native line\n")
        print("EP Error boom when using [x]")
    out, err = capfd.readouterr()
    assert "native line" in said.getvalue() and "EP Error boom" in said.getvalue()
    assert "native line" in err  # still reaches stderr as it is written (teed, not swallowed)
    assert "EP Error" not in out  # stdout stays the command's own (predict --json)
    with capture_provider_log(enabled=False) as said:
        os.write(2, b"not captured\n")
    assert said.getvalue() == "" and "not captured" in capfd.readouterr().err


# ---------------------------------------------------------------- the walk, on the fake GPU onnxruntime


@pytest.fixture
def model(tmp_path):
    return scale_model(tmp_path / "m.onnx")


def jetson_plan(tmp_path, available=(TENSORRT, CUDA, CPU)):
    return choose_providers("jetson", list(available), ModelTraits(inputs=(("x", ("batch", 4)),)),
                            cache_dir=tmp_path, ort_version="1.16.3")


def test_silent_fallback_from_tensorrt_counts_as_failing_and_cuda_is_tried_next(model, tmp_path, capfd):
    """The issue's box: onnxruntime-gpu with CUDA and cuDNN, TensorRT libraries absent. Asked for
    [TensorRT, CUDA, CPU], onnxruntime logs and returns a CUDA/CPU session without raising."""
    fake = FakeGpuOrt(missing={TENSORRT})
    result = create_session(model, jetson_plan(tmp_path), factory=fake)
    assert result.provider == CUDA and result.session_providers == (CUDA, CPU)
    assert [names(chain) for chain in fake.calls] == [[TENSORRT, CUDA, CPU], [CUDA, CPU]]
    assert fake.calls[1][0][1] == {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}  # options kept
    (provider, reason), = result.fallbacks
    assert provider == TENSORRT
    assert reason.startswith("onnxruntime fell back to CUDA/CPU for TensorRT: Failed to load library "
                             "libonnxruntime_providers_tensorrt.so with error: libnvinfer.so.10")
    assert "libnvinfer.so.10" in capfd.readouterr().err  # onnxruntime's lines still reach the log
    x = np.ones((1, 4), np.float32)
    assert np.array_equal(result.session.run(["y"], {"x": x})[0], 2 * x)


def test_the_old_two_provider_list_is_gone(model, tmp_path):
    """TensorRT's chain holds CUDA, so nodes TensorRT cannot take go to the GPU, not the CPU."""
    fake = FakeGpuOrt()
    result = create_session(model, jetson_plan(tmp_path), factory=fake)
    assert result.provider == TENSORRT and result.fallbacks == []
    assert names(fake.calls[0]) == [TENSORRT, CUDA, CPU] and len(fake.calls) == 1


def test_no_gpu_libraries_at_all_walks_down_to_cpu_with_both_reasons(model, tmp_path, capfd):
    fake = FakeGpuOrt(missing={TENSORRT, CUDA})
    result = create_session(model, jetson_plan(tmp_path), factory=fake)
    assert result.provider == CPU and fake.heads() == [TENSORRT, CUDA, CPU]
    reasons = dict(result.fallbacks)
    assert reasons[TENSORRT].startswith("onnxruntime fell back to CPU for TensorRT: ")
    assert reasons[CUDA].startswith("onnxruntime fell back to CPU for CUDA: ") and "libcudnn.so.9" in reasons[CUDA]


def test_an_error_while_creating_tensorrt_prints_a_banner_onnxruntime_retries_and_we_do_not_accept(model, tmp_path,
                                                                                                  capfd):
    """onnxruntime's Python wrapper catches the error, prints "EP Error" on stdout and retries
    with [CUDA, CPU] without options: that session is refused and CUDA is asked for properly."""
    fake = FakeGpuOrt(raising={TENSORRT: "[ONNXRuntimeError] : 1 : FAIL : Invalid TensorRT EP option: trt_bogus"})
    result = create_session(model, jetson_plan(tmp_path), factory=fake)
    assert result.provider == CUDA and fake.heads() == [TENSORRT, CUDA]
    assert dict(result.fallbacks)[TENSORRT] == ("onnxruntime fell back to CUDA/CPU for TensorRT: "
                                                "Invalid TensorRT EP option: trt_bogus")
    assert fake.calls[1][0][1]["cudnn_conv_algo_search"] == "HEURISTIC"
    assert "EP Error" not in capfd.readouterr().out


def test_a_factory_that_raises_fails_that_choice_with_its_error(model, tmp_path):
    def raising(path, options, providers):
        if providers[0][0] != CPU:
            raise RuntimeError(f"{providers[0][0]}: CUDA failure 999: unknown error\nstack...")
        return ort.InferenceSession(path, options, providers=providers)

    result = create_session(model, jetson_plan(tmp_path), factory=raising)
    assert result.provider == CPU
    assert result.fallbacks == [(TENSORRT, "TensorrtExecutionProvider: CUDA failure 999: unknown error"),
                                (CUDA, "CUDAExecutionProvider: CUDA failure 999: unknown error")]


def test_a_provider_missing_the_golden_samples_fails_and_the_next_is_tried(model, tmp_path):
    """TensorRT in fp16 beyond the artifact's tolerances: the check (the smoke test) fails on
    TensorRT's session, CUDA's passes."""
    fake = FakeGpuOrt(distort={TENSORRT: 1.01})
    x = np.ones((1, 4), np.float32)

    def check(session, provider):
        got = session.run(["y"], {"x": x})[0]
        if not np.allclose(got, 2 * x, rtol=1e-3, atol=1e-4):
            worst = np.abs(got - 2 * x).max()
            raise SmokeTestError("scale 1.0.0", 0, f"output y differs from golden by up to {worst:.3g}")

    result = create_session(model, jetson_plan(tmp_path), factory=fake, check=check)
    assert result.provider == CUDA
    assert dict(result.fallbacks)[TENSORRT] == ("its outputs missed the golden samples: output y differs from golden "
                                                "by up to 0.02")


def test_a_smoke_failure_on_the_last_choice_is_the_models_failure(model, tmp_path):
    def check(session, provider):
        raise SmokeTestError("scale 1.0.0", 0, "differs")

    with pytest.raises(SmokeTestError, match="differs"):
        create_session(model, jetson_plan(tmp_path, available=[CPU]), factory=FakeGpuOrt(), check=check)


def test_nothing_loads_names_every_attempt(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage")
    fake_missing = FakeGpuOrt(missing={TENSORRT, CUDA})

    def factory(path, options, providers):
        session = fake_missing(path.replace("bad.onnx", "m.onnx"), options, providers)
        if session.get_providers()[0] == CPU and providers[0][0] == CPU:
            raise RuntimeError("[ONNXRuntimeError] : 7 : INVALID_PROTOBUF : Load model from bad.onnx failed")
        return session

    scale_model(tmp_path / "m.onnx")
    with pytest.raises(ProviderError) as caught:
        create_session(bad, jetson_plan(tmp_path), factory=factory)
    assert [name for name, _ in caught.value.attempts] == [TENSORRT, CUDA, CPU]
    assert "INVALID_PROTOBUF" in str(caught.value)


def test_real_onnxruntime_ignoring_an_unavailable_provider_is_caught_with_its_warning(model, tmp_path):
    """On this machine's real build: asked for XNNPACK it does not have, onnxruntime warns and
    runs on CPU; the warning is the reason."""
    plan = choose_providers("rpi", [XNNPACK, CPU], threads=1)
    assert XNNPACK not in ort.get_available_providers()
    result = create_session(model, plan)
    assert result.provider == CPU == result.session.get_providers()[0]
    reason = dict(result.fallbacks)[XNNPACK]
    assert reason.startswith("onnxruntime fell back to CPU for XNNPACK: Specified provider "
                             "'XnnpackExecutionProvider' is not in available provider names")
