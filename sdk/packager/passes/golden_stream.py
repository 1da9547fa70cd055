"""Golden streams: a short clip run through the packaged model with a pipeline fragment, its
events signed beside it, so a device's activation check can prove the model still sees them.

The clip is bounded before it is read (:mod:`edgepack_core.golden_stream`); the fragment's
stages must all name this model. The replay runs the agent's own pipeline runner in a child
process (``python -m device_agent.pipelines.golden``, since the host never imports the agent) on
the model as it will ship, with the manifest it will carry; a clip that decodes to no frames,
a fragment the pipeline parser refuses, or a clip that yields no event (nothing to check) fails
the build with one line.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepack_core.errors import EdgepackError
from edgepack_core.golden_stream import (
    CLIP_SUFFIXES,
    EVENTS_MEMBER,
    MAX_CLIP_BYTES,
    MAX_FRAMES,
    GoldenStreamField,
    clip_member,
    clip_size_problem,
    parse_events,
)
from sdk.errors import BuildError, RecipeError
from sdk.packager.options import option
from sdk.packager.passes.base import BuildContext, Pass, register

REPLAY_TIMEOUT_S = 600
_FRAGMENT_SCHEMA = {
    "type": "object",
    "description": "the pipeline the clip runs through: stages (each naming "
    "this model), tracker and rules, as in schemas/pipeline.schema.json",
}


def _frozen(value: Any) -> Mapping[str, Any]:
    return types.MappingProxyType(copy.deepcopy(value))


@dataclass(frozen=True)
class GoldenStreamOptions:
    """``golden_stream``: a short clip (<= 8 MiB, <= 300 frames) and the pipeline fragment whose
    events the device's activation check compares."""

    clip: str | None = option(None, description="a short video clip (mp4, mkv, avi)", minLength=1)
    pipeline: Mapping[str, Any] | None = option(None, schema=_FRAGMENT_SCHEMA, parse=_frozen)


def check_section(data: Mapping[str, Any], name: str, recipe: str) -> None:
    """What the recipe check can say before any model is loaded: both keys given, the clip's
    kind and size (never read past the bound), and every stage naming this model."""
    section = data.get("golden_stream")
    if section is None:
        return
    for key in ("clip", "pipeline"):
        if key not in section:
            raise RecipeError(f"golden_stream.{key}", "a golden stream needs a clip and a pipeline", recipe=recipe)
    clip = Path(section["clip"])
    if clip.suffix.lower() not in CLIP_SUFFIXES:
        raise RecipeError("golden_stream.clip", f"give a video clip ({', '.join(CLIP_SUFFIXES)})", recipe=recipe)
    problem = clip_size_problem(clip.stat().st_size)
    if problem is not None:
        raise RecipeError("golden_stream.clip", problem, recipe=recipe)
    stages = section["pipeline"].get("stages")
    for index, stage in enumerate(stages if isinstance(stages, list) else []):
        model = stage.get("model") if isinstance(stage, dict) else None
        if model != name:
            raise RecipeError(
                f"golden_stream.pipeline.stages[{index}].model",
                f"names {model!r}: a golden stream runs this model ({name!r}) alone",
                recipe=recipe,
            )


def _model_folder(ctx: BuildContext, folder: Path) -> None:
    """The model as it ships, with the manifest it will carry (unsigned), for the replay."""
    from sdk.packager.pipeline import MODEL_MEMBER, assemble_manifest

    files = {**ctx.files, MODEL_MEMBER: ctx.model_bytes()}
    manifest = {key: value for key, value in assemble_manifest(ctx).items() if key != "report"}
    manifest["files"] = {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()
    }
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def read_clip(path: Path) -> bytes:
    """The clip's bytes, never more than the bound read (the file may have grown since the check)."""
    with path.open("rb") as handle:
        data = handle.read(MAX_CLIP_BYTES + 1)
    problem = clip_size_problem(len(data))
    if problem is not None:
        raise BuildError("golden_stream", problem)
    return data


def replay(ctx: BuildContext, data: bytes, suffix: str, fragment: Mapping[str, Any]) -> tuple[int, bytes]:
    """(frames, events.json bytes) of the clip through the fragment on the packaged model."""
    work = ctx.new_tempdir("golden-stream-")
    _model_folder(ctx, work / "model")
    clip = work / f"clip{suffix}"
    clip.write_bytes(data)
    (work / "pipeline.json").write_text(json.dumps(fragment), encoding="utf-8")
    out = work / "events.json"
    command = [
        sys.executable,
        "-m",
        "device_agent.pipelines.golden",
        "--model-dir",
        str(work / "model"),
        "--pipeline",
        str(work / "pipeline.json"),
        "--clip",
        str(clip),
        "--out",
        str(out),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as err:
        raise BuildError("golden_stream", f"the replay took over {REPLAY_TIMEOUT_S} s") from err
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise BuildError("golden_stream", lines[-1] if lines else f"the replay exited {done.returncode}")
    frames = int(json.loads(done.stdout.strip().splitlines()[-1])["frames"])
    return frames, out.read_bytes()


@register
class GoldenStreamPass(Pass):
    """Replay the recipe's golden clip; store the clip and its expected events."""

    name = "golden_stream"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.golden_stream.clip is not None

    def run(self, ctx: BuildContext) -> None:
        options = ctx.recipe.golden_stream
        assert options.clip is not None and options.pipeline is not None  # check_section
        clip = Path(options.clip)
        fragment = json.loads(json.dumps(dict(options.pipeline), default=dict))
        data = read_clip(clip)
        frames, events = replay(ctx, data, clip.suffix.lower(), fragment)
        try:
            keys = parse_events(events)
        except EdgepackError as err:
            raise BuildError(self.name, str(err)) from err
        if not keys:
            raise BuildError(
                self.name,
                f"the golden clip gives no event through its pipeline ({frames} frames): "
                "nothing to check; give a clip where the rules fire",
            )
        member = clip_member(clip.suffix)
        ctx.files[member] = data
        ctx.files[EVENTS_MEMBER] = events
        ctx.golden_stream = GoldenStreamField(member, EVENTS_MEMBER, min(frames, MAX_FRAMES), fragment)
        ctx.report[self.name] = {"frames": frames, "events": len(keys)}
