"""Modules by concept: no module in kvdi/ is over 400 lines."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvdi"
MAX_LINES = 400


def test_no_kvdi_module_is_over_400_lines() -> None:
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 30
    too_long = {path: lines for path, lines in sorted(sizes.items()) if lines > MAX_LINES}
    assert too_long == {}, f"modules over {MAX_LINES} lines: {too_long}"
