"""Build Edgepack's wheels from a clean copy of the checkout.

One checkout holds two distributions: ``edgepack-agent`` (distributions/edgepack-agent: the
device, edgepack_core/ and device_agent/) and ``edgepack`` (pyproject.toml: the host, sdk/,
depending on edgepack-agent). Building in place leaves setuptools' build/ folders behind, and
a later build packs whatever they still hold (a deleted module lives on in the wheel); building
from a fresh copy of what the builds read (the packages, both project folders) gives each wheel
exactly the checkout.

    python tools/build_wheels.py OUT [--dist agent] [--dist host] [--no-build-isolation]

Prints the path of each wheel built (default: both). ``--no-build-isolation`` builds with this
Python's setuptools instead of fetching one (the tests build offline).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# distribution -> its project folder, relative to the checkout
DISTRIBUTIONS = {"agent": Path("distributions/edgepack-agent"), "host": Path(".")}


# What the two builds read: the packages and both project folders (pyproject.toml, README.md).
SOURCES = ("pyproject.toml", "README.md", "edgepack_core", "device_agent", "sdk", "distributions")
_LEFTOVERS = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", "dist")


def copy_sources(dest: Path, root: Path = ROOT) -> Path:
    for name in SOURCES:
        if (root / name).is_dir():
            shutil.copytree(root / name, dest / name, ignore=_LEFTOVERS)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
    return dest


def build_wheels(out: Path, dists: list[str], *, isolation: bool = True) -> list[Path]:
    """Build the wheels of ``dists`` (keys of DISTRIBUTIONS) into ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    built = []
    with tempfile.TemporaryDirectory(prefix="edgepack-wheels-") as work:
        copy = copy_sources(Path(work) / "src")
        for dist in dists:
            before = set(out.glob("*.whl"))
            command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
            if not isolation:
                command.append("--no-build-isolation")
            subprocess.run([*command, str(copy / DISTRIBUTIONS[dist])], check=True)
            new = sorted(set(out.glob("*.whl")) - before)
            prefix = "edgepack_agent-" if dist == "agent" else "edgepack-"
            built += new or sorted(out.glob(f"{prefix}*.whl"))  # an identical wheel already there
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dist", action="append", choices=sorted(DISTRIBUTIONS), help="agent or host (repeatable)")
    parser.add_argument("--no-build-isolation", action="store_true")
    args = parser.parse_args(argv)
    try:
        wheels = build_wheels(args.out, args.dist or ["agent", "host"], isolation=not args.no_build_isolation)
    except subprocess.CalledProcessError as err:
        print(f"build_wheels: {' '.join(map(str, err.cmd[:3]))} ... failed with exit {err.returncode}",
              file=sys.stderr)
        return 1
    for wheel in wheels:
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
