"""The ``p2p`` connector: a prefill engine (``kv_producer``) hands KV to a decode engine (``kv_consumer``).

Modules, one concept each:

- :mod:`~kvdi.connectors.p2p.errors`: :class:`P2pHandshakeError`, :class:`P2pTransferError`.
- :mod:`~kvdi.connectors.p2p.backend`: the spec's backend factory (:func:`open_channel`);
  :mod:`~kvdi.connectors.p2p.roles`: which side of the pair the settings make.
- :mod:`~kvdi.connectors.p2p.lookup`: lookups of published blocks, and the scheduler-only stand-in
  for the channel when vLLM runs the worker half in another process (only the worker pairs).
- :mod:`~kvdi.connectors.p2p.scheduler`, :mod:`~kvdi.connectors.p2p.worker`: the two halves.
- :mod:`~kvdi.connectors.p2p.channel`: rendezvous, handshake, process group, the consumer's fetches;
  :mod:`~kvdi.connectors.p2p.groups`: the process group (NCCL error handling, bounded waits, draining).
- :mod:`~kvdi.connectors.p2p.serving`: the producer's serving loop.
- :mod:`~kvdi.connectors.p2p.protocol`: store keys and queue messages, checked strictly.
- :mod:`~kvdi.connectors.p2p.pairing`: the handshake through the store (the producer refuses bad
  peers and waits for a valid consumer); :mod:`~kvdi.connectors.p2p.handshake`: hellos, HMAC
  proofs of the auth token, layout checks.
- :mod:`~kvdi.connectors.p2p.rendezvous`: the producer's store, bound to ``kv_ip`` only.
- :mod:`~kvdi.connectors.p2p.held`: blocks the producer holds; :mod:`~kvdi.connectors.p2p.frames`:
  cache <-> wire layout; :mod:`~kvdi.connectors.p2p.watchdog`: bounded waits on store calls.

Importing this package imports neither torch nor the channel.
"""

from kvdi.connectors.p2p.errors import P2pHandshakeError, P2pTransferError

__all__ = ["P2pHandshakeError", "P2pTransferError"]
