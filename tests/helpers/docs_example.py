"""The store example of docs/store-backend.md, loaded from the page's own code block (one copy for every test)."""

from __future__ import annotations

import importlib
import re
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

DOC = Path(__file__).resolve().parents[2] / "docs" / "store-backend.md"


def example_source() -> str:
    """The python block that follows ``<!-- example: sqlite_store.py -->`` in the docs page."""
    text = DOC.read_text()
    found = re.search(r"<!-- example: sqlite_store\.py -->\n```python\n(.*?)\n```", text, re.S)
    assert found, f"{DOC} lost its example block"
    return found.group(1) + "\n"


@contextmanager
def docs_example_module(folder: Path) -> Iterator[ModuleType]:
    """The page's example written to ``folder`` and imported under a fresh name (removed again on exit)."""
    name = f"sqlite_store_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(example_source())
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)
