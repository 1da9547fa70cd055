"""Peak memory of verifying hostile artifacts, against a valid artifact of about the same size.

Each file (a 1 GiB-declaring PAX ``x`` header, a GNU ``L`` long-name header, a second tar in the
same gzip stream, a second gzip member appended, trailing garbage) is fed to the real
``edgepack verify`` and ``edgepack-agent install`` subprocesses; the figure is the child's peak
RSS (``ru_maxrss``), median of ``--runs``. ``--compare REV`` also runs the library verifier of
another revision (e.g. the one before the bounded reader) on the same files.

    python tools/bench/hostile_artifact_memory.py [--runs 3] [--compare c01a083]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.keys import write_keypair  # noqa: E402
from tests.hostile_archives import (  # noqa: E402
    huge_gnu_longname,
    huge_pax_header,
    second_tar_appended,
    second_tar_in_stream,
    trailing_garbage,
    valid_artifact,
)

BIN = Path(sys.executable).parent
PEAK = ("import json, resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, stdin=subprocess.DEVNULL)\n"
        "print(json.dumps([p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
OLD_VERIFY = ("import importlib.util, sys\n"
              "from edgepack_core.signing import TrustStore\n"
              "spec = importlib.util.spec_from_file_location('old_artifact', sys.argv[1])\n"
              "module = importlib.util.module_from_spec(spec); sys.modules['old_artifact'] = module\n"
              "spec.loader.exec_module(module)\n"
              "try:\n    module.verify_artifact(sys.argv[2], TrustStore.from_paths([sys.argv[3]]))\n"
              "except Exception as err:\n    print(type(err).__name__, err, file=sys.stderr); sys.exit(1)\n")


def peak_mib(argv: list[str], runs: int) -> tuple[int, float]:
    results = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PEAK, *argv], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout))
    return results[0][0], statistics.median(kib for _, kib in results) / 1024


def make_files(folder: Path, key: Path) -> dict[str, Path]:
    valid = valid_artifact(folder, key)
    return {
        "valid": valid,
        "pax_x_1gib": huge_pax_header(folder / "pax.edgepkg"),
        "gnu_L_1gib": huge_gnu_longname(folder / "gnu.edgepkg"),
        "second_tar_same_stream": second_tar_in_stream(valid, folder / "stream2.edgepkg"),
        "second_gzip_appended": second_tar_appended(valid, folder / "appended.edgepkg"),
        "trailing_garbage": trailing_garbage(valid, folder / "garbage.edgepkg"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compare", metavar="REV", help="also measure the library verifier of this revision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        key, public = folder / "k.key", folder / "k.pub"
        write_keypair(key, public)
        files = make_files(folder, key)
        old = None
        if args.compare:
            old = folder / "old_artifact.py"
            source = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.compare}:edgepack_core/artifact.py"],
                                    capture_output=True, check=True).stdout
            old.write_bytes(source)
        header = f"{'file':<24} {'size KB':>8} {'verify MiB':>11} {'install MiB':>12}"
        print(header + (f" {'old verify MiB':>15}" if old else ""))
        for name, path in files.items():
            rc_v, verify = peak_mib([str(BIN / "edgepack"), "verify", str(path), "--trust", str(public)], args.runs)
            store = folder / f"store-{name}"
            rc_i, install = peak_mib([str(BIN / "edgepack-agent"), "install", "--store", str(store), "--artifact",
                                      str(path), "--trust", str(public)], 1 if name == "valid" else args.runs)
            line = f"{name:<24} {path.stat().st_size / 1000:>8.0f} {verify:>7.1f} ({rc_v}) {install:>8.1f} ({rc_i})"
            if old:
                rc_o, before = peak_mib([sys.executable, "-c", OLD_VERIFY, str(old), str(path), str(public)], 1)
                line += f" {before:>11.1f} ({rc_o})"
            print(line)
    print("(exit code in brackets: 0 accepted, 1 refused)")


if __name__ == "__main__":
    main()
