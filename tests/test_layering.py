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
