"""The two errors of the p2p connector (both :class:`~kvdi.errors.KvdiError`)."""

from __future__ import annotations

from kvdi.errors import KvdiError


class P2pHandshakeError(KvdiError):
    """The two p2p peers could not agree: no peer, a busy port, a failed authentication, or a foreign
    KV layout or backend. Raised while the channel is built; the pair never starts."""


class P2pTransferError(KvdiError):
    """A p2p fetch failed (peer gone, timeout); the engine recomputes the blocks."""


__all__ = ["P2pHandshakeError", "P2pTransferError"]
