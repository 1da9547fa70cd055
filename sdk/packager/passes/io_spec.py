"""The ``io_spec`` pass: the model's inputs and outputs and the typed pre/postprocessing specs,
checked against each other (softmax already in the graph, bundled assets, outputs the decoder reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import onnx

from edgepack_core.postprocess import load_charset, load_labels
from edgepack_core.postprocess_spec import RAW_FORMATS, PostprocessSpec
from sdk.errors import RecipeError
from sdk.packager.ctc_blank import blank_range_problem, likely_blank_problem
from sdk.packager.declared import (
    audio_frame_problem,
    dtype_problem,
    height_resize_problem,
    model_rate_problem,
    shape_problem,
)
from sdk.packager.detection_heads import (
    RAW_GRID_HINT,
    declared_format_problem,
    labels_problem,
    raw_levels_problem,
    sigmoid_applied,
    undecoded_boxes,
    yolox_input_size,
)
from sdk.packager.onnx_graph import (
    graph_io,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register
from sdk.packager.probabilities import Producer, detection_scores, is_distribution, outside_unit_interval, producer


def _graph_decision(output: str, found: Producer | None) -> tuple[bool, str]:
    """apply_softmax as the graph shows it, and why."""
    if found is None:
        return True, f"output {output} does not come from a Softmax: scores are its softmax"
    if found.kind == "log":
        return True, (f"output {output} comes from {found.pattern} node {found.node}: log-probabilities, whose "
                      "softmax is the probabilities")
    what = "probabilities" if found.kind == "distribution" else "independent probabilities"
    return False, f"output {output} comes from {found.pattern} node {found.node}: scores are its {what}"


def second_softmax(post: PostprocessSpec, output: str, evidence: str, recipe: str) -> RecipeError:
    """The one-line refusal of a softmax over an output that already is a distribution."""
    if post.kind == "softmax":
        key, what = "postprocess.kind", "is softmax"
        remedy = "use kind: topk (it keeps the model's probabilities) or raw"
    else:
        key, what, remedy = "postprocess.apply_softmax", "is true", "leave apply_softmax out"
    return RecipeError(key, f"{what} but output {output} is already a probability distribution ({evidence}): a "
                       f"second softmax would flatten it; {remedy}", recipe=recipe)


def resolve_apply_softmax(
    model: onnx.ModelProto, post: PostprocessSpec, recipe: str = "recipe"
) -> tuple[PostprocessSpec, dict[str, Any] | None]:
    """topk/ctc: ``post`` with ``apply_softmax`` resolved, and why (for the report); softmax:
    refused on an output the graph already normalises.

    Why: a classifier whose graph already computes probabilities (Softmax, or one written out
    as Exp/ReduceSum/Div) scored by a second softmax reports 0.0126 where the model says 0.9999.
    An explicit ``true`` on such an output is refused; the validate pass settles what no graph
    pattern names from the outputs themselves (:func:`settle_apply_softmax`)."""
    if post.kind not in ("topk", "ctc", "softmax"):
        return post, None
    output = post.output or model.graph.output[0].name
    found = producer(model, output)
    forced = post.kind == "softmax" or post.apply_softmax is True
    if forced and found is not None and found.kind == "distribution":
        raise second_softmax(post, output, f"{found.pattern} node {found.node}", recipe)
    if post.kind == "softmax":
        return post, None
    if post.apply_softmax is not None:
        return post, {"value": post.apply_softmax, "output": output, "why": "set in the recipe"}
    value, why = _graph_decision(output, found)
    return replace(post, apply_softmax=value), {"value": value, "output": output, "why": why}


def check_detection_scores(
    ctx: BuildContext,
    outputs: Sequence[Mapping[str, np.ndarray]],
    feeds: Sequence[Mapping[str, np.ndarray]] = (),
) -> None:
    """A detection head's scores must be probabilities on the validation data: the decoder
    thresholds and ranks them as such, so logits (a head exported without its Sigmoid, an
    undecoded grid) would ship wrong boxes without a word. Refused naming the output, and on
    an image (``feeds``) naming the raw grid when its boxes are not decoded either."""
    post = ctx.postprocess
    if post.kind != "detection" or not ctx.outputs or post.format in RAW_FORMATS:
        return
    name = post.outputs.scores if post.format == "boxes_scores" and post.outputs is not None else None
    name = name or post.output or ctx.outputs[0].name
    scores = [detection_scores(post.format, sample[name]) for sample in outputs if name in sample]
    spread = outside_unit_interval([s for s in scores if s is not None])
    if spread is None:
        return
    boxes = undecoded_boxes(post.format, [sample[name] for sample in outputs if name in sample],
                            (post.input_size if post.format == "yolox" else None) or _image_size(ctx, feeds),
                            post.strides)
    fix = ("export the head with its final Sigmoid, or declare the format the output has" if boxes is None else
           f"its boxes are not decoded either ({boxes}); {RAW_GRID_HINT}")
    raise RecipeError("postprocess.format", f"{post.format}: the scores of output {name} are not probabilities: "
                      f"they range over [{spread[0]:.4g}, {spread[1]:.4g}] on the validation data, and a "
                      f"{post.format} head carries scores in [0, 1]; {fix}", recipe=str(ctx.recipe.path))


def _image_size(ctx: BuildContext, feeds: Sequence[Mapping[str, np.ndarray]]) -> tuple[int, int] | None:
    """(height, width) of the image the model sees, from a validation feed; None for non-images."""
    spec = ctx.preprocess
    name = spec.input or (ctx.inputs[0].name if ctx.inputs else "")
    if spec.kind != "image" or not feeds or name not in feeds[0]:
        return None
    shape = np.shape(feeds[0][name])
    if len(shape) < 3:
        return None
    height, width = shape[-2:] if spec.layout == "NCHW" else shape[-3:-1]
    return int(height), int(width)


def check_detection_format(
    ctx: BuildContext, outputs: Sequence[Mapping[str, np.ndarray]], feeds: Sequence[Mapping[str, np.ndarray]]
) -> None:
    """A YOLO ``format`` must be what the output holds on the validation data (boxes in input
    pixels, scores in [0, 1]): a raw grid declared as a decoded head is refused, naming the
    format that fits when one does (:mod:`sdk.packager.detection_heads`)."""
    post = ctx.postprocess
    if post.kind != "detection" or not ctx.outputs:
        return
    image = post.input_size or _image_size(ctx, feeds)  # input_size: the grid formats' only
    recipe = str(ctx.recipe.path)
    if post.format in RAW_FORMATS:
        levels = post.levels or tuple(o.name for o in ctx.outputs)
        shapes = {name: np.shape(outputs[0][name]) for name in levels if outputs and name in outputs[0]}
        found = raw_levels_problem(post, [shapes[name] for name in levels if name in shapes], image)
        labels = ctx.files.get("assets/labels.txt")
        if found is None and labels is not None and levels[0] in shapes:
            found = labels_problem(post, shapes[levels[0]], len(load_labels(labels.decode("utf-8"))))
        if found is not None:
            raise RecipeError(f"postprocess.{found[0]}", f"{post.format}: outputs {', '.join(levels)} on the "
                              f"validation data: {found[1]}", recipe=recipe)
        return
    name = post.output or ctx.outputs[0].name
    values = [sample[name] for sample in outputs if name in sample]
    problem = declared_format_problem(post.format, values, image, post.strides)
    if problem is None and post.format in ("yolov5", "yolov8") and values:
        all_shapes = [np.shape(outputs[0][o.name]) for o in ctx.outputs if o.name in outputs[0]]
        raw = raw_levels_problem(post, all_shapes, image, declared=False)
        problem = None if raw is None else f"shape {list(np.shape(values[0]))}: {raw[1]}"
    if problem is not None:
        raise RecipeError("postprocess.format", f"{post.format}: output {name} on the validation data has {problem}",
                          recipe=recipe)


def settle_apply_sigmoid(ctx: BuildContext, outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
    """A raw head's sigmoid as its outputs show it on the validation data: levels whose score
    channels all lie in [0, 1] already went through the graph's Sigmoid (apply_sigmoid false);
    logits get it applied. An explicit value the data contradicts is refused naming the key."""
    post = ctx.postprocess
    if post.kind != "detection" or post.format not in RAW_FORMATS or not outputs:
        return
    levels = post.levels or tuple(o.name for o in ctx.outputs)
    applied, spread = sigmoid_applied(post, [[sample[name] for name in levels] for sample in outputs])
    declared = ctx.recipe.postprocess.apply_sigmoid  # not post's: the quantize pass may have settled it
    if declared is not None and declared == applied:
        what = "true, but they lie in [0, 1]: the graph applied the Sigmoid already; a second one would squash them" \
            if declared else "false, but they are no probabilities"
        raise RecipeError("postprocess.apply_sigmoid", f"{post.format}: the score channels of {', '.join(levels)} "
                          f"range over [{spread[0]:.4g}, {spread[1]:.4g}] on the validation data; apply_sigmoid is "
                          f"{what}", recipe=str(ctx.recipe.path))
    ctx.postprocess = replace(post, apply_sigmoid=not applied)
    ctx.report.setdefault("io_spec", {})["apply_sigmoid"] = {
        "value": not applied, "outputs": list(levels),
        "why": "set in the recipe" if declared is not None else
        f"the score channels range over [{spread[0]:.4g}, {spread[1]:.4g}] on the validation data: "
        + ("probabilities, the graph applied the Sigmoid" if applied else "logits")}


def check_ctc_blank(ctx: BuildContext, outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
    """A ctc ``blank`` must index the class axis of the output on the validation data and act
    as a blank there (:mod:`sdk.packager.ctc_blank`); refused naming the likely blank."""
    post = ctx.postprocess
    if post.kind != "ctc" or not ctx.outputs:
        return
    name = post.output or ctx.outputs[0].name
    values = [sample[name] for sample in outputs if name in sample and np.ndim(sample[name]) >= 1]
    problem = blank_range_problem(post.blank, int(np.shape(values[0])[-1]), name) if values else None
    problem = problem or likely_blank_problem(post.blank, values, name)
    if problem is not None:
        raise RecipeError("postprocess.blank", problem, recipe=str(ctx.recipe.path))


def settle_apply_softmax(ctx: BuildContext, outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
    """After the graph: an output the model returns as a distribution on the validation data
    (non-negative, each row summing to 1 along the class axis) gets no second softmax; an
    explicit ``apply_softmax: true`` on it is refused naming the output."""
    post = ctx.postprocess
    if post.kind not in ("topk", "ctc", "softmax") or post.apply_softmax is False or not ctx.outputs:
        return
    output = post.output or ctx.outputs[0].name
    if not is_distribution([sample[output] for sample in outputs if output in sample]):
        return
    if post.kind == "softmax" or ctx.recipe.postprocess.apply_softmax is True:
        raise second_softmax(post, output, "on the validation data: non-negative, rows sum to 1", str(ctx.recipe.path))
    if producer(ctx.require_model(), output) is not None:  # LogSoftmax: log-probabilities, never rows of 1
        return
    ctx.postprocess = replace(post, apply_softmax=False)
    ctx.report.setdefault("io_spec", {})["apply_softmax"] = {
        "value": False, "output": output,
        "why": f"output {output} is non-negative and sums to 1 along its class axis on the validation data: "
               "scores are its probabilities"}


def _bundle_assets(ctx: BuildContext, post: PostprocessSpec, recipe: str) -> PostprocessSpec:
    """Labels and charset files travel in the artifact; the spec names them by member path."""
    members: dict[str, str] = {}
    for key, member in (("labels", "assets/labels.txt"), ("charset", "assets/charset.txt")):
        source = getattr(post, key)
        if not source:
            continue
        with open(source, "rb") as handle:
            data = handle.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RecipeError(
                f"postprocess.{key}", f"{source} is not UTF-8 text ({err.reason} at byte {err.start})", recipe=recipe
            ) from err
        ctx.files[member] = data
        members[key] = member
    return replace(post, labels=members.get("labels", post.labels), charset=members.get("charset", post.charset))


def _check_postprocess_outputs(ctx: BuildContext, recipe: str) -> None:
    """Named outputs exist; a ctc charset has one symbol per class but the blank."""
    post, outputs = ctx.postprocess, {o.name: o for o in ctx.outputs}
    named = post.outputs.to_json() if post.outputs is not None else {}
    for role, name in named.items():
        if name not in outputs:
            raise RecipeError(
                f"postprocess.outputs.{role}",
                f"no model output named {name!r} (outputs: {', '.join(outputs)})",
                recipe=recipe,
            )
    if post.kind != "ctc" or not post.charset:
        return
    symbols = load_charset(ctx.files["assets/charset.txt"].decode("utf-8"), append_space=post.append_space)
    output = outputs[post.output or ctx.outputs[0].name]
    classes = output.shape[-1] if output.shape else None
    if isinstance(classes, int) and classes != len(symbols) + 1:
        raise RecipeError(
            "postprocess.charset",
            f"has {len(symbols)} symbols"
            f"{' with the appended space' if post.append_space else ''}, but output "
            f"{output.name} has {classes} classes: the charset plus the blank must be {classes}",
            recipe=recipe,
        )


def _with_raw_levels(ctx: BuildContext, recipe: str) -> PostprocessSpec:
    """A raw head's level outputs: those the recipe names (each a model output), else every
    model output in order, one per stride; written into the manifest."""
    post = ctx.postprocess
    if post.kind != "detection" or post.format not in RAW_FORMATS:
        return post
    names = [o.name for o in ctx.outputs]
    for name in post.levels or ():
        if name not in names:
            raise RecipeError("postprocess.outputs", f"no model output named {name!r} (outputs: {', '.join(names)})",
                              recipe=recipe)
    levels = post.levels or tuple(names)
    if len(levels) != len(post.strides):
        raise RecipeError("postprocess.strides", f"{post.format}: the model has {len(levels)} outputs "
                          f"({', '.join(levels)}) but strides has {len(post.strides)} levels {list(post.strides)}: "
                          "give one stride per level output, or name the level outputs in outputs", recipe=recipe)
    return replace(post, levels=levels)


def _with_yolox_grid(ctx: BuildContext, fed: str | None, recipe: str) -> PostprocessSpec:
    """A ``yolox`` head decodes over grids laid on the model input: its ``input_size`` is the
    resize's size or the input's fixed dims, written into the manifest; refused when neither says.
    A raw head's grids come from its outputs: its ``input_size`` is filled in when known."""
    post = ctx.postprocess
    if post.kind != "detection" or post.format not in ("yolox", *RAW_FORMATS) or post.input_size is not None:
        return post
    model_input = next((i for i in ctx.inputs if i.name == fed), None)
    size = yolox_input_size(ctx.preprocess, model_input)
    if size is None and post.format in RAW_FORMATS:
        return post
    if size is None:
        shape = list(model_input.shape) if model_input is not None else []
        raise RecipeError("postprocess.input_size", f"format yolox decodes grids over the model input, whose size "
                          f"input {fed} {shape} does not fix: give input_size: [height, width] (or an image "
                          "resize)", recipe=recipe)
    return replace(post, input_size=size)


def _check_declared_input(ctx: BuildContext, name: str, recipe: str) -> None:
    """``preprocess.shape``, ``preprocess.dtype`` and an audio spec's frames fit the input they
    feed, and its ``sample_rate`` the rate the model states, refused here in Edgepack's words
    before onnxruntime's (:mod:`sdk.packager.declared`)."""
    model_input = next(i for i in ctx.inputs if i.name == name)
    checks = [("preprocess.shape", shape_problem(ctx.preprocess, model_input)),
              ("preprocess.dtype", dtype_problem(ctx.preprocess, model_input))]
    frames = audio_frame_problem(ctx.preprocess, model_input)
    if frames is not None:
        checks.append(frames)
    constants = {key: decl.value for key, decl in ctx.recipe.inputs.items() if decl.role == "constant"}
    metadata = {prop.key: prop.value for prop in ctx.require_model().metadata_props}
    checks.append(("preprocess.sample_rate", model_rate_problem(ctx.preprocess, constants, metadata)))
    for key, problem in checks:
        if problem is not None:
            raise RecipeError(key, problem, recipe=recipe)


@register
class IoSpecPass(Pass):
    """Record inputs/outputs and the normalized pre/postprocessing specs; check they fit."""

    name = "io_spec"

    def run(self, ctx: BuildContext) -> None:
        ctx.inputs, ctx.outputs = graph_io(ctx.require_model(), model_label(ctx))
        recipe = str(ctx.recipe.path)
        ctx.preprocess = ctx.recipe.preprocess
        post = _bundle_assets(ctx, ctx.recipe.postprocess, recipe)
        ctx.postprocess, softmax_note = resolve_apply_softmax(ctx.require_model(), post, recipe)
        names = [i.name for i in ctx.inputs]
        target = ctx.preprocess.input
        if target is not None and target not in names:
            raise RecipeError(
                "preprocess.input", f"no model input named {target!r} (inputs: {', '.join(names)})", recipe=recipe
            )
        fed = target or (names[0] if names else None)
        if fed is not None:  # a graph without inputs (a Constant, a generator) has nothing to check
            _check_declared_input(ctx, fed, recipe)
            if ctx.preprocess.kind == "image":
                self._check_image_input(ctx, fed, recipe)
        output = ctx.postprocess.output
        if output is not None and output not in [o.name for o in ctx.outputs]:
            raise RecipeError("postprocess.output", f"no model output named {output!r}", recipe=recipe)
        _check_postprocess_outputs(ctx, recipe)
        ctx.postprocess = _with_yolox_grid(ctx, fed, recipe)
        ctx.postprocess = _with_raw_levels(ctx, recipe)
        names = [o.name for o in ctx.outputs]
        for name in ctx.recipe.outputs:
            if name not in names:
                raise RecipeError(f"outputs.{name}", f"the model has no output {name!r} (outputs: {', '.join(names)})",
                                  recipe=recipe)
        ctx.report[self.name] = {
            "inputs": [i.to_json() for i in ctx.inputs],
            "outputs": [o.to_json() for o in ctx.outputs],
            **({"apply_softmax": softmax_note} if softmax_note else {}),
        }

    @staticmethod
    def _check_image_input(ctx: BuildContext, name: str, recipe: str) -> None:
        spec = ctx.preprocess
        model_input = next(i for i in ctx.inputs if i.name == name)
        problem = height_resize_problem(spec, model_input)
        if problem is not None:
            raise RecipeError(*problem, recipe=recipe)
        height, width = spec.resize.size if spec.resize is not None else (None, None)
        if spec.resize is not None and spec.resize.variable_width:
            width = None  # keep-aspect-height: each image its own width (checked just above)
        channels = spec.channels
        if spec.layout == "NCHW":
            expected: list[int | None] = [channels, height, width]
        else:
            expected = [height, width, channels]
        shape = list(model_input.shape)
        if spec.batch:
            shape = shape[1:]
        if len(shape) != 3:
            raise RecipeError(
                "preprocess",
                f"input {name} has shape {list(model_input.shape)}, not an image tensor for this layout",
                recipe=recipe,
            )
        for got, want in zip(shape, expected, strict=True):
            if isinstance(got, int) and want is not None and got != want:
                raise RecipeError(
                    "preprocess", f"produces {expected} per image but input {name} expects {shape}", recipe=recipe
                )
