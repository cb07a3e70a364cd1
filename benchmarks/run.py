"""Run kvdi's ratio benchmarks and write one JSON file per run.

    python benchmarks/run.py [NAME ...] [--quick]     # names: resolution storage redis ttft p2p

Every figure is a ratio of kvdi to a raw baseline measured in the same run on the same
bytes; the JSON lands in benchmarks/results/<utc-timestamp>.json and is printed.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

from kvdi.cli import main


def run(argv: list[str]) -> int:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["bench", *argv, "--json"])
    if code:
        return code
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / time.strftime("%Y%m%dT%H%M%SZ.json", time.gmtime())
    path.write_text(buf.getvalue())
    print(buf.getvalue())
    print(f"written: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
