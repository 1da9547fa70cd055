"""The device side stays light: importing every device module never loads onnx, click or sdk."""

from __future__ import annotations

import re
import subprocess
import sys

_PROBE = r"""
import importlib, pkgutil, sys
import device_agent, edgepack_core
names = []
for package in (device_agent, edgepack_core):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"onnx", "click", "sdk", "sklearn", "torch"})
print(len(names), ",".join(heavy))
"""


def test_device_modules_import_no_host_only_packages():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout.split()
    count = int(out[0])
    heavy = out[1] if len(out) > 1 else ""
    assert count >= 5, "expected to import the device and core modules"
    assert heavy == "", f"device side imported host-only modules: {heavy}"


_HOST_PROBE = r"""
import sys
import sdk.cli, sdk.deploy, sdk.fleet, sdk.broker
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] == "device_agent")))
"""


def test_host_modules_import_nothing_from_device_agent():
    """The host reaches the protocol and the MQTT client through edgepack_core, never through the agent."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    offenders = []
    for path in sorted((root / "sdk").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] == "device_agent"]
    assert offenders == [], "sdk/ imports device_agent:\n" + "\n".join(offenders)
    loaded = subprocess.run([sys.executable, "-c", _HOST_PROBE], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "", f"importing the host CLI loaded device modules: {loaded}"


def _wheel_text(wheel, suffix: str) -> str:
    return wheel.read(next(name for name in wheel.namelist() if name.endswith(suffix))).decode()


def test_the_device_distribution_holds_no_host_code(tmp_path):
    """`pip install edgepack-agent` puts edgepack_core/ and device_agent/ on a device, never sdk/; the
    host distribution holds sdk/ alone and pins the device one at its own version (no file in both)."""
    import zipfile

    import edgepack_core
    from tools.build_wheels import build_wheels

    agent_path, host_path = build_wheels(tmp_path, ["agent", "host"], isolation=False)
    with zipfile.ZipFile(agent_path) as agent, zipfile.ZipFile(host_path) as host:
        agent_files = {n for n in agent.namelist() if ".dist-info/" not in n}
        host_files = {n for n in host.namelist() if ".dist-info/" not in n}
        agent_meta, host_meta = _wheel_text(agent, "METADATA"), _wheel_text(host, "METADATA")
        agent_scripts = _wheel_text(agent, "entry_points.txt")
    assert {n.split("/")[0] for n in agent_files} == {"edgepack_core", "device_agent"}
    assert {n.split("/")[0] for n in host_files} == {"sdk"}
    assert {"device_agent/systemd/edgepack-agent.service", "device_agent/systemd/gpu.conf",
            *(f"edgepack_core/protocol/schemas/{k}.schema.json" for k in ("cmd", "job", "state", "telemetry", "xfer"))
            } <= agent_files
    assert "edgepack-agent = device_agent.cli:main" in agent_scripts and "sdk" not in agent_scripts
    requires = [line.split(":", 1)[1].strip() for line in agent_meta.splitlines() if line.startswith("Requires-Dist:")]
    heavy = [r for r in requires if re.match(r"[A-Za-z0-9._-]+", r).group().lower()
             in {"onnx", "click", "scikit-learn", "sympy", "torch", "sqlalchemy", "alembic", "psycopg"}]
    assert requires and heavy == [], f"the device installs host-only packages: {heavy}"
    version = edgepack_core.__version__
    assert f"\nVersion: {version}\n" in agent_meta and f"\nVersion: {version}\n" in host_meta
    assert f"Requires-Dist: edgepack-agent=={version}\n" in host_meta, "the host pins the device distribution"
