"""``mqtt.password_file``: the broker password read from a file only its owner can read."""

from __future__ import annotations

from pathlib import Path

from device_agent.errors import ConfigError

MAX_PASSWORD_FILE_BYTES = 4096


def read_password_file(path: Path, name: str) -> str:
    """The first line of ``mqtt.password_file``, refusing a file others can read (mode & 077,
    like the fleet server's token file): the password must not sit where any user can copy it."""
    try:
        mode = path.stat().st_mode
        with open(path, "rb") as handle:
            data = handle.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError("mqtt.password_file", f"cannot read {path}: {err.strerror or err}", config=name) from err
    if mode & 0o077:
        raise ConfigError("mqtt.password_file", f"{path} is readable by others (mode {mode & 0o777:o}); chmod 600 it",
                          config=name)
    if len(data) > MAX_PASSWORD_FILE_BYTES:
        raise ConfigError("mqtt.password_file", f"{path} is over {MAX_PASSWORD_FILE_BYTES} bytes", config=name)
    try:
        password = data.decode("utf-8").splitlines()[0].strip() if data.strip() else ""
    except UnicodeDecodeError as err:
        raise ConfigError("mqtt.password_file", f"{path} is not UTF-8 text", config=name) from err
    if not password:
        raise ConfigError("mqtt.password_file", f"{path} holds no password (its first line is empty)", config=name)
    return password
