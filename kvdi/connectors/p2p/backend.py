"""The ``p2p`` spec's backend factory: checks the pair's settings and opens the shared channel.

Both halves of an engine share one :class:`~kvdi.connectors.p2p.channel.P2pChannel`, opened
once per container by :func:`open_channel` (gloo on CPU, NCCL when the cache is on CUDA; the
producer, rank 0, hosts the rendezvous store on ``kv_ip:kv_port``). A scheduler half in a
process without its worker half gets a :class:`~kvdi.connectors.p2p.lookup.LookupChannel`
instead (:func:`~kvdi.connectors.p2p.lookup.open_lookups`, the spec's ``scheduler_backend``):
only the worker pairs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kvdi.connectors.base import ConnectorContext
from kvdi.connectors.p2p.roles import MIN_TOKEN_CHARS, check_pair_settings
from kvdi.errors import ConfigError, ConnectorTypeError

if TYPE_CHECKING:
    from kvdi.connectors.p2p.channel import P2pChannel
    from kvdi.connectors.p2p.lookup import Lookups
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, P2pSettings


def open_channel(options: P2pSettings, layout: KVCacheSpec, settings: KvdiSettings) -> P2pChannel:
    """Backend factory of the ``p2p`` spec: rendezvous, handshake and process group (blocks up to ``timeout_s``).

    Raises ConfigError for a pairing the settings cannot make (role, rank, an auth token shorter than
    :data:`MIN_TOKEN_CHARS`), :class:`~kvdi.connectors.p2p.errors.P2pHandshakeError` when the peers do not pair.
    """
    from kvdi.allocator import resolve_device
    from kvdi.connectors.p2p.channel import P2pChannel

    producer = check_pair_settings(options, settings)
    device = resolve_device(settings.allocator.device)
    return P2pChannel(
        options,
        layout,
        producer=producer,
        backend=pick_backend(options, device),
        device=device,
        engine_id=settings.engine_id,
        wire_budget=settings.allocator.max_staging_bytes,
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


def require_lookups(context: ConnectorContext) -> Lookups:
    """What the scheduler half of ``context`` looks blocks up in: the shared channel, or a
    :class:`~kvdi.connectors.p2p.lookup.LookupChannel` when the worker half runs in another process."""
    from kvdi.connectors.p2p.channel import P2pChannel
    from kvdi.connectors.p2p.lookup import LookupChannel

    if not isinstance(context.backend, P2pChannel | LookupChannel):
        raise ConnectorTypeError(
            f"connector {context.name!r} needs a P2pChannel or LookupChannel backend "
            f"(kvdi.connectors.p2p.backend:open_channel), got {type(context.backend).__name__}"
        )
    return context.backend


def require_channel(context: ConnectorContext) -> P2pChannel:
    """The shared channel of ``context``; ConnectorTypeError if the container built something else."""
    from kvdi.connectors.p2p.channel import P2pChannel

    if not isinstance(context.backend, P2pChannel):
        raise ConnectorTypeError(
            f"connector {context.name!r} needs a P2pChannel backend (kvdi.connectors.p2p.backend:open_channel), "
            f"got {type(context.backend).__name__}"
        )
    return context.backend


__all__ = ["MIN_TOKEN_CHARS", "open_channel", "pick_backend", "require_channel", "require_lookups"]
