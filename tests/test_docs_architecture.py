"""docs/architecture.md's module map matches the files: every product module is named in it, and
every module it names exists. A failure names the module and the table row to fix, in one line.

How the map names a module: in the tables of the "Shared core (`edgepack_core/`)", "Host side
(`sdk/`)" and "Device side (`device_agent/`)" sections, a first cell names modules relative to
that package (`store.py`, `updates/jobs.py`); a first cell naming a folder (`fleet_server/`)
names, in its description, the modules of that folder (`db.py`, or `cli/__init__.py` from the
package). Not counted: `__init__.py` files (a package is named by its folder), and the Alembic
tree under `sdk/fleet_server/migrations/` (its environment and revision scripts are found by
Alembic by path, named by revision id; the map names `migrations/` as one entry).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("edgepack_core", "device_agent", "sdk")
NOT_COUNTED = ("sdk/fleet_server/migrations/",)
TICKED = re.compile(r"`([^`\s]+)`")
MODULE = re.compile(r"^[\w/]+\.py$")
ABSOLUTE = re.compile(rf"^(?:{'|'.join(PACKAGES)})/[\w/]*\.py$")


@dataclass(frozen=True)
class Mention:
    """A module (or folder, ending in /) the map names, and where."""

    path: str
    line: int
    section: str


def _rows() -> list[tuple[int, str, str, str]]:
    """(line, package, first cell, description) of every table row in the module map's package sections."""
    rows, package = [], None
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index("## Module map")
    for number, line in enumerate(lines[start + 1:], start=start + 2):
        if line.startswith("## "):
            break
        if line.startswith("### "):
            match = re.search(rf"`({'|'.join(PACKAGES)})/`", line)
            package = match.group(1) if match else None
        elif package and line.startswith("| `"):
            cells = line.split("|")
            rows.append((number, package, cells[1], "|".join(cells[2:])))
    return rows


def _mentions() -> list[Mention]:
    found = []
    for number, package, first, description in _rows():
        section = f"the {package}/ table"
        for name in TICKED.findall(first):
            found.append(Mention(f"{package}/{name}", number, section))
            if not name.endswith("/"):
                continue
            for inner in TICKED.findall(description):
                if MODULE.match(inner) and not ABSOLUTE.match(inner):
                    base = package if inner.startswith(name) else f"{package}/{name.rstrip('/')}"
                    found.append(Mention(f"{base}/{inner}", number, f"{section}, row `{name}`"))
    return found


def _modules() -> list[str]:
    return sorted(path.relative_to(REPO).as_posix() for package in PACKAGES
                  for path in (REPO / package).rglob("*.py")
                  if path.name != "__init__.py" and not path.relative_to(REPO).as_posix().startswith(NOT_COUNTED))


def _fix(module: str) -> str:
    package, _, rest = module.partition("/")
    folder, _, name = rest.rpartition("/")
    where = f"add a row `{rest}` to the {package}/ table"
    return f"{where}, or name `{name}` in its `{folder}/` row" if folder else where


def test_every_product_module_is_named_in_the_architecture_map():
    named = {mention.path for mention in _mentions()}
    missing = [f"{module} is not in docs/architecture.md's module map: {_fix(module)}"
               for module in _modules() if module not in named]
    assert not missing, "\n".join(missing)


def test_every_module_the_architecture_map_names_exists():
    """Map entries, and any `package/...py` path anywhere in the document."""
    stale = [f"docs/architecture.md:{m.line} ({m.section}) names {m.path}, which does not exist: rename or drop it"
             for m in _mentions() if not (REPO / m.path).exists()]
    for number, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), start=1):
        stale += [f"docs/architecture.md:{number} names {path}, which does not exist: rename or drop it"
                  for path in TICKED.findall(line) if ABSOLUTE.match(path) and not (REPO / path).exists()]
    assert not stale, "\n".join(stale)


def test_the_map_reader_sees_rows_folders_and_their_modules():
    """The reader itself: without it the two tests above could pass on an empty map."""
    named = {mention.path for mention in _mentions()}
    assert {"edgepack_core/fsutil.py", "device_agent/store.py", "sdk/fleet_server/db.py",
            "sdk/packager/passes/base.py", "device_agent/http/app.py"} <= named
    assert len(_modules()) > 100
