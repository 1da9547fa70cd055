"""Golden streams replayed: a clip decoded and run through a pipeline fragment's stages, tracker
and rules with the runner every pipeline uses (:meth:`PipelineRunner.process`, frame by frame
on the caller's thread), so the events the packager signs and the events the agent checks at
activation come from the same code.

The packager runs this module in a child process (``python -m device_agent.pipelines.golden``:
the host never imports the agent, tests/test_layering.py) on the model it is packaging; the
agent's update service calls :func:`replay_clip` on the candidate model before the switch
(:mod:`device_agent.updates.golden_stream`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from device_agent.errors import ConfigError, PipelineRefused
from device_agent.pipelines.frames import SourceFrame
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sources import OpenPlan, decode_av
from device_agent.pipelines.spec import PipelineSpec, parse_pipelines
from edgepack_core.errors import EdgepackError, SchemaError
from edgepack_core.golden_stream import FRAGMENT_KEYS, MAX_FRAMES, EventKey, clip_size_problem, events_bytes, key_of

NAME = "golden"


def golden_spec(fragment: Mapping[str, Any], *, where: str = "golden_stream.pipeline") -> PipelineSpec:
    """The pipeline a fragment (``stages``, ``tracker``, ``rules``) describes, validated by the
    pipelines' own parser: frames pushed one by one, every frame kept, no sink."""
    if not isinstance(fragment, Mapping):
        raise SchemaError(where, "must be a mapping of stages, tracker and rules")
    unknown = sorted(set(fragment) - set(FRAGMENT_KEYS))
    if unknown:
        raise SchemaError(
            f"{where}.{unknown[0]}", f"not a key of a golden stream's pipeline (give {', '.join(FRAGMENT_KEYS)})"
        )
    document = {"name": NAME, "source": {"push": True, "policy": "every"}, **fragment}
    try:
        (spec,) = parse_pipelines([document], where=where)
    except SchemaError as err:  # "golden_stream.pipeline[0].rules[1]: ..." -> without the list index
        raise SchemaError(err.path.replace(f"{where}[0]", where), err.problem) from err
    except ConfigError as err:
        raise SchemaError(err.key.replace(f"{where}[0]", where), err.problem) from err
    return spec


def decode_clip(path: Path, max_frames: int = MAX_FRAMES) -> list[SourceFrame]:
    """Every frame of the clip (RGB) with its own timestamp, bounded: its bytes before any
    decoding, its frames as they decode. Needs PyAV (the agent's ``streams`` extra)."""
    problem = clip_size_problem(path.stat().st_size)
    if problem is not None:
        raise PipelineRefused("golden_stream.clip", problem)
    frames: list[SourceFrame] = []
    try:
        for ts, image, _ in decode_av(OpenPlan("av", str(path)), threading.Event()):
            if len(frames) >= max_frames:
                raise PipelineRefused("golden_stream.clip", f"the golden clip has more than {max_frames} frames")
            frames.append(SourceFrame(len(frames), ts, image=image))
    except IndexError as err:  # decode_av's streams.video[0] of a container without video
        raise PipelineRefused("golden_stream.clip", "the golden clip decodes to no frames (no video stream)") from err
    except (OSError, ValueError) as err:  # PyAV's FFmpeg errors are OSError/ValueError subclasses
        raise PipelineRefused("golden_stream.clip", f"cannot decode the golden clip: {err}") from err
    if not frames:
        raise PipelineRefused("golden_stream.clip", "the golden clip decodes to no frames")
    return frames


def replay(spec: PipelineSpec, services: Callable[[str], Any], frames: Sequence[SourceFrame]) -> list[EventKey]:
    """The events of ``frames`` through ``spec`` (the runner's own per-frame path), as golden
    keys. A frame a stage failed on fails the replay: a golden stream proves nothing then."""
    runner = PipelineRunner(spec, NAME, services, [])
    keys: list[EventKey] = []
    for frame in frames:
        keys += [key_of(event) for event in runner.process(frame)]
        if runner.counters.stage_errors or runner.counters.missing_model:
            raise PipelineRefused(
                "golden_stream.pipeline",
                f"a stage failed on frame {frame.index} of the golden clip (the agent's log names why)",
            )
    return keys


def replay_clip(fragment: Mapping[str, Any], clip: Path, services: Callable[[str], Any]) -> tuple[int, list[EventKey]]:
    """(frames, events) of ``clip`` through ``fragment``."""
    spec = golden_spec(fragment)
    frames = decode_clip(clip)
    return len(frames), replay(spec, services, frames)


def _host_replay(args: argparse.Namespace) -> None:
    """The packager's child: load the unsigned model folder it wrote and replay the clip."""
    from device_agent.runtime import InferenceService, load_model
    from edgepack_core.manifest import check_manifest

    root = Path(args.model_dir)
    manifest = check_manifest(json.loads((root / "manifest.json").read_text(encoding="utf-8")))
    service = InferenceService(load_model(root, manifest, smoke_test=False))
    fragment = json.loads(Path(args.pipeline).read_text(encoding="utf-8"))
    frames, keys = replay_clip(fragment, Path(args.clip), lambda name: service if name == manifest.name else None)
    Path(args.out).write_bytes(events_bytes(keys))
    print(json.dumps({"frames": frames, "events": len(keys)}))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m device_agent.pipelines.golden")
    for name in ("--model-dir", "--pipeline", "--clip", "--out"):
        parser.add_argument(name, required=True)
    args = parser.parse_args(argv)
    try:
        _host_replay(args)
    except EdgepackError as err:
        print(str(err).splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
