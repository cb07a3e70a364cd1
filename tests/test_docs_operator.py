"""The operator pages: linked from the README and operations, and the configuration page's example app built only
when run (its module imports without side effects)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("deployment.md", "troubleshooting.md", "migration.md")


@pytest.mark.parametrize("page", PAGES)
def test_each_operator_page_is_linked_from_the_readme_and_operations(page: str) -> None:
    """README's docs table and docs/operations.md link each new page, and the page exists."""
    assert (ROOT / "docs" / page).is_file()
    assert f"(docs/{page})" in (ROOT / "README.md").read_text()
    assert f"]({page})" in (ROOT / "docs" / "operations.md").read_text()


def test_the_configuration_example_app_is_not_built_at_import() -> None:
    """Imported (not run), the composing example of docs/configuration.md defines ``create_app`` and builds no app."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    (code,) = [m for m in re.findall(r"```python\n(.*?)```", text, re.S) if "def create_app" in m]
    namespace: dict[str, object] = {"__name__": "operator_app"}
    exec(compile(code, "configuration.md", "exec"), namespace)  # the page's own snippet
    assert callable(namespace["create_app"]) and "app" not in namespace


def test_troubleshooting_opens_with_the_two_install_errors() -> None:
    """The first two entries are the errors an operator meets first."""
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / "troubleshooting.md").read_text(), re.M)
    assert headings[:2] == [
        "`Unsupported connector type: KvdiConnector`",
        "`PackageNotFoundError: No package metadata was found for vllm`",
    ]
