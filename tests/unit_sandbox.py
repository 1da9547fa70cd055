"""Run a program under the seccomp filters the shipped systemd unit asks for, without systemd.

There is no service manager in a test container, so ``systemctl start`` cannot show that the
agent survives its unit. The risky restrictions are the kernel-enforced ones on what the
process itself does: ``SystemCallFilter=`` (with ``SystemCallErrorNumber=``),
``MemoryDenyWriteExecute=`` and ``RestrictAddressFamilies=``. This module reads them from the
unit file, expands the syscall groups with ``systemd-analyze syscall-filter`` (the same table
systemd uses), and installs the same three kinds of filter systemd installs, through libseccomp
(the library systemd links), before exec'ing the program, as systemd does just before it
execs ExecStart. Namespaces (ProtectSystem=, PrivateDevices=, ...) are not reproduced: they
need a service manager, and the agent only writes its store, which tests point elsewhere.

    python tests/unit_sandbox.py SPEC.json PROGRAM [ARGS...]     (SPEC from :func:`filter_spec`)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

# libseccomp's constants (seccomp.h).
_ALLOW = 0x7FFF0000
_CMP_EQ = 4
_CMP_MASKED_EQ = 7
_PROT_WRITE, _PROT_EXEC = 0x2, 0x4
_SHM_EXEC = 0o100000
_AF_MAX = 46


def unit_settings(text: str) -> dict[str, list[str]]:
    """Every assignment of the [Service] section, in order, each key's values as a list."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@cache
def expand_syscalls(group: str) -> frozenset[str]:
    """The system calls of ``@group`` (recursively), as this machine's systemd defines them."""
    listing = subprocess.run(["systemd-analyze", "syscall-filter", group], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    names: set[str] = set()
    for line in listing[1:]:
        word = line.strip()
        if word and not word.startswith("#"):
            names |= expand_syscalls(word) if word.startswith("@") else {word}
    return frozenset(names)


def filter_spec(unit_text: str) -> dict[str, Any]:
    """The unit's process restrictions as plain data: allowed syscalls, errno, W^X, socket families."""
    settings = unit_settings(unit_text)
    allowed: set[str] = set()
    for index, line in enumerate(settings.get("SystemCallFilter", [])):
        deny = line.startswith("~")
        if index == 0 and deny:
            raise ValueError("the unit's first SystemCallFilter= is a deny list; this sandbox expects an allow list")
        words = line.lstrip("~").split()
        names = set().union(*(expand_syscalls(w) if w.startswith("@") else {w} for w in words))
        allowed = allowed - names if deny else allowed | names
    error = settings.get("SystemCallErrorNumber", ["EPERM"])[-1]
    families = settings.get("RestrictAddressFamilies", [""])[-1].split()
    return {"allow": sorted(allowed), "errno": getattr(errno, error),
            "mdwe": settings.get("MemoryDenyWriteExecute", ["no"])[-1] in ("yes", "true", "1", "on"),
            "families": sorted(int(getattr(socket, name)) for name in families)}


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise OSError("libseccomp is not installed (Debian: libseccomp2, a dependency of systemd)")
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_Arg)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return lib


class _Filter:
    def __init__(self, lib: ctypes.CDLL, default_action: int) -> None:
        self.lib = lib
        self.ctx = lib.seccomp_init(default_action)

    def rule(self, action: int, syscall: str, *conditions: tuple[int, int, int, int]) -> None:
        number = self.lib.seccomp_syscall_resolve_name(syscall.encode())
        if number < 0:
            return  # not a system call of this architecture (systemd skips those too)
        args = (_Arg * len(conditions))(*(_Arg(*c) for c in conditions)) if conditions else None
        result = self.lib.seccomp_rule_add_array(self.ctx, action, number, len(conditions), args)
        if result != 0:
            raise OSError(-result, f"seccomp rule for {syscall}: {os.strerror(-result)}")

    def load(self) -> None:
        result = self.lib.seccomp_load(self.ctx)
        self.lib.seccomp_release(self.ctx)
        if result != 0:
            raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


def _errno_action(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


def apply(spec: dict[str, Any]) -> None:
    """Install the filters of ``spec`` on this process (and everything it execs) for good."""
    lib = _libseccomp()
    if spec["mdwe"]:  # MemoryDenyWriteExecute=: systemd's seccomp rules, refused with EPERM
        wx = _Filter(lib, _ALLOW)
        refuse = _errno_action(errno.EPERM)
        wx.rule(refuse, "mmap", (2, _CMP_MASKED_EQ, _PROT_WRITE | _PROT_EXEC, _PROT_WRITE | _PROT_EXEC))
        wx.rule(refuse, "mprotect", (2, _CMP_MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
        wx.rule(refuse, "pkey_mprotect", (2, _CMP_MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
        wx.rule(refuse, "shmat", (2, _CMP_MASKED_EQ, _SHM_EXEC, _SHM_EXEC))
        wx.load()
    if spec["families"]:  # RestrictAddressFamilies=: other families fail with EAFNOSUPPORT
        sockets = _Filter(lib, _ALLOW)
        for family in range(_AF_MAX + 1):
            if family not in spec["families"]:
                sockets.rule(_errno_action(errno.EAFNOSUPPORT), "socket", (0, _CMP_EQ, family, 0))
        sockets.load()
    # SystemCallFilter=, an allow list, last: seccomp() itself may not be on it.
    calls = _Filter(lib, _errno_action(spec["errno"]))
    for name in spec["allow"]:
        calls.rule(_ALLOW, name)
    calls.load()


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    apply(spec)
    os.execv(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
