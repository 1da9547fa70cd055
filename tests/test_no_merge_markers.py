"""No tracked text file holds a merge's conflict markers: parallel branches are merged into main
all day, and a marker left in a document passes every other check (it happened in docs/)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = tuple(sign * 7 + " " for sign in "<>")  # "=======" alone is also a Markdown heading underline
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".sh", ".cfg", ".ini", ".txt", ".js", ".html",
                 ".css", ".service", ".conf", ".Dockerfile", ""}


def test_no_tracked_text_file_holds_conflict_markers():
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    found = []
    for name in filter(None, files.decode().split("\0")):
        path = ROOT / name
        if path.suffix not in TEXT_SUFFIXES or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(keepends=True), 1):
            if line.startswith(MARKERS):
                found.append(f"{name}:{number}")
    assert found == []
