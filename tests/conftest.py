"""Shared fixtures: keys, demo models built once per session, and the real mosquitto broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdk.keys import write_keypair

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def cli(name: str) -> str:
    """Path of a console script of this environment (``edgepack`` / ``edgepack-agent``)."""
    path = BIN / name
    return str(path) if path.exists() else name


def run_cli(*args: str, check: bool = False, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run an Edgepack CLI as a real subprocess, capturing text output."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([cli(args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                          check=check, env=env, stdin=subprocess.DEVNULL, **kwargs)


@pytest.fixture(scope="session")
def keypair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("keys")
    private, public = folder / "release.key", folder / "release.pub"
    write_keypair(private, public)
    return private, public


# The real mosquitto broker fixture (function scope), shared by the MQTT tests.
from tests.broker import mosquitto_broker  # noqa: E402,F401


@pytest.fixture(scope="module")
def server_keys(tmp_path_factory, keypair):
    """A fleet server's operator key and token beside the session's release key pair."""
    from tests.fleet_server_process import make_keys

    return make_keys(tmp_path_factory.mktemp("keys"), release=keypair)


@pytest.fixture
def command_counter(mosquitto_broker):  # noqa: F811  (the fixture above, as a parameter)
    """Every command the broker delivers on the device command topics, per device and per id."""
    from tests.fleet_server_process import CommandCounter

    counting = CommandCounter(mosquitto_broker.port)
    yield counting
    counting.close()
