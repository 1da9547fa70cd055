"""``edgepack-agent``: the device CLI (argparse: the device side does not import click).

Every expected failure is an EdgepackError and becomes one line on stderr with its exit
code (1 failed, 2 bad usage); argparse's own usage errors exit 2.

numpy and everything above it are imported by the commands, not here, so ``main`` can pause the
garbage collector before a one-shot ``predict`` imports them (see :func:`main`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgepack_core import __version__
from edgepack_core.errors import EdgepackError, UsageError, cause_chain
from edgepack_core.targets import PROFILES

if TYPE_CHECKING:
    import numpy as np

IMAGE_MEDIA_TYPES = {".jpg": "image/jpeg", ".ppm": "image/x-portable-pixmap", ".pgm": "image/x-portable-graymap",
                     ".tif": "image/tiff"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}


def _trust(paths: Sequence[str]) -> Any:
    from edgepack_core.signing import RELEASE, TrustStore

    return TrustStore.from_paths(paths, kind=RELEASE)


def _read_input(path: Path) -> bytes | np.ndarray | dict[str, np.ndarray]:
    import numpy as np

    if not path.exists():
        raise UsageError(f"{path}: no such input file")
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        try:
            loaded = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise UsageError(f"{path}: not a readable {suffix} file ({err})") from err
        if isinstance(loaded, np.ndarray):
            return loaded
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    return path.read_bytes()


def input_media_type(path: Path) -> str | None:
    """The media type an input file's suffix names (None: told apart by its first bytes), so a
    wrong kind of input is worded as HTTP's 415 words it ("does not take image/png"). Pure."""
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return IMAGE_MEDIA_TYPES.get(suffix, f"image/{suffix[1:]}")
    return "audio/wav" if suffix in (".wav", ".wave") else None


def _extract_for_predict(artifact: str, dest: Path, trust: Sequence[str]) -> Any:
    from edgepack_core.artifact import extract_artifact

    # Fully verified (signature, every header, every hash, once, while extracting); no fsync:
    # the copy lives only as long as this command.
    return extract_artifact(artifact, dest, _trust(trust), durable=False)


def cmd_predict(args: argparse.Namespace) -> int:
    """Verify, load (the smoke test is the warm-up, on the one session), predict, answer.

    Cold start is most of this command's time: verification runs beside the imports of
    onnxruntime and the runtime and the reading of the input, in a forked process when predict
    is the program (another core, no GIL shared: :mod:`device_agent.background`), on a thread
    when called in-process; nothing is verified or hashed twice, nothing is fsynced, and no
    module the answer does not need is imported (no MQTT, telemetry, HTTP or store;
    ``tests/test_cold_start.py``)."""
    with tempfile.TemporaryDirectory(prefix="edgepack-predict-") as tmp:
        # The verifier's modules load before the fork (numpy with them, which the answer needs
        # anyway; its OpenBLAS pool is shut down across fork by OpenBLAS's own atfork handler),
        # so the child only imports Ed25519 and walks the archive. Nothing of onnxruntime exists
        # yet: it is imported, and its thread pools made, after the fork.
        import edgepack_core.artifact  # noqa: F401
        from device_agent.background import beside

        verifying = beside(_extract_for_predict, args.artifact, Path(tmp) / "model", args.trust,
                           fork=getattr(args, "fork", False))
        try:
            data = _read_input(Path(args.input))
            import onnxruntime  # noqa: F401 - imported here, while the artifact is verified

            from device_agent.http.results import prediction_json
            from device_agent.runtime import InferenceService, load_model

            if isinstance(data, bytes) and Path(args.input).suffix.lower() in IMAGE_SUFFIXES:
                from PIL import Image  # and its common format plugins: the verification is still running

                Image.preinit()
        except BaseException:
            verifying.wait()  # the input's error is the one to report; the verifier still writes in tmp
            raise
        verified = verifying.result()
        model = load_model(verified.root, verified.manifest, profile=args.profile,
                           threads=args.threads)
        service = InferenceService(model)
        result = service.predict(data, content_type=input_media_type(Path(args.input)))
        answer = prediction_json(result, outputs=args.outputs == "raw" or None)
    import numpy as np

    from edgepack_core import wire_json

    if args.json:
        # Strict JSON by the agent's one convention (docs/agent.md, "Encoding of outputs").
        print(wire_json.dumps(answer).decode())
    else:
        print(f"{answer['model']['name']} {answer['model']['version']} on {answer['provider']} "
              f"({answer['latency_ms']} ms)")
        for fallback in answer["provider_fallbacks"]:
            print(f"  not using {fallback['provider']}: {fallback['reason']}")
        if answer.get("non_finite_outputs"):
            print(f"  NaN/inf in {', '.join(answer['non_finite_outputs'])} (the recipe allows it there)")
        print(json.dumps(wire_json.to_wire(answer["result"]), indent=2, allow_nan=False)
              if answer["result"] is not None else
              {k: np.asarray(v).shape for k, v in answer["outputs"].items()})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from edgepack_core.artifact import verify_artifact

    result = verify_artifact(args.artifact, _trust(args.trust))
    print(f"OK {args.artifact}: {result.manifest.name} {result.manifest.version}, "
          f"{len(result.manifest.files)} files verified, signed by key {result.key_id}")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from device_agent.runtime import load_model
    from device_agent.store import ModelStore

    store = ModelStore(Path(args.store), _trust(args.trust))
    store.recover()
    reports: list[Any] = []

    def smoke(model: Any) -> None:
        loaded = load_model(model.directory, model.verified.manifest, profile=args.profile, threads=args.threads)
        reports.append(loaded)

    installed = store.install(Path(args.artifact), force=args.force, smoke_test=smoke)
    loaded = reports[0]
    print(json.dumps({"installed": installed.to_json(), "provider": loaded.provider,
                      "provider_fallbacks": [{"provider": p, "reason": r} for p, r in loaded.fallbacks],
                      "smoke_test": loaded.smoke.to_json() if loaded.smoke else None}))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from device_agent.store import ModelStore

    trust = _trust(args.trust)
    status = ModelStore(_model_store(args), trust).status()
    named = {} if args.model else {name: ModelStore(path, trust).status() for name, path in _slot_stores(args)}
    if named:  # several named models: each one's store (docs/agent.md, "Several models")
        status["models"] = named
    if args.json:
        print(json.dumps(status))
        return 0
    for prefix, each in [("", status), *((f"{name}: ", each) for name, each in named.items())]:
        for role in ("active", "previous"):
            entry = each.get(role)
            text = "-" if not entry else (entry.get("error") or f"{entry['name']} {entry['version']}")
            print(f"{prefix}{role:<9} {text}")
        for entry in each["rejected"]:
            print(f"{prefix}rejected  {entry['name']} {entry['version']} at {entry['stage']}: {entry['reason']}")
    return 0


def _slot_stores(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """The stores of the named models under ``<store>/slots/`` (device_agent/models.py)."""
    from device_agent.models import SLOTS_DIR
    from edgepack_core.protocol.ids import is_valid_id

    slots = Path(args.store) / SLOTS_DIR
    return [(entry.name, entry) for entry in sorted(slots.iterdir()) if is_valid_id(entry.name) and entry.is_dir()] \
        if slots.is_dir() else []


def _model_store(args: argparse.Namespace) -> Path:
    """The store of ``--model NAME``: ``<store>/slots/NAME`` when the agent keeps it there, else
    the store root (which holds the first model of an agent without ``models:``)."""
    if not args.model:
        return Path(args.store)
    from device_agent.models import slot_directory

    try:
        slot = slot_directory(Path(args.store), args.model)
    except ValueError as err:
        raise UsageError(str(err)) from err
    return slot if slot.is_dir() else Path(args.store)


def cmd_rollback(args: argparse.Namespace) -> int:
    """Make the previous model active, but only once it has loaded and passed its smoke test
    on this device: a rollback to a model that cannot serve must leave state.json alone."""
    from device_agent.runtime import load_model
    from device_agent.store import ModelStore

    store = ModelStore(_model_store(args), _trust(args.trust))
    target = store.rollback_target()  # never a version this device rejected
    if args.model and target.name != args.model:
        raise UsageError(f"the store {store.root} holds {target.name}, not {args.model}")
    load_model(target.directory, target.verified.manifest, profile=args.profile, threads=args.threads)
    model = store.rollback()
    print(f"active: {model.name} {model.version}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from device_agent import logring
    from device_agent.config import load_config
    from device_agent.daemon import Daemon

    config = load_config(args.config)
    ring = logring.attach(config)  # records redacted before they are kept or printed
    try:
        _run_daemon(Daemon(config, log_ring=ring), config)  # reads the settings held from the fleet server
    finally:
        logring.detach(ring)
    return 0


def _run_daemon(daemon: Any, config: Any) -> None:
    """Start the daemon at the log level of its settings (the fleet server's may set it), after
    the warnings every start prints, and serve until a signal."""
    from device_agent.config import inline_password_warning, unauthenticated_commands_warning

    logging.getLogger().setLevel(getattr(logging, daemon.config.log_level.upper()))
    warnings = [inline_password_warning(config)]
    if daemon.operator_trust is None:
        warnings.append(unauthenticated_commands_warning(config))
    for warning in filter(None, warnings):  # on stderr whatever the log level, at every start
        print(f"edgepack-agent: warning: {warning}", file=sys.stderr, flush=True)
    daemon.run_until_signal()


def cmd_enroll(args: argparse.Namespace) -> int:
    from device_agent.enroll import cmd_enroll as enroll

    return enroll(args)


def cmd_pipeline_check(args: argparse.Namespace) -> int:
    """Every pipeline of the config parsed (schema, cross-field rules) and checked against the
    models the store holds; one line per pipeline, exit 1 at the first refusal."""
    from device_agent.config import load_config
    from device_agent.pipelines.checks import check_models
    from device_agent.pipelines.contracts import installed_contracts

    config = load_config(args.config)
    if not config.pipelines:
        print(f"{args.config}: no pipelines")
        return 0
    contracts = installed_contracts(config)
    for index, spec in enumerate(config.pipelines):
        check_models(spec, contracts, where=f"pipelines[{index}]")
        stages = " -> ".join(stage.stage_name for stage in spec.stages)
        print(f"{spec.name}: ok ({spec.source.kind} source, {stages}, {len(spec.rules)} rules, "
              f"{len(spec.sinks)} sinks)")
    return 0


def cmd_pipeline_schema(args: argparse.Namespace) -> int:
    from device_agent.pipelines.spec import pipeline_schema

    print(json.dumps(pipeline_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgepack-agent", description="The Edgepack device agent.")
    parser.add_argument("--version", action="version", version=f"edgepack-agent {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the agent daemon")
    run.add_argument("--config", required=True, help="agent.yaml")
    run.set_defaults(func=cmd_run)

    def trust(p: argparse.ArgumentParser) -> None:
        p.add_argument("--trust", action="append", required=True, help="trusted public key (repeatable)")

    def runtime(p: argparse.ArgumentParser) -> None:
        p.add_argument("--profile", default="x86", choices=sorted(PROFILES), help="device profile (default x86)")
        p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime default)")

    predict = sub.add_parser("predict", help="verify an artifact and run one inference")
    predict.add_argument("--artifact", required=True)
    trust(predict)
    predict.add_argument("--input", required=True, help="an image, a .npy (one input) or a .npz (named inputs)")
    predict.add_argument("--json", action="store_true", help="print one JSON object")
    predict.add_argument("--outputs", choices=["raw"],
                         help="raw: add the raw output tensors to the answer (default: only without a task result)")
    runtime(predict)
    predict.set_defaults(func=cmd_predict)

    verify = sub.add_parser("verify", help="verify an artifact's signature and hashes")
    verify.add_argument("--artifact", required=True)
    trust(verify)
    verify.set_defaults(func=cmd_verify)

    install = sub.add_parser("install", help="install an artifact into a store (smoke test, then activate)")
    install.add_argument("--store", required=True)
    install.add_argument("--artifact", required=True)
    trust(install)
    install.add_argument("--force", action="store_true", help="allow a downgrade or reinstall")
    runtime(install)
    install.set_defaults(func=cmd_install)

    status = sub.add_parser("status", help="show the store's active and previous models")
    status.add_argument("--store", required=True)
    trust(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--model", metavar="NAME", help="only this model's store (several named models)")
    status.set_defaults(func=cmd_status)

    rollback = sub.add_parser("rollback", help="make the previous model active again")
    rollback.add_argument("--store", required=True)
    trust(rollback)
    runtime(rollback)
    rollback.add_argument("--model", metavar="NAME", help="the model to roll back (several named models)")
    rollback.set_defaults(func=cmd_rollback)

    enroll = sub.add_parser("enroll", help="get this device's certificate from the fleet server (key made here)")
    enroll.add_argument("--server", required=True, help="the fleet server's URL, e.g. https://fleet.example:8760")
    enroll.add_argument("--token", required=True, help="the one-time token edgepack fleet enroll printed")
    enroll.add_argument("--config", required=True, help="agent.yaml to update (comments are not kept)")
    enroll.add_argument("--ca", help="CA certificate of the fleet server's HTTPS certificate (a private CA)")
    enroll.add_argument("--device-id", help="the device id the token was made for (default: agent.yaml's)")
    enroll.set_defaults(func=cmd_enroll)
    pipeline = sub.add_parser("pipeline", help="pipelines (streams): check a config's, print the schema")
    pipeline_sub = pipeline.add_subparsers(dest="pipeline_command", required=True)
    check = pipeline_sub.add_parser("check", help="validate agent.yaml's pipelines against the installed models, "
                                    "without running them")
    check.add_argument("--config", required=True, help="agent.yaml")
    check.set_defaults(func=cmd_pipeline_check)
    schema = pipeline_sub.add_parser("schema", help="print the JSON Schema of one pipeline")
    schema.set_defaults(func=cmd_pipeline_schema)

    from device_agent.system_files import add_commands  # files, install-unit: the shipped unit and schemas

    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code.

    ``predict`` is one-shot, so two costs of a long-lived process are skipped (measured on the
    2-core development machine, BENCHMARKS.md "Cold start"): the garbage collector is paused
    for the command (the ~60,000 objects numpy, onnxruntime and the agent's modules create at
    import would be traversed over and over, for nothing: ~10-25 ms), and run as the program
    itself (``argv`` None: the console script, ``python -m device_agent.cli``) the process ends
    with ``os._exit`` once its output is flushed, skipping the interpreter's teardown of every
    module and of onnxruntime (~50 ms). By then the temporary extraction is removed and the
    verifying thread has finished: nothing is left to clean up. Called with ``argv`` (tests,
    embedding), ``main`` returns as usual and the collector runs again.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        logging.getLogger().setLevel(logging.INFO)
    one_shot = args.command == "predict" and gc.isenabled()
    # Fork the verification only as the program: no thread exists yet (tests and embedders
    # may have some), and the os._exit below ends this process the same way either side.
    args.fork = one_shot and argv is None and hasattr(os, "fork")
    if one_shot:
        gc.disable()
    try:
        code = _run_command(args)
    finally:
        if one_shot:
            gc.enable()
    if one_shot and argv is None:
        _exit_now(code)
    return code


def _run_command(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except EdgepackError as err:
        print(f"edgepack-agent: error: {err}", file=sys.stderr)
        for line in cause_chain(err) if args.verbose else ():
            print(f"edgepack-agent:   {line}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("edgepack-agent: interrupted", file=sys.stderr)
        return 130


def _exit_now(code: int) -> None:
    """End the process now: output flushed, logging shut down, no interpreter teardown."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
