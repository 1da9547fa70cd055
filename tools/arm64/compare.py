"""Compare two `edgepack-agent predict --json` answers (x86 and arm64): outputs within a
tolerance, same model, and the provider really used. Prints one PASS/FAIL line per check."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reference")
    parser.add_argument("candidate")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()
    with open(args.reference) as a, open(args.candidate) as b:
        ref, cand = json.load(a), json.load(b)
    name = ref["model"]["name"]
    ok = True
    if ref["model"] != cand["model"] or set(ref["outputs"]) != set(cand["outputs"]):
        print(f"FAIL {name}: different model or outputs ({ref['model']} vs {cand['model']})")
        return 1
    worst = max(float(np.max(np.abs(np.asarray(ref["outputs"][k]) - np.asarray(cand["outputs"][k]))))
                for k in ref["outputs"])
    if worst <= args.atol:
        print(f"PASS {name}: arm64 outputs match x86, max abs diff {worst:.3g} (<= {args.atol:g})")
    else:
        print(f"FAIL {name}: max abs diff {worst:.3g} over {args.atol:g}")
        ok = False
    fallbacks = {f["provider"]: f["reason"] for f in cand.get("provider_fallbacks", [])}
    if cand["provider"] == "CPUExecutionProvider" and "XnnpackExecutionProvider" in fallbacks:
        reason = fallbacks["XnnpackExecutionProvider"]
        print(f"PASS {name}: arm64 runs on {cand['provider']}; XNNPACK not used: {reason}")
    elif cand["provider"] == "XnnpackExecutionProvider":
        print(f"PASS {name}: arm64 runs on XnnpackExecutionProvider")
    else:
        print(f"FAIL {name}: provider {cand['provider']} without a reported reason ({fallbacks})")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
