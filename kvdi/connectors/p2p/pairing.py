"""Pairing through the rendezvous store: the producer waits for a valid consumer; a bad peer is
refused without ending the wait.

Keys under ``kvdi/p2p/`` (the checks themselves live in :mod:`kvdi.connectors.p2p.handshake`):

- ``hello/0``: the producer's hello, set once.
- ``hellos``: a queue; each would-be consumer pushes its hello (with a fresh nonce ``N``).
- ``proof/0/N``, ``proof/1/N``: with an auth token, both sides' proofs for that consumer.
- ``verdict/0/N``: the producer's answer to consumer ``N``: ``ok``, ``refused`` or ``busy``
  (the producer is already paired; its serving loop answers late hellos with :func:`answer_busy`).

The producer answers hellos one at a time, in arrival order: a malformed hello, a peer
without the token, with another token, layout or backend, or one that never sends its proof
(within ``timeout_s``) is refused (counted in :attr:`ProducerPairing.refused`, logged once
per reason), and the producer waits for the next one until ``connect_timeout_s`` has passed
since it started waiting; only then does it raise :class:`P2pHandshakeError`. A consumer
raises :class:`P2pHandshakeError` at once on what it can see itself (a peer that
authenticates differently, a proof that does not verify, a foreign layout) or on the
producer's refusal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from kvdi.connectors.logging_once import log_once
from kvdi.connectors.p2p import handshake as hs
from kvdi.connectors.p2p.errors import P2pHandshakeError
from kvdi.connectors.p2p.protocol import CONSUMER_RANK, PREFIX, PRODUCER_RANK, Session

if TYPE_CHECKING:  # torch.distributed re-exports it at run time only
    from torch._C._distributed_c10d import Store

    from kvdi.layout import KVCacheSpec

logger = logging.getLogger(__name__)

HELLO_QUEUE = PREFIX + "hellos"
PRODUCER_HELLO = f"{PREFIX}hello/{PRODUCER_RANK}"
POLL_S = 0.02
OK, REFUSED, BUSY = "ok", "refused", "busy"


def proof_key(rank: int, nonce: str) -> str:
    return f"{PREFIX}proof/{rank}/{nonce}"


def verdict_key(nonce: str) -> str:
    return f"{PREFIX}verdict/{PRODUCER_RANK}/{nonce}"


def poll_first(store: Store, keys: list[str], timeout_s: float) -> tuple[str, bytes]:
    """The first of ``keys`` that exists and its value; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for key in keys:
            if store.check([key]):
                return key, bytes(store.get(key))
        if time.monotonic() >= deadline:
            raise TimeoutError(f"none of {len(keys)} keys within {timeout_s:.1f}s")
        time.sleep(POLL_S)


def pop_hello(store: Store) -> bytes | None:
    """One queued hello, or None when the queue is empty."""
    try:
        return bytes(store.queue_pop(HELLO_QUEUE, False))
    except dist.QueueEmptyError:
        return None


def answer_busy(store: Store) -> int:
    """Producer, once paired: answer every queued hello ``busy``; returns how many were answered."""
    answered = 0
    while (raw := pop_hello(store)) is not None:
        try:
            nonce = hs.parse_hello(raw, CONSUMER_RANK)["nonce"]
        except ValueError:
            continue
        store.set(verdict_key(nonce), BUSY)
        answered += 1
    return answered


class ProducerPairing:
    """The producer's side: answer hellos until one makes a valid pair."""

    def __init__(
        self,
        store: Store,
        where: str,
        layout: KVCacheSpec,
        backend: str,
        token: bytes | None,
        *,
        connect_timeout_s: float,
        timeout_s: float,
        call: Callable[[Callable[[], Any], float], Any],
    ) -> None:
        self.store = store
        self.where = where
        self.layout = layout
        self.backend = backend
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._call = call  # a bounded store call (the channel's watchdog)
        self.refused = 0
        self.first_problem = ""
        self._logged: set[str] = set()

    def pair(self, mine: dict[str, Any]) -> tuple[dict[str, Any], Session]:
        """Announce ``mine``, then answer hellos until a valid consumer; P2pHandshakeError after the timeout."""
        self._call(lambda: self.store.set(PRODUCER_HELLO, hs.json_text(mine)), self.connect_timeout_s)
        deadline = time.monotonic() + self.connect_timeout_s
        while time.monotonic() < deadline:
            raw = self._call(lambda: pop_hello(self.store), self.timeout_s)
            if raw is None:
                time.sleep(POLL_S)
                continue
            try:
                peer = hs.parse_hello(raw, CONSUMER_RANK)
            except ValueError as exc:
                self._refuse(None, f"the peer's hello is malformed: {exc}")
                continue
            problems = self._check(mine, peer, deadline)
            if problems:
                self._refuse(peer["nonce"], "; ".join(problems))
                continue
            self._call(partial(self.store.set, verdict_key(peer["nonce"]), OK), self.timeout_s)
            key = hs.session_key(self.token, mine, peer) if self.token is not None else None
            return peer, Session(key)
        why = f"; refused {self.refused} peer(s), the first: {self.first_problem}" if self.refused else ""
        raise P2pHandshakeError(
            f"p2p producer (rank {PRODUCER_RANK}) on {self.where} found no valid consumer within "
            f"KVDI_P2P__CONNECT_TIMEOUT_S={self.connect_timeout_s}{why}; start the consumer with the same "
            "KVDI_P2P__KV_IP / KVDI_P2P__KV_PORT (and KVDI_P2P__AUTH_TOKEN)"
        )

    def _check(self, mine: dict[str, Any], peer: dict[str, Any], deadline: float) -> list[str]:
        proof: bytes | None = None
        if self.token is not None and peer["auth"]:
            nonce = peer["nonce"]
            mine_proofs = hs.json_text(hs.proofs(self.token, mine, peer, self.layout.fingerprint()))
            self._call(lambda: self.store.set(proof_key(PRODUCER_RANK, nonce), mine_proofs), self.timeout_s)
            wait_s = max(0.0, min(self.timeout_s, deadline - time.monotonic()))
            try:
                proof = self._call(
                    lambda: poll_first(self.store, [proof_key(CONSUMER_RANK, nonce)], wait_s)[1], wait_s + 1.0
                )
            except TimeoutError:
                return ["the peer sent no proof within KVDI_P2P__TIMEOUT_S"]
        problems = hs.auth_problems(mine, peer, proof, self.token, self.layout)
        return problems or hs.handshake_problems(mine, peer, self.backend)

    def _refuse(self, nonce: str | None, problem: str) -> None:
        self.refused += 1
        self.first_problem = self.first_problem or problem
        log_once(
            logger,
            self._logged,
            problem.split(":")[0],
            "p2p producer on %s refused a peer and keeps waiting for a valid consumer: %s",
            self.where,
            problem,
        )
        if nonce is not None:
            self._call(lambda: self.store.set(verdict_key(nonce), REFUSED), self.timeout_s)


def consumer_pair(
    store: Store,
    where: str,
    mine: dict[str, Any],
    layout: KVCacheSpec,
    backend: str,
    token: bytes | None,
    *,
    connect_timeout_s: float,
    call: Callable[[str, Callable[[], Any]], Any],
) -> tuple[dict[str, Any], Session]:
    """The consumer's side: read the producer's hello, queue ``mine``, prove the token, await the verdict.

    ``call(what, fn)`` runs a store call bounded by ``connect_timeout_s`` (the channel's ``_setup``).
    """
    raw = call("waiting for its peer", lambda: poll_first(store, [PRODUCER_HELLO], connect_timeout_s)[1])
    try:
        peer = hs.parse_hello(raw, PRODUCER_RANK)
    except ValueError as exc:
        raise hs.refuse(where, [f"the peer's hello is malformed: {exc}"]) from None
    if peer["auth"] != mine["auth"]:  # seen from the hello alone: nothing to send
        raise hs.refuse(where, hs.auth_problems(mine, peer, None, token, layout))
    nonce = mine["nonce"]
    call("announcing itself", lambda: store.queue_push(HELLO_QUEUE, hs.json_text(mine)))
    proof: bytes | None = None
    verdict = ""
    waiting = [verdict_key(nonce)]
    if token is not None:
        mine_proofs = hs.json_text(hs.proofs(token, mine, peer, layout.fingerprint()))
        call("proving the token", lambda: store.set(proof_key(CONSUMER_RANK, nonce), mine_proofs))
        got_key, value = call(
            "waiting for its peer's proof",
            lambda: poll_first(store, [proof_key(PRODUCER_RANK, nonce), verdict_key(nonce)], connect_timeout_s),
        )
        if got_key != verdict_key(nonce):
            proof = value
        else:
            waiting = []
            verdict = value.decode(errors="replace")
    problems = hs.auth_problems(mine, peer, proof, token, layout) if proof is not None or token is None else []
    problems = problems or hs.handshake_problems(mine, peer, backend)
    if problems:
        raise hs.refuse(where, problems)
    if waiting:
        answer = call("waiting for the producer's answer", lambda: poll_first(store, waiting, connect_timeout_s)[1])
        verdict = answer.decode(errors="replace")
    if verdict == BUSY:
        raise hs.refuse(where, ["the producer is already paired with a consumer (one consumer per producer)"])
    if verdict != OK:
        raise hs.refuse(where, ["the producer refused this consumer (see the producer's log)"])
    key = hs.session_key(token, mine, peer) if token is not None else None
    return peer, Session(key)


__all__ = ["HELLO_QUEUE", "ProducerPairing", "answer_busy", "consumer_pair", "pop_hello"]
