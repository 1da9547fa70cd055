"""The ``io_spec`` pass: the model's inputs and outputs and the typed pre/postprocessing specs,
checked against each other (softmax already in the graph, bundled assets, outputs the decoder reads).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import onnx

from edgepack_core.postprocess import load_charset
from edgepack_core.postprocess_spec import PostprocessSpec
from sdk.errors import RecipeError
from sdk.packager.onnx_graph import (
    graph_io,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register

# Ops that only move or reshape values: an output behind them still holds a Softmax's probabilities.
_SHAPE_ONLY_OPS = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"}


def _softmax_producer(model: onnx.ModelProto, output: str) -> onnx.NodeProto | None:
    """The Softmax node whose values ``output`` carries (through shape-only ops), or None."""
    producers = {name: node for node in model.graph.node for name in node.output}
    node = producers.get(output)
    while node is not None and node.op_type in _SHAPE_ONLY_OPS and node.input:
        node = producers.get(node.input[0])
    return node if node is not None and node.op_type == "Softmax" else None


def resolve_apply_softmax(
    model: onnx.ModelProto, post: PostprocessSpec
) -> tuple[PostprocessSpec, dict[str, Any] | None]:
    """topk/ctc: ``post`` with ``apply_softmax`` resolved, and why (for the report).

    Why: a classifier that already ends in Softmax scored by a second softmax reports 0.45
    where the model says 0.92; the recipe's explicit value always wins."""
    if post.kind not in ("topk", "ctc"):
        return post, None
    output = post.output or model.graph.output[0].name
    if post.apply_softmax is not None:
        return post, {"value": post.apply_softmax, "output": output, "why": "set in the recipe"}
    node = _softmax_producer(model, output)
    why = (
        f"output {output} comes from Softmax node {node.name or '(unnamed)'}: scores are its probabilities"
        if node is not None
        else f"output {output} does not come from a Softmax: scores are its softmax"
    )
    return replace(post, apply_softmax=node is None), {"value": node is None, "output": output, "why": why}


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


@register
class IoSpecPass(Pass):
    """Record inputs/outputs and the normalized pre/postprocessing specs; check they fit."""

    name = "io_spec"

    def run(self, ctx: BuildContext) -> None:
        ctx.inputs, ctx.outputs = graph_io(ctx.require_model(), model_label(ctx))
        recipe = str(ctx.recipe.path)
        ctx.preprocess = ctx.recipe.preprocess
        post = _bundle_assets(ctx, ctx.recipe.postprocess, recipe)
        ctx.postprocess, softmax_note = resolve_apply_softmax(ctx.require_model(), post)
        names = [i.name for i in ctx.inputs]
        target = ctx.preprocess.input
        if target is not None and target not in names:
            raise RecipeError(
                "preprocess.input", f"no model input named {target!r} (inputs: {', '.join(names)})", recipe=recipe
            )
        if ctx.preprocess.kind == "image":
            self._check_image_input(ctx, target or names[0], recipe)
        output = ctx.postprocess.output
        if output is not None and output not in [o.name for o in ctx.outputs]:
            raise RecipeError("postprocess.output", f"no model output named {output!r}", recipe=recipe)
        _check_postprocess_outputs(ctx, recipe)
        ctx.report[self.name] = {
            "inputs": [i.to_json() for i in ctx.inputs],
            "outputs": [o.to_json() for o in ctx.outputs],
            **({"apply_softmax": softmax_note} if softmax_note else {}),
        }

    @staticmethod
    def _check_image_input(ctx: BuildContext, name: str, recipe: str) -> None:
        spec = ctx.preprocess
        model_input = next(i for i in ctx.inputs if i.name == name)
        height, width = spec.resize.size if spec.resize is not None else (None, None)
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
