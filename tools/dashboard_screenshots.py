"""Regenerate the dashboard screenshots in docs/img/ (fleet-overview, -device, -rollouts,
-rollout, -audit).

They are taken by tests/test_dashboard.py in a real headless Chromium against a real
``edgepack fleet serve`` fed by simulated devices; this runs that test file with
EDGEPACK_DASHBOARD_SCREENSHOTS pointing at docs/img/, so the committed pictures are exactly
what the test saw (and the test passed when they were taken).

    .venv/bin/python tools/dashboard_screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for fleet-*.png")
    args = parser.parse_args()
    out = args.out.resolve()
    env = {**os.environ, "EDGEPACK_DASHBOARD_SCREENSHOTS": str(out)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             str(ROOT / "tests" / "test_dashboard.py")], cwd=ROOT, env=env, check=False)
    if result.returncode != 0:
        print("tests/test_dashboard.py failed: screenshots not updated", file=sys.stderr)
        return 1
    for shot in sorted(out.glob("fleet-*.png")):
        print(f"{shot.relative_to(ROOT) if shot.is_relative_to(ROOT) else shot}: {shot.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
