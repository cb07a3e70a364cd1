"""vLLM plugin (entry point ``vllm.general_plugins``): registers :class:`KvdiConnector` with vLLM's connector factory.

With kvdi installed, vLLM calls :func:`register` in every process it starts (API server,
engine core, workers), so ``--kv-transfer-config '{"kv_connector": "KvdiConnector", ...}'``
works without ``kv_connector_module_path``, and vLLM's ``MultiConnector`` can rebuild a
kvdi child's stats by its registered name (``KVConnectorFactory.get_connector_class_by_name``).

Registration is lazy (vLLM imports :mod:`kvdi.integrations.vllm.connector` only when a
connector is built) and idempotent: vLLM may load plugins several times per process.
Setting ``VLLM_PLUGINS`` to a list without ``kvdi`` turns the plugin off.
"""

from __future__ import annotations

CONNECTOR_NAME = "KvdiConnector"
CONNECTOR_MODULE = "kvdi.integrations.vllm.connector"


def register() -> None:
    """Register ``KvdiConnector`` with vLLM's ``KVConnectorFactory`` unless a connector of that name exists."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if is_registered():
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def is_registered() -> bool:
    """True when vLLM's connector factory knows ``KvdiConnector`` by name (vLLM has no public query for it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {})


__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "is_registered", "register"]
