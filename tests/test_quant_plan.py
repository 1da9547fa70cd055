"""The quantization search's plan and decisions as pure functions: presets from targets and CPU
flags, the order of candidates, what each keeps float, whether a judged candidate ships, why a
build fell back to fp32, and when the search stops."""

from __future__ import annotations

import pytest

from sdk.packager import quant_search as plan
from sdk.packager.quant_search import Candidate, GraphFacts, QuantConfig

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx avx2 fma
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma
"""
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\n"


def test_cpu_flags_are_read_from_x86_flags_and_arm_features_lines():
    assert plan.parse_cpu_flags(X86_CPUINFO) == {"fpu", "vme", "sse", "sse2", "avx", "avx2", "fma"}
    assert plan.parse_cpu_flags(ARM_CPUINFO) == {"fp", "asimd", "evtstrm", "crc32", "cpuid"}
    assert plan.parse_cpu_flags("") == frozenset()


@pytest.mark.parametrize(("flags", "preset"), [
    ({"avx2", "fma"}, "x86-avx2"),
    ({"avx2", "avx512f", "avx512_vnni"}, "x86-vnni"),
    ({"avx2", "avx_vnni"}, "x86-vnni"),
    ({"avx512_vnni_like", "vnni"}, "x86-avx2"),  # only the two real flag names count
    (set(), "x86-avx2"),
])
def test_x86_preset_follows_vnni_flags(flags, preset):
    assert plan.x86_preset(flags) == preset


@pytest.mark.parametrize(("targets", "flags", "preset"), [
    (["rpi"], set(), "arm64"),
    (["android"], {"avx512_vnni"}, "arm64"),  # the host's flags only matter for x86
    (["apple"], set(), "arm64"),
    (["jetson"], set(), "tensorrt"),
    (["x86"], {"avx2"}, "x86-avx2"),
    (["x86"], {"avx512_vnni"}, "x86-vnni"),
    ([], {"avx2"}, "x86-avx2"),  # no targets: the recipe's default, x86
    (["rpi", "x86"], {"avx2"}, "x86-avx2"),  # 7-bit weights run right on both
    (["rpi", "x86"], {"avx_vnni"}, "arm64"),  # same settings as x86-vnni
    (["jetson", "rpi"], set(), "tensorrt"),  # TensorRT takes only symmetric s8
    (["x86", "jetson"], {"avx2"}, "tensorrt"),
])
def test_the_preset_follows_the_targets(targets, flags, preset):
    chosen, why = plan.preset_for_targets(targets, flags)
    assert chosen == preset
    assert why.startswith("derived from targets: ")
    if "x86" in targets:
        assert ("(build host with VNNI)" if plan.VNNI_FLAGS & flags else "(build host without VNNI)") in why
    assert ("runs right on all of them" in why) == (len({plan.TARGET_PRESETS.get(t) or plan.x86_preset(flags)
                                                         for t in targets}) > 1)


def test_presets_give_uint8_activations_on_cpus_and_symmetric_int8_for_tensorrt():
    for name in ("arm64", "x86-avx2", "x86-vnni"):
        assert (plan.PRESETS[name]["activation_type"], plan.PRESETS[name]["weight_type"]) == ("uint8", "int8")
    assert plan.PRESETS["x86-avx2"]["reduce_range"] is True and plan.PRESETS["x86-vnni"]["reduce_range"] is False
    assert plan.PRESETS["tensorrt"]["activation_type"] == "int8" and plan.PRESETS["tensorrt"]["symmetric_activations"]


@pytest.mark.parametrize(("targets", "recipe_fp16", "wanted"), [
    (["jetson"], False, True),
    (["jetson", "android", "apple"], False, True),
    (["jetson", "rpi"], False, False),  # one artifact: the Pi's CPU runs fp16 through casts
    (["x86"], False, False),
    (["rpi"], True, True),  # optimize.fp16: the recipe says its target runs it
    ([], False, False),
])
def test_fp16_is_a_candidate_only_where_every_target_runs_it(targets, recipe_fp16, wanted):
    assert plan.fp16_wanted(targets, recipe_fp16) is wanted


def _first(**config) -> Candidate:
    return Candidate("int8", "requested", QuantConfig(mode="static", **config))


def _facts(ranked: int = 20, **extra) -> GraphFacts:
    tensors = tuple(f"t{i}" for i in range(ranked))
    fields = {"head": ("sig", "cat"), "wide_concats": ("out",), "ranked": tensors,
              "float_nodes": {**{t: (f"p{t}", f"c{t}") for t in tensors}, "out": ("cat",)},
              "op_types": frozenset({"Conv", "MatMul"}), "fp16": True}
    return GraphFacts(**{**fields, **extra})


def test_the_search_order_is_head_then_worst_tensors_then_op_types_then_fp16():
    later = plan.later_candidates(_first(), _facts())
    assert [(c.kind, c.stage) for c in later] == [
        ("int8", "float head"), ("int8", "activation error"), ("int8", "activation error"),
        ("int8", "activation error"), ("int8", "op types"), ("int8", "op types"), ("int8", "op types"),
        ("fp16", "fp16")]
    head = later[0]
    assert head.config.exclude == ("cat", "sig")
    assert dict(head.kept_float) == {"head": ("sig", "cat"), "wide-range concat": ("out",)}
    for step, candidate in zip(plan.ACTIVATION_ERROR_STEPS, later[1:4], strict=True):
        worst = tuple(f"t{i}" for i in range(step))
        assert dict(candidate.kept_float)["activation error"] == worst
        # each worst tensor's producer and consumer, on top of the float head
        assert set(candidate.config.exclude) == {"cat", "sig", *(f"pt{i}" for i in range(step)),
                                                 *(f"ct{i}" for i in range(step))}
    static_dense, static_conv, dynamic = (c.config for c in later[4:7])
    assert (static_dense.mode, static_dense.op_types) == ("static", ("MatMul",))
    assert (static_conv.mode, static_conv.op_types) == ("static", ("Conv",))
    assert (dynamic.mode, dynamic.op_types) == ("dynamic", ("MatMul", "Gemm"))
    assert all(c.config.exclude == ("cat", "sig") for c in later[4:7]), "op-type candidates keep the head float"
    assert later[-1].config is None


@pytest.mark.parametrize(("ranked", "steps"), [(4, []), (5, [4]), (8, [4]), (9, [4, 8]), (16, [4, 8]),
                                               (17, [4, 8, 16])])
def test_worst_tensor_steps_leave_some_ranked_tensors_quantized(ranked, steps):
    later = plan.later_candidates(_first(), _facts(ranked=ranked))
    counts = [len(dict(c.kept_float)["activation error"]) for c in later if c.stage == "activation error"]
    assert counts == steps


def test_tensors_the_float_head_already_keeps_float_do_not_count_as_a_step():
    def steps(ranked: int) -> list[tuple[str, ...]]:
        facts = _facts(ranked=ranked)
        covered = {**facts.float_nodes, "t0": ("sig", "cat"), "t1": ("cat",)}  # all their nodes in the head
        later = plan.later_candidates(_first(), GraphFacts(**{**facts.__dict__, "float_nodes": covered}))
        return [dict(c.kept_float)["activation error"] for c in later if c.stage == "activation error"]

    assert steps(6) == [], "4 ranked tensors outside the head: keeping them all float is no step"
    assert steps(7) == [("t2", "t3", "t4", "t5")]


def test_the_recipe_exclusions_stay_in_every_candidate_and_are_named():
    later = plan.later_candidates(_first(exclude=("mine",)), _facts())
    assert all("mine" in c.config.exclude for c in later if c.config is not None)
    assert all(dict(c.kept_float)["recipe"] == ("mine",) for c in later if c.config is not None)


def test_a_graph_with_one_kind_of_heavy_op_gets_no_static_op_type_candidates():
    later = plan.later_candidates(_first(), _facts(op_types=frozenset({"Conv"}), fp16=False))
    assert [c.stage for c in later if c.stage == "op types"] == [], "Conv only would repeat the float head"
    dense = plan.later_candidates(_first(), _facts(op_types=frozenset({"Gemm"}), fp16=False))
    assert [(c.config.mode, c.config.op_types) for c in dense if c.stage == "op types"] == \
        [("dynamic", ("MatMul", "Gemm"))]


def test_a_candidate_that_keeps_every_heavy_node_float_is_not_planned():
    convs = {f"pt{i}": "Conv" for i in range(4)}  # each worst tensor's producer is a Conv
    only_convs = plan.later_candidates(_first(), _facts(op_types=frozenset({"Conv"}), heavy=convs, fp16=False))
    assert [c.stage for c in only_convs] == ["float head"], "every worst-tensor step keeps all four Convs float"
    with_dense = plan.later_candidates(_first(), _facts(heavy={**convs, "dense": "MatMul"}, fp16=False))
    assert [c.stage for c in with_dense].count("activation error") == 3, "the MatMul is still quantized"
    conv_only = [c for c in with_dense if c.config.op_types == ("Conv",)]
    assert len(conv_only) == 1 and not set(convs) & set(conv_only[0].config.exclude)


def test_a_dynamic_request_gets_the_float_head_and_fp16_only():
    first = Candidate("int8", "requested", QuantConfig(mode="dynamic", op_types=("MatMul", "Gemm")))
    later = plan.later_candidates(first, _facts())
    assert [(c.stage, c.config and c.config.mode) for c in later] == [("float head", "dynamic"), ("fp16", None)]


def test_no_facts_leave_only_fp16_when_wanted():
    assert plan.later_candidates(_first(), GraphFacts()) == []
    assert [c.kind for c in plan.later_candidates(_first(), GraphFacts(fp16=True))] == ["fp16"]


@pytest.mark.parametrize(("kind", "met", "speedup", "minimum", "ships", "word"), [
    ("int8", True, 1.001, 1.0, True, "meets the budget"),
    ("int8", True, 1.0, 1.0, False, "meets the budget but is not faster than fp32"),  # not faster
    ("int8", True, 0.999, 1.0, False, "meets the budget but is not faster than fp32"),
    ("int8", True, 0.66, 0.0, True, "meets the budget"),  # a recipe that ships any speed
    ("int8", True, 1.3, 1.3, False, "meets the budget but is not faster than fp32"),
    ("int8", False, 5.0, 1.0, False, "misses the budget"),
    ("fp16", True, 0.4, 1.0, True, "meets the budget"),  # the host CPU is no proxy for native fp16
    ("fp16", False, 2.0, 1.0, False, "misses the budget"),
])
def test_a_candidate_ships_when_it_keeps_the_budget_and_int8_is_faster(kind, met, speedup, minimum, ships, word):
    verdict = plan.verdict(kind, met, plan.speed_call([speedup], [1.0], minimum))  # one round: the float rule
    assert (verdict.ships, verdict.accuracy_met, verdict.word) == (ships, met, word)


def test_the_fallback_reason_says_in_one_line_why_fp32_ships():
    slow = {"kind": "int8", "budget_met": True, "speedup": 0.66, "quantized_nodes": 12}
    slower = {**slow, "speedup": 0.5}
    missed = {"kind": "int8", "budget_met": False, "why": "output y: top-1 agreement 0.5", "quantized_nodes": 3}
    why = plan.fallback_reason([missed, slower, slow], 1.0, None)
    assert why == ("int8 kept the accuracy budget but was not faster than fp32 on the build host's CPU provider, "
                   "the proxy for the target's (best 0.66x, quantize.min_speedup 1); shipping fp32")
    assert plan.fallback_reason([slow, missed], 1.0, None).startswith("int8 kept the accuracy budget")
    assert plan.fallback_reason([missed], 1.0, "quantize.max_candidates 1 reached") == (
        "quantization could not meet the accuracy budget (output y: top-1 agreement 0.5); search stopped: "
        "quantize.max_candidates 1 reached; shipping fp32")
    nothing = {"kind": "int8", "budget_met": True, "speedup": 1.0, "quantized_nodes": 0}
    assert plan.fallback_reason([nothing, nothing], 1.0, None).startswith("quantization changed no node")
    failed = {"kind": "int8", "error": "ValueError: x"}
    assert plan.fallback_reason([failed], 1.0, None) == \
        "quantization could not meet the accuracy budget (ValueError: x); shipping fp32"
    assert "\n" not in why


@pytest.mark.parametrize(("tried", "elapsed", "stop"), [
    (0, 10_000.0, None),  # the first candidate always runs
    (1, 10.0, None),
    (9, 899.9, None),
    (10, 0.0, "quantize.max_candidates 10 reached"),
    (3, 900.0, "quantize.max_search_s 900 s spent (900 s)"),
])
def test_the_search_stops_at_its_candidate_and_time_budget(tried, elapsed, stop):
    assert plan.search_stop(tried, elapsed, 10, 900.0) == stop


def test_a_candidate_says_in_a_few_words_what_it_keeps_float():
    later = plan.later_candidates(_first(exclude=("mine",)), _facts())
    assert later[0].brief() == "static minmax per-channel 1 recipe node(s), head, 1 wide-range concat(s) float"
    assert later[1].brief().endswith("4 worst tensor(s) float")
    assert later[4].brief().startswith("static minmax per-channel MatMul only")
    assert later[-1].brief() == "fp16"
    assert later[0].describe()["kept_float"] == {"recipe": ["mine"], "head": ["sig", "cat"],
                                                 "wide-range concat": ["out"]}
