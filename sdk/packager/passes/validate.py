"""Validation of every build: the packaged model against the original on real (or, with the
recipe's consent, synthetic) samples, the expected outputs of test data, and a target
compatibility report.

A lossless build (no quantization, no fp16) must reproduce the original output by output
within rtol/atol by dtype (``metrics.check_fidelity``), whatever the data source: the check
never weakens to a summary metric. A lossy build is judged by the task's metric
(``metrics.evaluate``: detection recall/precision, per-step sequence agreement, classifier
top-1, or each raw output on its own) on every checked output; the quantization search uses
the same judgement (:func:`judge`), so what it picks is what this pass accepts. A miss fails
the build unless the recipe says ``validate.allow_failure: true``.

A stateful model (``role: state`` inputs) on stream data (audio: a file's frames) runs
free-running, both models carrying their own state across each file's frames as the agent does
(:mod:`sdk.packager.sequences`): an error that accumulates through the state is judged as a
device would meet it, not hidden by restarting every frame from zeros.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from edgepack_core.postprocess import Postprocessor
from edgepack_core.postprocess_spec import PostprocessSpec
from sdk.errors import MetricInputError, RecipeError, ValidationFailed
from sdk.packager.data import Samples, context_options, load_samples
from sdk.packager.fidelity import check_fidelity, compare
from sdk.packager.options import given, option
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.golden import settle_output_contract
from sdk.packager.passes.io_spec import (
    check_ctc_blank,
    check_detection_format,
    check_detection_scores,
    settle_apply_sigmoid,
    settle_apply_softmax,
)
from sdk.packager.sequences import run_samples
from sdk.packager.sources import DATA_SOURCE_SCHEMA, DataSource
from sdk.packager.task_metrics import DetectionDecoder, Detections, Evaluation, evaluate, task_metric

DEFAULT_SAMPLES = 64
SYNTHETIC_SAMPLES = 16
_BUDGET_KEYS = ("metric", "max_drop", "min_cosine", "max_abs", "min_recall", "min_precision", "max_score_diff",
                "min_agreement", "min_string_match")


@dataclass(frozen=True)
class ValidateOptions:
    """``validate``: the validate pass's data and accuracy budget (the quantization search is
    judged by the same budget). A limit left None takes the metric's default."""

    data: DataSource | None = option(None, schema=DATA_SOURCE_SCHEMA, parse=DataSource.from_json)
    metric: Literal["top1", "agreement", "cosine", "max_abs", "detection", "sequence"] | None = option(
        None, description="what a quantized or fp16 build is judged by (default: the task's: detection, sequence "
        "for ctc, top1 for classifiers, cosine per output for raw)")
    outputs: tuple[str, ...] | None = option(None, description="the outputs the metric checks, each on its own "
                                             "(leave recurrent state out); default: the postprocess's output, every "
                                             "output for raw", minItems=1, items={"minLength": 1})
    max_drop: float | None = option(None, description="top1/agreement: the largest drop (0.01)", minimum=0)
    min_cosine: float | None = option(None, description="cosine: the least cosine similarity (1 - max_drop)",
                                      minimum=-1, maximum=1)
    max_abs: float | None = option(None, description="max_abs: the largest absolute difference (0.001)", minimum=0)
    min_recall: float | None = option(None, description="detection: least recall against the fp32 model's "
                                      "detections at IoU 0.5 (default 0.95)", minimum=0, maximum=1)
    min_precision: float | None = option(None, description="detection: least precision against the fp32 model's "
                                         "detections at IoU 0.5 (default 0.95)", minimum=0, maximum=1)
    max_score_diff: float | None = option(None, description="detection: largest mean score shift of the detections "
                                          "that match the fp32 model's (default 0.05; a collapsed score channel "
                                          "keeps recall and precision but moves every score)", minimum=0, maximum=1)
    min_agreement: float | None = option(None, description="sequence: least share of time steps whose argmax "
                                         "agrees with the fp32 model (default 0.99)", minimum=0, maximum=1)
    min_string_match: float | None = option(None, description="sequence with a ctc postprocess: least share of "
                                            "decoded strings equal to the fp32 model's (default: unset, reported "
                                            "only)", minimum=0, maximum=1)
    samples: int | None = option(None, description=f"at most this many samples (validate: {DEFAULT_SAMPLES})",
                                 minimum=1)
    allow_failure: bool = option(False, description="a build that misses ships, with a warning")
    rtol: float | None = option(None, description="relative tolerance of every float output (default by dtype)",
                                minimum=0)
    atol: float | None = option(None, description="absolute tolerance of every float output (default by dtype)",
                                minimum=0)

    def budget(self) -> dict[str, Any]:
        """The budget keys the recipe set, as the task metrics read them."""
        return {key: value for key, value in given(self).items() if key in _BUDGET_KEYS}


def expected_check(samples: Samples, outputs: Sequence[dict[str, np.ndarray]], options: ValidateOptions
                   ) -> dict[str, Any] | None:
    """The outputs of a model against the expected outputs the test data carries (samples
    without expected outputs are skipped). None when there are none."""
    if not samples.expected:
        return None
    pairs = [(n, want, outputs[n]) for n, want in enumerate(samples.expected) if want]
    if not pairs:
        return None
    names = sorted(set.intersection(*(set(want) for _, want, _ in pairs)))
    fidelity = check_fidelity([{k: want[k] for k in names} for _, want, _ in pairs],
                              [{k: got[k] for k in names if k in got} for _, _, got in pairs],
                              rtol=options.rtol, atol=options.atol,
                              sample_names=[samples.name(n) for n, _, _ in pairs])
    return fidelity.to_json()


def state_report(samples: Samples) -> dict[str, Any]:
    """How a stateful model's state was fed, for the report: ``carried`` over the frames of
    each of ``sequences`` files, or ``init`` in every sample (data that is not a stream); empty
    for a model without state inputs."""
    if not samples.carry:
        return {}
    if samples.sequential:
        return {"state": {"fed": "carried", "sequences": len(samples.sequences or ())}}
    return {"state": {"fed": "init"}}


def checked_outputs(ctx: BuildContext, options: ValidateOptions) -> list[str]:
    """The outputs a lossy build is judged on: ``validate.outputs`` (a recurrent state output
    left out), else the postprocess's output for a task (detection, ctc, classifier), else every
    output of a raw model. A name the model does not have is refused naming the key."""
    names = [spec.name for spec in ctx.outputs]
    asked = options.outputs
    if asked:
        for name in asked:
            if name not in names:
                raise RecipeError("validate.outputs", f"the model has no output named {name!r} (outputs: "
                                  f"{', '.join(names) or 'none'})", recipe=str(ctx.recipe.path))
        return list(dict.fromkeys(asked))
    if ctx.postprocess.kind == "raw" or not names:
        return names
    levels = ctx.postprocess.levels  # a raw head's decoder reads every level: judged once, by its first
    return [ctx.postprocess.output or (levels[0] if levels else names[0])]


def detection_decoder(postprocess: PostprocessSpec) -> DetectionDecoder | None:
    """The shared postprocessor's decoder when the recipe declares ``kind: detection`` (its
    format, thresholds and NMS, so validation sees what the device serves); None leaves the
    metric's own YOLOv8 decoder for a recipe that names ``metric: detection`` on a raw model."""
    if postprocess.kind != "detection":
        return None
    processor = Postprocessor(postprocess)

    def decode(sample: Mapping[str, np.ndarray]) -> list[Detections]:
        result = processor(sample)
        images = [result] if not result or isinstance(result[0], dict) else result
        return [Detections.of([d["box"] for d in image] or np.zeros((0, 4)), [d["score"] for d in image],
                              [d["index"] for d in image]) for image in images]

    return decode


def judge(ctx: BuildContext, options: ValidateOptions, reference: Sequence[Mapping[str, np.ndarray]],
          candidate: Sequence[Mapping[str, np.ndarray]], labels: Sequence[int] | None) -> Evaluation:
    """A candidate against the fp32 reference by the task metric on every checked output:
    the one judgement of the validate pass and of the quantization search."""
    post = ctx.postprocess
    ctc = post.kind == "ctc"
    metric = task_metric(options.metric, post, labels is not None)
    outputs = checked_outputs(ctx, options)
    if options.min_string_match is not None and not (ctc and metric == "sequence"):
        raise RecipeError("validate.min_string_match", f"gates the decoded strings of metric sequence with a ctc "
                          f"postprocess; this build is judged by {metric} with postprocess "
                          f"{post.kind}", recipe=str(ctx.recipe.path))
    try:
        return evaluate(reference, candidate, metric=metric, outputs=outputs, budget=options.budget(), labels=labels,
                        decode=detection_decoder(post), blank=post.blank if ctc else None,
                        layout=post.layout)
    except MetricInputError as err:  # e.g. metric: detection on an output that is no detection head
        key = "validate.metric" if options.metric else "postprocess.kind"
        raise RecipeError(key, f"metric {metric} cannot read output {', '.join(outputs)}: {err}",
                          recipe=str(ctx.recipe.path)) from err


def reference_note(ctx: BuildContext) -> dict[str, Any]:
    """How the reference differs from the file the user gave, for the report: initializers it
    listed as inputs held constant (as packaged: onnxruntime then folds BatchNorm and constants
    at load in both), and input dims the recipe opened. Empty when it is the file as given."""
    note: dict[str, Any] = {}
    dropped = ctx.report.get("load", {}).get("initializer_inputs_dropped", 0)
    if dropped:
        note["initializer_inputs_constant"] = dropped
        note["why"] = ("the original listed initializers as graph inputs; the packaged model holds them "
                       "constant, so onnxruntime folds BatchNorm and constants at load in it: the reference "
                       "holds them constant too, so like is compared with like")
    opened = ctx.report.get("shape_inference", {}).get("opened")
    if opened:
        note["opened_dims"] = opened
    return note


MAX_NAMED_FILES = 10  # resampled files named in the report and the warning; the rest are counted


def _report_resampled(ctx: BuildContext, samples: Samples, report: dict[str, Any]) -> None:
    """Validation audio of another rate than ``preprocess.sample_rate`` was resampled (as a
    device resamples such a request): said in the report and once as a warning, never silently,
    since a rate unlike the model's is as often a wrong ``sample_rate`` as a file to convert."""
    if not samples.resampled:
        return
    rate = ctx.preprocess.sample_rate
    named = dict(sorted(samples.resampled.items())[:MAX_NAMED_FILES])
    report["resampled"] = {"to": rate, "count": len(samples.resampled), "files": named}
    listed = ", ".join(f"{name} ({hz} Hz)" for name, hz in named.items())
    more = f" and {len(samples.resampled) - len(named)} more" if len(samples.resampled) > len(named) else ""
    ctx.warn(f"validation audio resampled to preprocess.sample_rate {rate} Hz (linear, no anti-alias filter): "
             f"{listed}{more}; devices resample such requests the same way (preprocess.resample: false refuses them)")


@register
class ValidatePass(Pass):
    name = "validate"

    @staticmethod
    def _samples(ctx: BuildContext, options: ValidateOptions) -> tuple[Samples, str]:
        limit = options.samples or DEFAULT_SAMPLES
        # validate.data, else the calibration data, else the golden data: whatever real data
        # the recipe gives is used before anything is made up.
        recipe = ctx.recipe
        key, source = next(((key, source) for key, source in (
            ("validate.data", recipe.validate.data), ("quantize.calibration", recipe.quantize.calibration),
            ("golden.data", recipe.golden.data)) if source is not None), ("validate.data", None))
        if source is None:
            raise RecipeError("validate.data", "no validation data: give validate.data, or write validate: "
                              "{data: synthetic} to consent to made-up inputs", recipe=str(ctx.recipe.path))
        if source.synthetic:
            limit = min(limit, SYNTHETIC_SAMPLES)
        samples = load_samples(source, ctx.preprocess, ctx.inputs, key=key, limit=limit, **context_options(ctx))
        return samples, source.kind

    def run(self, ctx: BuildContext) -> None:
        options = ctx.recipe.validate
        checked_outputs(ctx, options)  # an unknown validate.outputs name is refused before any work
        samples, kind = self._samples(ctx, options)
        assert ctx.original is not None
        reference = run_samples(ctx.original.SerializeToString(), samples)
        settle_apply_softmax(ctx, reference)
        check_detection_format(ctx, reference, samples.feeds)
        settle_apply_sigmoid(ctx, reference)
        check_ctc_blank(ctx, reference)
        check_detection_scores(ctx, reference, samples.feeds)
        candidate = run_samples(ctx.model_bytes(), samples)
        precision = ctx.lossy or "fp32"
        lossless = ctx.lossy is None
        result = compare(reference, candidate, output=ctx.postprocess.output, labels=samples.labels)
        report: dict[str, Any] = {**result.to_json(), "precision": precision, "source": kind, **state_report(samples),
                                  **settle_output_contract(ctx, samples.feeds, candidate, self.name)}
        note = reference_note(ctx)
        if note:
            report["reference"] = note
        _report_resampled(ctx, samples, report)
        failures: list[tuple[str, float, float, str]] = []
        summaries: list[str] = []
        if lossless:
            fidelity = check_fidelity(reference, candidate, rtol=options.rtol, atol=options.atol,
                                      sample_names=samples.names)
            report["fidelity"] = fidelity.to_json()
            report["metric"] = "tolerance"
            summaries.append(fidelity.summary())
            if not fidelity.ok:
                worst = fidelity.worst
                failures.append(("tolerance", worst.ratio if worst else 0.0, 1.0,
                                 f"the packaged model differs from the original: {fidelity.summary()}"))
        if not lossless or options.budget():
            evaluation = judge(ctx, options, reference, candidate, samples.labels)
            report["metric"] = evaluation.metric
            report["task"] = evaluation.to_json()
            summaries.append(evaluation.summary())
            missed = evaluation.worst
            if missed is not None and not evaluation.met:
                failures.append((evaluation.metric, float(missed.value), float(missed.limit),
                                 f"the packaged model misses the accuracy budget: {evaluation.summary()}"
                                 + (" (state carried over each file's frames)" if samples.sequential else "")))
        self._expected(ctx, samples, reference if not lossless else candidate, options, report, failures)
        report.update({"budget_met": not failures, "summary": "; ".join(summaries)})
        ctx.report[self.name] = report
        ctx.progress(f"validate: {report['summary']}")
        if failures:
            metric, value, threshold, problem = failures[0]
            if options.allow_failure:
                ctx.warn(f"validation failed but allow_failure is set: {problem}")
                return
            raise ValidationFailed(metric, value, threshold, problem)

    @staticmethod
    def _expected(ctx: BuildContext, samples: Samples, outputs: list[dict[str, np.ndarray]],
                  options: ValidateOptions, report: dict[str, Any], failures: list[tuple[str, float, float, str]]
                  ) -> None:
        """Test data's expected outputs: checked against the packaged model of a lossless
        build, and against the original of a lossy one (whose packaged model the budget judges)."""
        expected = expected_check(samples, outputs, options)
        if expected is None:
            return
        expected["against"] = "packaged" if ctx.lossy is None else "original"
        report["expected_outputs"] = expected
        if not expected["ok"]:
            worst = next(o for o in expected["outputs"] if o["output"] == expected["worst_output"])
            ratio = worst["ratio"] if isinstance(worst["ratio"], float) else float("inf")
            failures.append(("expected", ratio, 1.0, f"the {expected['against']} model does not give the test "
                             f"data's expected outputs: {expected['summary']}"))
