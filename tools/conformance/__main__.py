"""``python -m tools.conformance``: onnx's backend test suite over bare onnxruntime and Edgepack.

Prints the pass counts per suite part (the table BENCHMARKS.md records) and the Edgepack
failure categories; ``--markdown PATH`` writes the categories with an example model and its
error line, ``--json PATH`` every outcome. Exit status 0 when Edgepack passes at least
``--gate`` of the tests bare onnxruntime passes, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tools.conformance.backends import DATA_SOURCES
from tools.conformance.driver import (
    DEFAULT_TIMEOUT_S,
    Category,
    Outcome,
    PartCount,
    categories,
    list_cases,
    run_suite,
    status_counts,
    tally,
)

GATE = 0.99


def table(rows: Sequence[PartCount]) -> str:
    lines = [f"{'part':<18} {'cases':>6} {'onnxruntime':>12} {'edgepack':>9} {'edgepack/ort':>13}"]
    for row in rows:
        lines.append(f"{row.part:<18} {row.cases:>6} {row.onnxruntime:>12} {row.edgepack:>9} {row.rate:>12.1%}")
    return "\n".join(lines)


def markdown(rows: Sequence[PartCount], groups: Sequence[Category], ort_groups: Sequence[Category],
             command: str, seconds: float, cpu: float) -> str:
    out = [f"Command: `{command}` ({seconds:.0f} s wall, {cpu:.0f} s CPU)", "", "```", table(rows), "```", "",
           "## Edgepack failures among the tests bare onnxruntime passes", "",
           "| count | category (stage: error, numbers and names blanked) | example | error |",
           "| ---: | --- | --- | --- |"]
    out += [_row(g) for g in groups] or ["| 0 | | | |"]
    out += ["", "## Bare onnxruntime failures (not counted against Edgepack)", "",
            "| count | category | example | error |", "| ---: | --- | --- | --- |"]
    out += [_row(g) for g in ort_groups] or ["| 0 | | | |"]
    return "\n".join(out) + "\n"


def _row(group: Category) -> str:
    message = " ⏎ ".join(line.strip() for line in group.message.splitlines() if line.strip())[:400]
    return f"| {group.count} | {_cell(group.key)} | {group.example} | {_cell(message)} |"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--data", choices=DATA_SOURCES, default="test_data",
                        help="how the recipe carries the test's inputs (default test_data)")
    parser.add_argument("--include", help="only test names matching this regular expression")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case")
    parser.add_argument("--gate", type=float, default=GATE, help="minimum Edgepack/onnxruntime rate")
    parser.add_argument("--markdown", type=Path, help="write the counts and failure categories here")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failure as it happens")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.include:
        try:
            re.compile(args.include)
        except re.error as err:
            parser.error(f"--include: {err}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    cases = [c for c in list_cases() if not args.include or re.search(args.include, c.name)]
    done = [0]

    def progress(outcome: Outcome) -> None:
        done[0] += outcome.backend == "onnxruntime"
        if args.verbose and outcome.status != "pass":
            print(f"{outcome.backend} {outcome.case.name}: {outcome.status}: {outcome.message.splitlines()[0]}",
                  file=sys.stderr)
        elif done[0] % 100 == 0 and outcome.backend == "onnxruntime":
            print(f"... {done[0]}/{len(cases)} cases", file=sys.stderr)

    workers_cpu: list[float] = []
    outcomes = run_suite(cases, jobs=args.jobs, data_source=args.data, timeout=args.timeout, progress=progress,
                         cpu=workers_cpu.append)
    seconds = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = sum(workers_cpu) + usage.ru_utime + usage.ru_stime
    rows = tally(cases, outcomes)
    print(table(rows))
    print(f"{seconds:.0f} s wall, {cpu:.0f} s CPU (workers and this process), {args.jobs} jobs; "
          f"onnxruntime {dict(status_counts(outcomes, 'onnxruntime'))}, "
          f"edgepack {dict(status_counts(outcomes, 'edgepack'))}")
    groups = categories(outcomes, "edgepack")
    for group in groups[:15]:
        print(f"{group.count:>5}  {group.key}  (e.g. {group.example})")
    command = "python -m tools.conformance " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.markdown:
        args.markdown.write_text(markdown(rows, groups, categories(outcomes, "onnxruntime"), command.strip(),
                                          seconds, cpu))
    if args.json:
        args.json.write_text(json.dumps([o.to_json() for o in outcomes], indent=1) + "\n")
    return 0 if rows[-1].rate >= args.gate else 1


if __name__ == "__main__":
    sys.exit(main())
