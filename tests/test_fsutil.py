"""edgepack_core.fsutil: the one atomic write of host and device (keys, artifacts, agent state)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edgepack_core import fsutil

REPO = Path(__file__).resolve().parent.parent


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_kill_9_in_the_middle_of_a_write_leaves_the_old_file_whole(tmp_path):
    """A real process dies by SIGKILL after writing half the new bytes: the target still holds
    every old byte, and no torn file ever stands under its name."""
    target = tmp_path / "state.json"
    target.write_bytes(b"old" * 1000)
    script = (f"import os, signal, sys; sys.path.insert(0, {str(REPO)!r})\n"
              "from edgepack_core.fsutil import atomic_writer\n"
              f"with atomic_writer({str(target)!r}) as handle:\n"
              "    handle.write(b'new' * 500); handle.flush(); os.fsync(handle.fileno())\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert target.read_bytes() == b"old" * 1000
    others = [name for name in os.listdir(tmp_path) if name != "state.json"]
    assert all(name.startswith(".state.json.") for name in others)  # only the dead writer's temp file


def test_an_error_inside_the_block_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    target = tmp_path / "a.edgepkg"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk on fire"), fsutil.atomic_writer(target) as handle:
        handle.write(b"half")
        raise RuntimeError("disk on fire")
    assert target.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["a.edgepkg"]


def test_the_temporary_file_is_in_the_target_directory_and_never_wider_than_the_mode(tmp_path):
    """A rename is atomic only within one file system, and a private key must not be readable
    by others even while it is written (umask 0: nothing narrows it for us)."""
    target = tmp_path / "signing.key"
    old_umask = os.umask(0)
    try:
        with fsutil.atomic_writer(target, mode=0o600) as handle:
            [temporary] = tmp_path.iterdir()
            assert temporary.name.startswith(".signing.key.") and _mode(temporary) == 0o600
            handle.write(b"secret")
    finally:
        os.umask(old_umask)
    assert _mode(target) == 0o600 and target.read_bytes() == b"secret"


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_the_file_gets_exactly_the_mode_asked_for_whatever_the_umask(tmp_path, mode):
    target = tmp_path / "file"
    old_umask = os.umask(0o077)
    try:
        fsutil.atomic_write(target, b"x", mode=mode)
    finally:
        os.umask(old_umask)
    assert _mode(target) == mode


def test_the_default_mode_is_private(tmp_path):
    fsutil.atomic_write(tmp_path / "state.json", b"{}")
    assert _mode(tmp_path / "state.json") == 0o600


def test_overwrite_false_never_replaces_an_existing_file(tmp_path):
    target = tmp_path / "signing.key"
    target.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        fsutil.atomic_write(target, b"new", overwrite=False)
    assert target.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["signing.key"]
    fsutil.atomic_write(tmp_path / "other.key", b"new", overwrite=False)
    assert (tmp_path / "other.key").read_bytes() == b"new"


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after_it(tmp_path, monkeypatch):
    """A power cut cannot be made here, so the order of the durable steps is recorded instead:
    the data reaches the disk before the name points at it, and the name reaches it after."""
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    seen: list[tuple[str, bytes]] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        seen.append((kind, target.read_bytes()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    fsutil.atomic_write(target, b"new")
    assert seen == [("file", b"old"), ("dir", b"new")]
