"""Which side of a p2p pair an engine is, from its settings; refuses pairs the settings cannot make."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdi.connectors.p2p.protocol import CONSUMER_RANK, PRODUCER_RANK
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.settings import KvdiSettings, P2pSettings

MIN_TOKEN_CHARS = 16


def check_pair_settings(options: P2pSettings, settings: KvdiSettings) -> bool:
    """True for the producer (rank 0), False for the consumer (rank 1).

    Raises ConfigError for a pairing the settings cannot make (``kv_both``, a rank or size that
    does not match the role, an auth token shorter than :data:`MIN_TOKEN_CHARS`)."""
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
    return producer


__all__ = ["MIN_TOKEN_CHARS", "check_pair_settings"]
