"""A worker rank's per-tier entries for vLLM's offloading series (vLLM-free): tiers described once, transfers by tier
for a store of one tier only."""

from __future__ import annotations

from pathlib import Path

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.integrations.vllm.fleet.offload_series import tier_labels
from kvdi.integrations.vllm.fleet.store_metrics import StoreCounters


def test_one_tier_reports_its_transfers_by_tier_and_describes_itself_once() -> None:
    counters = StoreCounters("worker", "0-0", None, [HostPoolStore(2, 64)])
    delta = {"loaded_bytes": 128, "saved_bytes": 64, "load_seconds": 0.5, "save_seconds": 0.25, "loaded_blocks": 2}
    first = counters.entry(delta) or {}
    assert first["g|worker|0-0|tier_info|0:host|HostPoolStore"] == 1.0
    assert {k: v for k, v in first.items() if k.startswith("c|worker|tier_")} == {
        "c|worker|tier_read_bytes|0:host": 128,
        "c|worker|tier_write_bytes|0:host": 64,
        "c|worker|tier_read_seconds|0:host": 0.5,
        "c|worker|tier_write_seconds|0:host": 0.25,
    }
    second = counters.entry({"saved_bytes": 64}) or {}
    assert not any("tier_info" in k for k in second)
    assert second["c|worker|tier_write_bytes|0:host"] == 64 and "c|worker|tier_read_bytes|0:host" not in second


def test_several_tiers_are_described_but_their_shares_are_not_guessed(tmp_path: Path) -> None:
    counters = StoreCounters("worker", "0-0", None, [HostPoolStore(2, 64), FileBlockStore(tmp_path / "kv")])
    entry = counters.entry({"loaded_bytes": 128}) or {}
    assert {k for k in entry if "tier_info" in k} == {
        "g|worker|0-0|tier_info|0:host|HostPoolStore",
        "g|worker|0-0|tier_info|1:disk|FileBlockStore",
    }
    assert not any(k.startswith("c|worker|tier_") for k in entry)


def test_tier_labels_name_remote_stores_remote() -> None:
    assert tier_labels(["host", "disk", "external_unspecified", "p2p"]) == ["0:host", "1:disk", "2:remote", "3:p2p"]
