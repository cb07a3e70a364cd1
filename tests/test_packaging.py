"""kvdi as an installed package: an editable install mypy can see, typed helpers that accept composed containers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What a developer composing kvdi writes, checked with mypy --strict against an editable install.
USER_CODE = """
from collections.abc import Iterator

from dependency_injector import containers, providers

from kvdi.containers import EngineContainer, KVTransferContainer, validate_container
from kvdi.settings import KvdiSettings, load_settings
from kvdi.testing import override_allocator, override_connector, recording_halves


class App(containers.DeclarativeContainer):
    settings = providers.Singleton(load_settings)
    engine = providers.Container(EngineContainer, settings=settings)
    kv = providers.Container(KVTransferContainer, settings=settings)


def check(app: App) -> int:
    checked: int = validate_container(app)
    scheduler, worker, log = recording_halves(app.engine)
    with override_connector(app.kv, scheduler=scheduler, worker=worker), override_allocator(app.engine, None):
        pass
    return checked + len(log.methods())


def settings_of(value: KvdiSettings) -> Iterator[str]:
    yield value.kv_connector
"""


@pytest.fixture(scope="module")
def editable_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding kvdi as ``pip install -e .`` installs it (PEP 660 editable wheel), plus kvdi's dependencies."""
    work = tmp_path_factory.mktemp("editable")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvdi", src / "kvdi", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-c", f"import setuptools.build_meta as b; print(b.build_editable({str(work)!r}))"],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    wheel = work / built.stdout.strip().splitlines()[-1]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [str(work / "venv" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    (site / "zz_kvdi_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return site


def test_the_editable_install_is_a_plain_path_mypy_can_follow(editable_site: Path) -> None:
    """Not an import hook (mypy cannot run one): a .pth line naming the source folder, which ships py.typed."""
    (pth,) = editable_site.glob("__editable__.kvdi*.pth")
    lines = [line for line in pth.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and not lines[0].startswith("import ")
    assert (Path(lines[0]) / "kvdi" / "py.typed").is_file()


@pytest.mark.slow
def test_mypy_strict_accepts_typed_helpers_on_composed_containers(editable_site: Path, tmp_path: Path) -> None:
    """mypy --strict on user code: kvdi is found through the editable install, and the testing helpers, and
    validate_container, accept the providers.Container that composes a kvdi container into an app."""
    code = tmp_path / "user_app.py"
    code.write_text(USER_CODE)
    python = editable_site.parents[2] / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--python-executable", str(python), "--no-incremental", str(code)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": "", "MYPYPATH": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout
