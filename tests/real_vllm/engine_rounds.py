"""``engine_run.py`` with a step between an in-process engine's rounds: snapshot its store and stats, then damage it.

Usage: ``python tests/real_vllm/engine_rounds.py SPEC.json``: SPEC as for ``engine_run.py`` (``rounds`` 2, the
engine core in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), plus ``between``: ``store`` (a shared_storage
folder), ``stats`` (the engine's ``kvdi_stats_dir``), ``snapshot`` (a folder: ``objects.json``, each stored
object's path and size, and a copy of the stats files once they stop moving), ``corrupt`` and ``delete`` (object
paths under ``store``: one payload byte flipped, or removed). After round 1 has settled (every request done, its
saves landed) the snapshot is taken and the damage done; round 2 then looks the same prompts up in the store
(run with ``prefix_caching`` false, so vLLM's own cache holds nothing the store is not asked for).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any


def between(spec: dict[str, Any]) -> None:
    """Snapshot the store's objects and the stats files (settled), then corrupt and delete what ``spec`` names."""
    from vllm_support import read_stats_settled  # type: ignore[import-not-found,unused-ignore]  # a script: here

    store, stats, snapshot = (Path(spec[k]) for k in ("store", "stats", "snapshot"))
    read_stats_settled(stats, "worker")  # the workers write their stats files a moment after their counters move
    objects = {str(p.relative_to(store)): p.stat().st_size for p in store.rglob("*") if p.is_file()}
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "objects.json").write_text(json.dumps(objects))
    shutil.copytree(stats, snapshot / "stats")
    for name in spec["corrupt"]:
        data = bytearray((store / name).read_bytes())
        data[-1] ^= 0xFF  # one payload byte: only the checksum tells
        (store / name).write_bytes(bytes(data))
    for name in spec["delete"]:
        (store / name).unlink()


def main(argv: list[str]) -> int:
    import engine_run  # type: ignore[import-not-found,unused-ignore]  # this folder is on sys.path: a script
    from vllm_support import spec_main  # type: ignore[import-not-found,unused-ignore]

    spec = json.loads(Path(argv[1]).read_text())
    settle = engine_run.settle

    def settle_then_damage(llm: Any, timeout: float = 60.0) -> None:
        settle(llm, timeout)
        between(spec["between"])

    engine_run.settle = settle_then_damage  # run() calls it between rounds of an in-process engine
    code: int = spec_main(argv, engine_run.run)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
