"""A vLLM connector whose every method does nothing: vLLM's own floor for "a connector is configured".

Selected with ``--kv-transfer-config '{"kv_connector": "NoopConnector", "kv_connector_module_path":
"benchmarks.vllm.noop_connector", "kv_role": "kv_both"}'``. Whatever a step costs with it over no connector is
what vLLM itself spends on any connector (metadata envelopes, the connector's forward-context hooks, the output
aggregation); :mod:`.bench_serve` divides every connector's latencies by this one's.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]
    """Offers nothing, loads nothing, saves nothing."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
