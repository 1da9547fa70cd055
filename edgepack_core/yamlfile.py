"""Reading a YAML document (recipe, agent.yaml) with a size bound and one-line errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from edgepack_core.errors import EdgepackError


def read_yaml_file(path: Path, max_bytes: int, fail: Callable[[str], EdgepackError], *, kind: str) -> Any:
    """Parse ``path`` with ``yaml.safe_load``; every failure becomes ``fail(problem)``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise fail(f"no such {kind} file") from None  # the message names the missing file
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}") from err
    if len(raw) > max_bytes:
        raise fail(f"larger than {max_bytes} bytes")
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise fail(f"not valid YAML{where}") from err
