"""Check that a device install of edgepack-agent stands alone. Run it with the device venv's Python.

    /opt/edgepack-venv/bin/python tools/device_install_check.py

The venv must hold `pip install edgepack-agent` (a wheel of distributions/edgepack-agent) and
nothing of the host: no `sdk` package, no `edgepack` command, no onnx, click or other host-only
distribution (click is not even installed: the agent's HTTP server, Hypercorn, does not bring it
as uvicorn would), and importing the agent loads no onnx, click or sdk. The systemd unit, its GPU
drop-in and the protocol's JSON Schemas must be files inside the installed package, where
`edgepack-agent files` says they are, and `edgepack-agent run` must serve its HTTP API and stop
on SIGTERM. One PASS/FAIL line per check; exit 1 on any failure. Standard library only: it runs
where only the device's dependencies are installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# Distributions only the host brings (click: its command line, and uvicorn's; uvicorn: the fleet
# server's). Not sympy: older onnxruntime releases require it themselves (1.16 does).
HOST_ONLY = {"onnx", "click", "uvicorn", "scikit-learn", "torch", "onnxscript", "sqlalchemy", "alembic", "psycopg"}
SHIPPED = {"systemd-unit", "systemd-gpu-dropin", "schema-cmd", "schema-events", "schema-job", "schema-logs",
           "schema-state", "schema-telemetry", "schema-xfer"}
_IMPORT_PROBE = """
import sys
import device_agent.cli, device_agent.daemon, device_agent.updates.service
print(",".join(sorted({m.split(".")[0] for m in sys.modules} & {"onnx", "click", "sdk", "sklearn", "torch"})))
"""
# A trusted key for the `run` check (the agent refuses to start without one): cryptography is a
# device dependency, so the device venv can make one.
_PUBLIC_KEY = """
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
key = Ed25519PrivateKey.generate().public_key()
print(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode(), end="")
"""


def _run(*command: str) -> subprocess.CompletedProcess:
    """A command run from / without PYTHONPATH, so a checkout in the current folder cannot stand in
    for the installed package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(command, capture_output=True, text=True, cwd="/", env=env)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _run_serves(agent: Path) -> str:
    """Start ``edgepack-agent run`` without a model on a free port; "" when it served
    ``/v2/health/live`` (200) and ``/healthz`` (503, no model) and stopped on SIGTERM with exit 0,
    else what went wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        made = _run(sys.executable, "-c", _PUBLIC_KEY)
        if made.returncode != 0:
            return f"no key: {(made.stderr.strip().splitlines() or ['?'])[-1]}"
        (folder / "trust.pub").write_text(made.stdout)
        port = _free_port()
        (folder / "agent.yaml").write_text(f"device_id: install-check\nstore: {folder / 'store'}\n"
                                           f"trust: [{folder / 'trust.pub'}]\napi: {{listen: '127.0.0.1:{port}'}}\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen([str(agent), "run", "--config", str(folder / "agent.yaml")], cwd="/", env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            live = (0, b"")
            deadline = time.monotonic() + 60
            while live[0] != 200 and proc.poll() is None and time.monotonic() < deadline:
                try:
                    live = _get(f"http://127.0.0.1:{port}/v2/health/live")
                except OSError:
                    time.sleep(0.2)
            health = _get(f"http://127.0.0.1:{port}/healthz") if live[0] == 200 else (0, b"")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
        finally:
            proc.kill()
            stderr = proc.communicate()[1]
    if live[0] != 200:
        return f"GET /v2/health/live never answered 200: {(stderr.strip().splitlines() or ['?'])[-1]}"
    if health[0] != 503 or json.loads(health[1]).get("status") != "no model":
        return f"GET /healthz answered {health[0]} {health[1][:100]!r}"
    if code != 0 or "Traceback" in stderr:
        return f"exit {code} on SIGTERM: {(stderr.strip().splitlines() or ['?'])[-1]}"
    return ""


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
    _check("click" not in names, "click is not installed (pip show click finds nothing)", failures)
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
    problem = _run_serves(bin_dir / "edgepack-agent")
    _check(not problem, "edgepack-agent run serves HTTP (/v2/health/live 200, /healthz 503 without a model) and "
           f"stops on SIGTERM{': ' + problem if problem else ''}", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
