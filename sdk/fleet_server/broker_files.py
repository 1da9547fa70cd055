"""The broker's files the fleet server generates: the ACL, the CRL and the password file.

Groups are held by the server (``device_groups``), so the broker's group permissions follow from
it: the ACL is the shipped ``deploy/mosquitto/acl`` (its ``%u`` patterns and the operator section,
unchanged) plus one ``user`` section per device listing the group command topics it may read:
the ACL file as installed (or ``--broker-acl-base``) is the base, read once at start, of which
everything is kept but the sections that only grant group command topics (the shipped
examples, or what the server wrote before), so a line added to the shipped ACL is never lost.
Devices enrolled with ``--password`` get a line in a generated mosquitto password file (the
lines of an operator-kept base file first, e.g. the operator accounts made with
``mosquitto_passwd``). Each file is written atomically and only when its bytes change; then the
optional reload command runs (mosquitto re-reads the ACL and password files on SIGHUP; see
docs/enrollment.md for the CRL).

The renderings (:func:`acl_text`, :func:`password_entry`) are pure.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.topics import DEFAULT_ROOT
from sdk.errors import ServerConfigError

log = logging.getLogger("edgepack.fleet_server.broker_files")

PBKDF2_ITERATIONS = 101
"""mosquitto_passwd's default. The passwords the server makes are 256 random bits: no amount of
stretching changes what guessing one costs, and the broker pays it at every login."""
SALT_BYTES = 12
MAX_BASE_BYTES = 1024 * 1024
RELOAD_TIMEOUT_S = 30.0

GENERATED = "# edgepack fleet serve:"
"""The prefix of the header lines the server writes (dropped when the file is read back as its base)."""


def _membership(user_lines: list[str], root: str) -> bool:
    """Whether a ``user`` section only grants group command topics: what the server writes."""
    topics = [line for line in user_lines if line.startswith("topic ")]
    return bool(topics) and all(
        re.fullmatch(rf"topic read {re.escape(root)}/grp/[^/#+\s]+/cmd", line) for line in topics
    )


def acl_base(text: str, root: str = DEFAULT_ROOT) -> list[str]:
    """The lines of an ACL the server keeps: everything but its own header and the ``user`` and
    ``topic`` lines of the sections that only grant group command topics (the shipped file's
    examples, or what the server wrote before). The ``%u`` patterns, the operator sections and
    whatever else an operator added stay as they are, in their order. Pure."""
    kept: list[str] = []
    section: list[str] = []  # the user section being read, held until its end shows what it is
    for raw in [*text.splitlines(), None]:  # None closes the last section
        line = "user" if raw is None else raw.strip()
        if line.startswith(GENERATED):
            continue
        if line == "user" or line.startswith(("user ", "pattern ")):
            drop = _membership(section, root)
            kept += [kept_line for kept_line in section if not (drop and kept_line.startswith(("user ", "topic ")))]
            section = [line] if line.startswith("user ") else []
            if line.startswith("pattern "):
                kept.append(line)
        else:
            (section if section else kept).append(line)
    return _squeeze(kept)


def _squeeze(lines: list[str]) -> list[str]:
    """No run of blank lines, none at the end."""
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def acl_text(base: list[str], groups: Mapping[str, Sequence[str]], root: str = DEFAULT_ROOT) -> str:
    """The whole ACL file: a header, the base's lines (:func:`acl_base`), then a ``user``
    section per device with groups (sorted, so equal inputs give equal bytes). Pure."""
    lines = [
        f"{GENERATED} this file is rewritten from the groups the fleet server holds (docs/enrollment.md);",
        f"{GENERATED} edit anything but the group sections, it is kept.",
        *base,
    ]
    for device in sorted(groups):
        if groups[device]:
            lines += ["", f"user {device}", *(f"topic read {root}/grp/{g}/cmd" for g in sorted(set(groups[device])))]
    return "\n".join(lines) + "\n"


def password_entry(password: str, salt: bytes, iterations: int = PBKDF2_ITERATIONS) -> str:
    """mosquitto's ``$7$`` hash of ``password`` (PBKDF2-HMAC-SHA512, 64 bytes, as
    mosquitto_passwd writes it: ``$7$ITERATIONS$base64(salt)$base64(hash)``). Pure."""
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def password_text(base: str, entries: Mapping[str, str]) -> str:
    """The password file: the base file's lines (its own lines for an enrolled device's name
    dropped: the server's entry wins), then ``device:entry`` per device. Pure."""
    kept = [line for line in base.splitlines() if line.strip() and line.partition(":")[0] not in entries]
    return "\n".join([*kept, *(f"{device}:{entries[device]}" for device in sorted(entries))]) + "\n"


def _read_bounded(path: Path) -> str:
    with open(path, "rb") as handle:
        data = handle.read(MAX_BASE_BYTES + 1)
    if len(data) > MAX_BASE_BYTES:
        raise ServerConfigError(f"{path} is over {MAX_BASE_BYTES} bytes")
    return data.decode("utf-8", "replace")


@dataclass
class BrokerFiles:
    """Where the generated files go (None: not generated) and how the broker is told."""

    acl: Path | None = None
    acl_base: Path | None = None  # default: the ACL file as it is at start (deploy/mosquitto/acl installed there)
    crl: Path | None = None
    passwords: Path | None = None
    password_base: Path | None = None
    reload_command: str | None = None
    root: str = DEFAULT_ROOT
    _written: dict[Path, bytes] = field(default_factory=dict, repr=False)
    _base: list[str] | None = field(default=None, repr=False)
    written_for: dict[Path, str] = field(default_factory=dict, repr=False)  # what a file's bytes were made from

    def acl_base_lines(self) -> list[str]:
        """The base of the ACL (read once): ``acl_base``, else the ACL file as it was."""
        if self._base is None:
            source = self.acl_base or self.acl
            assert source is not None
            try:
                text = _read_bounded(source)
            except OSError as err:
                raise ServerConfigError(
                    f"cannot read the broker ACL {source} ({err.strerror or err}): install "
                    "deploy/mosquitto/acl there first, or give --broker-acl-base"
                ) from err
            self._base = acl_base(text, self.root)
        return self._base

    def base_passwords(self) -> str:
        if self.password_base is None:
            return ""
        try:
            return _read_bounded(self.password_base)
        except OSError as err:
            raise ServerConfigError(
                f"cannot read --broker-password-base {self.password_base}: {err.strerror or err}"
            ) from err

    def write(self, path: Path | None, data: bytes, mode: int) -> bool:
        """Write ``data`` to ``path`` atomically unless it already holds exactly it."""
        if path is None or self._written.get(path) == data:
            return False
        try:
            if path.read_bytes() == data:
                self._written[path] = data
                return False
        except OSError:
            pass
        atomic_write(path, data, mode=mode)
        self._written[path] = data
        log.info("wrote %s", path)
        return True

    def reload(self) -> None:
        """Run the reload command (e.g. ``systemctl reload mosquitto``); a failure is logged:
        the files are written and the next change, or the operator, reloads."""
        if not self.reload_command:
            return
        try:
            done = subprocess.run(
                shlex.split(self.reload_command),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=RELOAD_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            log.error("--broker-reload-command failed: %s", err)
            return
        if done.returncode != 0:
            log.error(
                "--broker-reload-command exited with %d: %s",
                done.returncode,
                done.stderr.decode(errors="replace").strip()[:300],
            )
