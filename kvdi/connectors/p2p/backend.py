"""The ``p2p`` spec's backend factory: checks the pair's settings and opens the shared channel.

Both halves of an engine share one :class:`~kvdi.connectors.p2p.channel.P2pChannel`, opened
once per container by :func:`open_channel` (gloo on CPU, NCCL when the cache is on CUDA; the
producer, rank 0, hosts the rendezvous store on ``kv_ip:kv_port``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kvdi.connectors.base import ConnectorContext
from kvdi.errors import ConfigError, ConnectorTypeError

if TYPE_CHECKING:
    from kvdi.connectors.p2p.channel import P2pChannel
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, P2pSettings

MIN_TOKEN_CHARS = 16


def open_channel(options: P2pSettings, layout: KVCacheSpec, settings: KvdiSettings) -> P2pChannel:
    """Backend factory of the ``p2p`` spec: rendezvous, handshake and process group (blocks up to ``timeout_s``).

    Raises ConfigError for a pairing the settings cannot make (role, rank, an auth token shorter than
    :data:`MIN_TOKEN_CHARS`), :class:`~kvdi.connectors.p2p.errors.P2pHandshakeError` when the peers do not pair.
    """
    from kvdi.allocator import resolve_device
    from kvdi.connectors.p2p.channel import P2pChannel
    from kvdi.connectors.p2p.protocol import CONSUMER_RANK, PRODUCER_RANK

    if settings.kv_role == "kv_both":
        raise ConfigError(
            "KVDI_KV_ROLE='kv_both' is not supported by the p2p connector: run one engine with "
            "kv_role=kv_producer (KVDI_P2P__KV_RANK=0) and one with kv_role=kv_consumer (KVDI_P2P__KV_RANK=1)"
        )
    producer = settings.kv_role == "kv_producer"
    want = PRODUCER_RANK if producer else CONSUMER_RANK
    if options.kv_rank != want or options.kv_parallel_size != 2:
        raise ConfigError(
            f"p2p pairs one producer (rank {PRODUCER_RANK}) with one consumer (rank {CONSUMER_RANK}): "
            f"kv_role={settings.kv_role} needs KVDI_P2P__KV_RANK={want} and KVDI_P2P__KV_PARALLEL_SIZE=2, "
            f"got kv_rank={options.kv_rank}, kv_parallel_size={options.kv_parallel_size}"
        )
    token = options.auth_token.get_secret_value() if options.auth_token is not None else None
    if token is not None and len(token) < MIN_TOKEN_CHARS:  # the value itself is never shown
        raise ConfigError(
            f"KVDI_P2P__AUTH_TOKEN is too short ({len(token)} characters): use at least {MIN_TOKEN_CHARS}, "
            "e.g. the output of: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    device = resolve_device(settings.allocator.device)
    return P2pChannel(
        options,
        layout,
        producer=producer,
        backend=pick_backend(options, device),
        device=device,
        engine_id=settings.engine_id,
    )


def pick_backend(options: P2pSettings, device: str) -> Literal["gloo", "nccl"]:
    """``gloo`` for a CPU cache, ``nccl`` for a CUDA one (``auto``); raises ConfigError for NCCL without CUDA."""
    if options.backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if options.backend == "nccl" and not device.startswith("cuda"):
        raise ConfigError(
            f"KVDI_P2P__BACKEND='nccl' needs the KV cache on CUDA, but it is on {device!r} "
            "(KVDI_ALLOCATOR__DEVICE); use backend 'gloo' or 'auto'"
        )
    return options.backend


def require_channel(context: ConnectorContext) -> P2pChannel:
    """The shared channel of ``context``; ConnectorTypeError if the container built something else."""
    from kvdi.connectors.p2p.channel import P2pChannel

    if not isinstance(context.backend, P2pChannel):
        raise ConnectorTypeError(
            f"connector {context.name!r} needs a P2pChannel backend (kvdi.connectors.p2p.backend:open_channel), "
            f"got {type(context.backend).__name__}"
        )
    return context.backend


__all__ = ["open_channel", "pick_backend", "require_channel"]
