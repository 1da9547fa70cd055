"""What Ed25519 verification costs the agent: cryptography (OpenSSL, what it used before) against
PyNaCl (libsodium, edgepack_core/ed25519.py), side by side in fresh interpreters.

Each child imports numpy, onnxruntime, hashlib and edgepack_core.errors first (an agent has them
before it verifies anything), reads VmRSS, imports one library, verifies one signature over ``--bytes`` bytes (the
size of a manifest) and reads VmRSS again; then it times ``--runs`` verifications. Children
alternate the two libraries, ``--rounds`` each; figures are medians.

    python tools/bench/ed25519_verify.py [--rounds 5] [--bytes 2330] [--runs 5000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, re, sys, time
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
import hashlib, numpy, onnxruntime
import edgepack_core.errors  # the agent has it anyway: what follows is the library and its key type
library, signature, key, size, runs = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
data = bytes(size)
base = rss()
if library == "cryptography":
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    public = Ed25519PublicKey.from_public_bytes(key)
    verify = lambda: public.verify(signature, data)
else:
    from edgepack_core.ed25519 import PublicKey
    public = PublicKey.from_public_bytes(key)
    verify = lambda: public.verify(signature, data)
verify()
added = rss() - base
start = time.perf_counter()
for _ in range(runs):
    verify()
print(json.dumps({"mib": added, "us": (time.perf_counter() - start) / runs * 1e6}))
"""
LIBRARIES = ("cryptography", "pynacl")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bytes", type=int, default=2330, help="size of the signed data (a manifest's)")
    parser.add_argument("--runs", type=int, default=5000, help="verifications timed in each child")
    args = parser.parse_args()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    signature = private.sign(bytes(args.bytes)).hex()
    key = private.public_key().public_bytes_raw().hex()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in LIBRARIES}
    for _ in range(args.rounds):
        for name in LIBRARIES:
            child = [sys.executable, "-c", CHILD, name, signature, key, str(args.bytes), str(args.runs)]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            results[name].append(json.loads(done.stdout))
    for name, runs in results.items():
        mib = statistics.median(run["mib"] for run in runs)
        micros = statistics.median(run["us"] for run in runs)
        print(f"{name:13s} import and a first verify: +{mib:.2f} MiB; {micros:.1f} µs a verify of {args.bytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
