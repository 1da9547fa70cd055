"""The files a device needs besides the code: the systemd unit, its GPU drop-in, the JSON Schemas.

They ship inside the installed package (``device_agent/systemd/``,
``edgepack_core/protocol/schemas/``), so a device installed with ``pip install edgepack-agent``
has them without a checkout. ``edgepack-agent files`` prints where they are;
``edgepack-agent install-unit`` writes the unit into /etc/systemd/system with ``ExecStart``
pointing at the agent of the installation that runs it (the shipped file assumes
/opt/edgepack/venv). Only the standard library is imported at module level: the CLI builds its
parser from here on every start.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from device_agent.errors import AgentError
from edgepack_core.errors import UsageError
from edgepack_core.fsutil import atomic_write

UNIT_NAME = "edgepack-agent.service"
GPU_DROPIN_NAME = "gpu.conf"
SYSTEMD_DIR = Path(__file__).resolve().parent / "systemd"
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
# The unit's ProtectHome=yes hides these from the service: an agent installed there cannot start.
HIDDEN_BY_PROTECT_HOME = ("/home", "/root", "/run/user")
# A path systemd takes as one ExecStart word without quoting or escaping (no space, quote, %, $, \).
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._+@/-]*")


def shipped_files() -> dict[str, Path]:
    """Name -> installed path of every file a device installation needs besides the code."""
    from edgepack_core.protocol.payloads import KINDS, schema_path

    files = {"systemd-unit": SYSTEMD_DIR / UNIT_NAME, "systemd-gpu-dropin": SYSTEMD_DIR / GPU_DROPIN_NAME}
    files.update({f"schema-{kind}": schema_path(kind) for kind in KINDS})
    return files


def _present(files: dict[str, Path]) -> dict[str, Path]:
    missing = [f"{name} ({path})" for name, path in files.items() if not path.is_file()]
    if missing:
        raise AgentError(f"this installation lacks {', '.join(missing)}: reinstall edgepack-agent")
    return files


def check_exec_path(executable: str) -> str:
    """``executable`` if the unit can run it, else an AgentError saying why (a pure rule)."""
    if not _PLAIN_PATH.fullmatch(executable):
        raise AgentError(f"the agent's path {executable!r} is not an absolute path of plain characters "
                         "(no space, quote, %, $ or backslash) that a unit's ExecStart takes as is; "
                         "install the agent under /opt/edgepack/venv")
    for hidden in HIDDEN_BY_PROTECT_HOME:
        if executable == hidden or executable.startswith(hidden + "/"):
            raise AgentError(f"the agent lies under {hidden}, which the unit's ProtectHome=yes hides from the "
                             f"service ({executable}); install it under /opt/edgepack/venv (docs/agent.md)")
    return executable


def render_unit(template: str, executable: str) -> str:
    """The unit ``template`` with its one ExecStart running ``executable`` (its arguments kept)."""
    lines = template.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
    if len(starts) != 1:
        raise AgentError(f"the shipped unit has {len(starts)} ExecStart= lines, expected 1")
    line = lines[starts[0]]
    _program, _, arguments = line[len("ExecStart="):].partition(" ")
    lines[starts[0]] = f"ExecStart={check_exec_path(executable)} {arguments}" if arguments \
        else f"ExecStart={check_exec_path(executable)}\n"
    return "".join(lines)


def this_agent() -> str:
    """The ``edgepack-agent`` script of the installation this Python runs (its venv's bin/)."""
    script = Path(sys.executable).parent / "edgepack-agent"
    if not script.is_file():
        raise AgentError(f"no edgepack-agent beside {sys.executable}: run install-unit with the agent the unit "
                         "should start (e.g. /opt/edgepack/venv/bin/edgepack-agent install-unit)")
    return str(script)


def unit_plan(dest: Path, executable: str, *, gpu: bool) -> list[tuple[Path, str]]:
    """What install-unit writes: (path, text) for the unit and, with ``gpu``, its drop-in."""
    files = _present(shipped_files())
    plan = [(dest / UNIT_NAME, render_unit(files["systemd-unit"].read_text(encoding="utf-8"), executable))]
    if gpu:
        plan.append((dest / f"{UNIT_NAME}.d" / GPU_DROPIN_NAME,
                     files["systemd-gpu-dropin"].read_text(encoding="utf-8")))
    return plan


def install_unit(plan: list[tuple[Path, str]], *, force: bool) -> list[tuple[Path, bool]]:
    """Write each planned file atomically (mode 0644); (path, changed) for each.

    Every file is checked before any is written: one that exists with other contents (a local
    edit) stops the install unless ``force``, and nothing is touched."""
    differing = [path for path, text in plan if path.is_file() and path.read_text(encoding="utf-8") != text]
    if differing and not force:
        raise AgentError(f"{differing[0]} exists and differs from the shipped file (a local edit?); "
                         "--force replaces it, or put local changes in a drop-in")
    results = []
    for path, text in plan:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            results.append((path, False))
            continue
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            atomic_write(path, text.encode("utf-8"), mode=0o644)
        except OSError as err:
            raise AgentError(f"cannot write {path}: {err.strerror or err} (run it with sudo)") from err
        results.append((path, True))
    return results


def cmd_files(args: argparse.Namespace) -> int:
    files = _present(shipped_files())
    if args.name is not None:
        if args.name not in files:
            raise UsageError(f"no shipped file {args.name!r} (known: {', '.join(files)})")
        print(files[args.name])
    elif args.json:
        print(json.dumps({name: str(path) for name, path in files.items()}, indent=2))
    else:
        width = max(map(len, files))
        for name, path in files.items():
            print(f"{name:<{width}}  {path}")
    return 0


def cmd_install_unit(args: argparse.Namespace) -> int:
    plan = unit_plan(Path(args.dest), this_agent(), gpu=args.gpu)
    if args.print:
        print("\n".join(text for _path, text in plan), end="")
        return 0
    for path, changed in install_unit(plan, force=args.force):
        print(f"{'wrote' if changed else 'unchanged'} {path}")
    print("next: systemctl daemon-reload && systemctl enable --now edgepack-agent")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``files`` and ``install-unit`` on the edgepack-agent parser."""
    files = sub.add_parser("files", help="where the installed package keeps its systemd unit, GPU drop-in and "
                                         "JSON Schemas")
    files.add_argument("name", nargs="?", help="print only this file's path (systemd-unit, systemd-gpu-dropin, "
                                               "schema-cmd, ...)")
    files.add_argument("--json", action="store_true", help="one JSON object, name -> path")
    files.set_defaults(func=cmd_files)

    unit = sub.add_parser("install-unit", help="write the systemd unit, ExecStart pointing at this installation")
    unit.add_argument("--dest", default=str(DEFAULT_UNIT_DIR), help=f"unit folder (default {DEFAULT_UNIT_DIR})")
    unit.add_argument("--gpu", action="store_true", help=f"also the GPU drop-in ({UNIT_NAME}.d/{GPU_DROPIN_NAME})")
    unit.add_argument("--print", action="store_true", help="print what it would write, write nothing")
    unit.add_argument("--force", action="store_true", help="replace a file that differs (a local edit)")
    unit.set_defaults(func=cmd_install_unit)
