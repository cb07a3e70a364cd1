"""Run kvdi's connectors inside vLLM (0.32, V1 engine) through ``kv_connector_module_path``.

Select it with::

    KVTransferConfig(
        kv_connector="KvdiConnector",
        kv_connector_module_path="kvdi.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvdi.kv_connector": "shared_storage",
                                   "kvdi.shared_storage.path": "/tmp/kv"},
    )

The package is split by concept; only :mod:`.connector` and :mod:`.envelopes` import vLLM:

- :mod:`.connector`: :class:`KvdiConnector`, vLLM's ``KVConnectorBase_V1`` over kvdi's halves;
- :mod:`.envelopes`: kvdi's metadata and counters in vLLM's envelope types;
- :mod:`.config`: kvdi settings from vLLM's config (``kvdi.*`` extra-config keys, role, engine id);
- :mod:`.layout`: kvdi's :class:`~kvdi.layout.KVCacheSpec` of vLLM's cache, per-layer block views;
- :mod:`.bridge`: a scratch cache for layouts whose blocks are not contiguous;
- :mod:`.requests`: vLLM requests and scheduler output as kvdi's;
- :mod:`.block_index`: the scheduler's key-only view of a worker-local store;
- :mod:`.stats`: per-step counter deltas and the ``kvdi_stats_dir`` files;
- :mod:`.shared`: one kvdi container per engine id per process;
- :mod:`.halves`: the kvdi half behind a connector (one container's, or one per KV cache group);
- :mod:`.groups` / :mod:`.hybrid`: vLLM's KV cache groups (sliding window, Mamba) planned,
  keyed, stored and loaded per group (``SupportsHMA``).

``KvdiConnector`` is resolved lazily (module ``__getattr__``), so importing this package or
its vLLM-free modules never imports vLLM; vLLM's ``getattr(module, "KvdiConnector")`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdi.integrations.vllm.connector import KvdiConnector

__all__ = ["KvdiConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvdiConnector":
        from kvdi.integrations.vllm.connector import KvdiConnector

        return KvdiConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
