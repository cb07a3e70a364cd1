"""Throwaway connector modules and installed entry points for registry and container tests."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

CONNECTOR_MODULE = '''
from kvdi.connectors.null import NullSchedulerConnector, NullWorkerConnector
from kvdi.connectors.base import KVConnectorRole, SchedulerConnector, WorkerConnector


class MySched(NullSchedulerConnector):
    pass


class MyWorker(NullWorkerConnector):
    pass


class DualRole(NullSchedulerConnector, NullWorkerConnector):
    """A vLLM-style single class built for either role (the role is in its context)."""
'''


def write_module(directory: Path, body: str) -> str:
    """A throwaway module with a unique name on sys.path; returns its name."""
    name = f"throwaway_{uuid.uuid4().hex[:10]}"
    (directory / f"{name}.py").write_text(textwrap.dedent(body))
    return name


def install_entry_point(site: Path, ep_name: str, module: str, attr: str) -> None:
    """Write a real installed distribution (a .dist-info folder) declaring a kvdi.connectors entry point."""
    dist = site / f"kvdi_plugin_{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvdi-plugin-{module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[kvdi.connectors]\n{ep_name} = {module}:{attr}\n")
