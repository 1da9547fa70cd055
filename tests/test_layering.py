"""The device side stays light: importing every device module never loads onnx, click or sdk."""

from __future__ import annotations

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
