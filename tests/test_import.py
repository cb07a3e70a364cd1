"""``import kvdi`` is light: neither torch nor redis (nor any connector module) is imported."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_kvdi_imports_neither_torch_nor_redis() -> None:
    run("import kvdi, sys; assert 'torch' not in sys.modules and 'redis' not in sys.modules")


def test_building_a_null_container_imports_neither_torch_nor_redis() -> None:
    run(
        "import sys, kvdi; c = kvdi.build_kv_container(kv_connector='null'); c.worker_connector(); "
        "assert 'torch' not in sys.modules and 'redis' not in sys.modules"
    )


def test_public_api_is_declared() -> None:
    import kvdi

    assert "build_engine_container" in kvdi.__all__
    assert all(hasattr(kvdi, name) for name in kvdi.__all__)
