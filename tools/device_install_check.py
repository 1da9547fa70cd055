"""Check that a device install of edgepack-agent stands alone. Run it with the device venv's Python.

    /opt/edgepack-venv/bin/python tools/device_install_check.py

The venv must hold `pip install edgepack-agent` (a wheel of distributions/edgepack-agent) and
nothing of the host: no `sdk` package, no `edgepack` command, no onnx or other host-only
distribution, and importing the agent loads no onnx, click or sdk. The systemd unit, its GPU drop-in and
the protocol's JSON Schemas must be files inside the installed package, where
`edgepack-agent files` says they are. One PASS/FAIL line per check; exit 1 on any failure.
Standard library only: it runs where only the device's dependencies are installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

# Distributions only the host brings. Not sympy: older onnxruntime releases require it themselves
# (1.16 does); not click: uvicorn requires it, though the agent never imports it (the probe below).
HOST_ONLY = {"onnx", "scikit-learn", "torch", "onnxscript", "sqlalchemy", "alembic", "psycopg"}
SHIPPED = {"systemd-unit", "systemd-gpu-dropin", "schema-cmd", "schema-job", "schema-state", "schema-telemetry",
           "schema-xfer"}
_IMPORT_PROBE = """
import sys
import device_agent.cli, device_agent.daemon, device_agent.updates.service
print(",".join(sorted({m.split(".")[0] for m in sys.modules} & {"onnx", "click", "sdk", "sklearn", "torch"})))
"""


def _run(*command: str) -> subprocess.CompletedProcess:
    """A command run from / without PYTHONPATH, so a checkout in the current folder cannot stand in
    for the installed package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(command, capture_output=True, text=True, cwd="/", env=env)


def _check(ok: bool, what: str, failures: list[str]) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def main() -> int:
    failures: list[str] = []
    bin_dir = Path(sys.executable).parent
    site = Path(sysconfig.get_paths()["purelib"]).resolve()

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
    _check("edgepack-agent" in names and "edgepack" not in names,
           "the device venv holds the edgepack-agent distribution and not the host's edgepack", failures)
    heavy = sorted(names & HOST_ONLY)
    _check(not heavy, f"no host-only distribution installed{': ' + ', '.join(heavy) if heavy else ''}", failures)
    found = _run(sys.executable, "-c", "import sdk")
    _check(found.returncode != 0 and "No module named 'sdk'" in found.stderr, "import sdk fails: no host code",
           failures)
    _check(not (bin_dir / "edgepack").exists() and (bin_dir / "edgepack-agent").is_file(),
           f"{bin_dir} has edgepack-agent and no edgepack command", failures)
    loaded = _run(sys.executable, "-c", _IMPORT_PROBE)
    problem = loaded.stdout.strip() if loaded.returncode == 0 else (loaded.stderr.strip().splitlines() or ["?"])[-1]
    _check(loaded.returncode == 0 and problem == "",
           f"importing the agent works and loads no onnx, click or sdk{': ' + problem if problem else ''}", failures)

    listed = _run(str(bin_dir / "edgepack-agent"), "files", "--json")
    files = json.loads(listed.stdout) if listed.returncode == 0 else {}
    _check(set(files) == SHIPPED, f"edgepack-agent files lists {', '.join(sorted(files)) or listed.stderr.strip()}",
           failures)
    outside = [name for name, path in files.items()
               if not (Path(path).is_file() and Path(path).resolve().is_relative_to(site))]
    _check(bool(files) and not outside,
           f"the unit, GPU drop-in and schemas are files in {site}{': not ' + ', '.join(outside) if outside else ''}",
           failures)
    unit = _run(str(bin_dir / "edgepack-agent"), "install-unit", "--print")
    _check(f"ExecStart={bin_dir / 'edgepack-agent'} run --config" in unit.stdout,
           "install-unit --print points ExecStart at this venv's agent", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
