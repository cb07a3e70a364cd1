"""Pairing through the rendezvous store: the producer waits for a valid consumer; a bad peer is
refused without ending the wait, and bogus peers cannot delay a valid one.

Keys under ``kvdi/p2p/`` (the checks themselves live in :mod:`kvdi.connectors.p2p.handshake`):

- ``hello/0``: the producer's hello, set once.
- ``hellos``: a queue; each would-be consumer pushes its hello (with a fresh nonce ``N``).
- ``proof/0/N``, ``proof/1/N``: with an auth token, both sides' proofs for that consumer.
- ``verdict/0/N``: the producer's answer to consumer ``N``: ``ok``, ``refused`` or ``busy``
  (the producer is already paired; its serving loop answers late hellos with :func:`answer_busy`).
  With an auth token ``ok`` carries a MAC (``ok:<hex>``, :func:`~.handshake.verdict_mac`).

The producer answers hellos concurrently: it drains the queue, answers each authenticating
hello with its proof at once, and keeps up to :data:`MAX_PENDING` peers waiting for their
proof, each for at most ``timeout_s``; the first peer whose proof and hello check out is paired.
A malformed hello, a peer without the token, with another token, layout or backend, or one that
never sends its proof is refused (counted in :attr:`ProducerPairing.refused`, logged once per
reason); ten (or a thousand) hellos that never prove anything delay a valid consumer by one poll,
not by ``timeout_s`` each. Only after ``connect_timeout_s`` without a valid consumer does the
producer raise :class:`P2pHandshakeError`.

A consumer with a token trusts nothing it has not verified: it needs the producer's proof
(``HMAC(token, ...)`` over both nonces) before it reads any verdict, and an ``ok`` whose MAC does
not verify is ignored (an ``ok`` written by anyone without the token cannot pair it). Negative
verdicts (``refused``, ``busy``) are taken as they come: they can only make the consumer give
up, which anyone who reaches the store can cause anyway. A consumer raises
:class:`P2pHandshakeError` at once on what it can see itself (a peer that authenticates
differently, a proof that does not verify, a foreign layout) or on the producer's refusal.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
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
MAX_PENDING = 256
"""Peers that sent a hello and whose proof the producer still awaits; past this the oldest is refused."""
HELLOS_PER_ROUND = 64


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


@dataclass
class _Pending:
    peer: dict[str, Any]
    expires: float


class ProducerPairing:
    """The producer's side: answer hellos (concurrently) until one makes a valid pair."""

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
        self._pending: dict[str, _Pending] = {}

    def pair(self, mine: dict[str, Any]) -> tuple[dict[str, Any], Session]:
        """Announce ``mine``, then answer hellos until a valid consumer; P2pHandshakeError after the timeout."""
        self._call(lambda: self.store.set(PRODUCER_HELLO, hs.json_text(mine)), self.connect_timeout_s)
        deadline = time.monotonic() + self.connect_timeout_s
        while time.monotonic() < deadline:
            found = self._call(partial(self._round, mine), self.timeout_s)
            if found is not None:
                self._call(self._answer_rest, self.timeout_s)
                key = hs.session_key(self.token, mine, found) if self.token is not None else None
                return found, Session(key)
        why = f"; refused {self.refused} peer(s), the first: {self.first_problem}" if self.refused else ""
        raise P2pHandshakeError(
            f"p2p producer (rank {PRODUCER_RANK}) on {self.where} found no valid consumer within "
            f"KVDI_P2P__CONNECT_TIMEOUT_S={self.connect_timeout_s}{why}; start the consumer with the same "
            "KVDI_P2P__KV_IP / KVDI_P2P__KV_PORT (and KVDI_P2P__AUTH_TOKEN)"
        )

    def _round(self, mine: dict[str, Any]) -> dict[str, Any] | None:
        """One pass: take up to HELLOS_PER_ROUND new hellos, then look at every waiting peer's proof.
        Returns the paired peer (its ``ok`` already sent), or None after a short sleep."""
        took = 0
        while took < HELLOS_PER_ROUND and (raw := pop_hello(self.store)) is not None:
            took += 1
            try:
                peer = hs.parse_hello(raw, CONSUMER_RANK)
            except ValueError as exc:
                self._refuse(None, f"the peer's hello is malformed: {exc}")
                continue
            if self.token is not None and peer["auth"]:
                self._await_proof(mine, peer)
            elif self._settle(mine, peer, None):
                return peer
        now = time.monotonic()
        for nonce, pending in list(self._pending.items()):
            key = proof_key(CONSUMER_RANK, nonce)
            if self.store.check([key]):
                del self._pending[nonce]
                if self._settle(mine, pending.peer, bytes(self.store.get(key))):
                    return pending.peer
            elif now >= pending.expires:
                del self._pending[nonce]
                self._refuse(nonce, "the peer sent no proof within KVDI_P2P__TIMEOUT_S")
        if not took:
            time.sleep(POLL_S)
        return None

    def _await_proof(self, mine: dict[str, Any], peer: dict[str, Any]) -> None:
        nonce = peer["nonce"]
        if nonce in self._pending:
            return  # the same hello twice: one wait is enough
        if len(self._pending) >= MAX_PENDING:
            oldest = min(self._pending, key=lambda n: self._pending[n].expires)
            del self._pending[oldest]
            self._refuse(oldest, f"more than {MAX_PENDING} peers waited for their proof at once")
        assert self.token is not None
        proofs = hs.proofs(self.token, mine, peer, self.layout.fingerprint())
        self.store.set(proof_key(PRODUCER_RANK, nonce), hs.json_text(proofs))
        self._pending[nonce] = _Pending(peer, time.monotonic() + self.timeout_s)

    def _settle(self, mine: dict[str, Any], peer: dict[str, Any], proof: bytes | None) -> bool:
        """Check a peer whose proof (if any) is in; answer it ``ok`` (True) or ``refused`` (False)."""
        problems = hs.auth_problems(mine, peer, proof, self.token, self.layout)
        problems = problems or hs.handshake_problems(mine, peer, self.backend)
        if problems:
            self._refuse(peer["nonce"], "; ".join(problems))
            return False
        ok = OK if self.token is None else f"{OK}:{hs.verdict_mac(self.token, mine, peer)}"
        self.store.set(verdict_key(peer["nonce"]), ok)
        return True

    def _answer_rest(self) -> None:
        """Paired: the peers still waiting for their proof are answered ``busy``."""
        for nonce in list(self._pending):
            self.store.set(verdict_key(nonce), BUSY)
        self._pending.clear()

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
            self.store.set(verdict_key(nonce), REFUSED)


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
    deadline = time.monotonic() + connect_timeout_s
    raw = call("waiting for its peer", lambda: poll_first(store, [PRODUCER_HELLO], connect_timeout_s)[1])
    try:
        peer = hs.parse_hello(raw, PRODUCER_RANK)
    except ValueError as exc:
        raise hs.refuse(where, [f"the peer's hello is malformed: {exc}"]) from None
    if peer["auth"] != mine["auth"]:  # seen from the hello alone: nothing to send
        raise hs.refuse(where, hs.auth_problems(mine, peer, None, token, layout))
    nonce = mine["nonce"]
    call("announcing itself", lambda: store.queue_push(HELLO_QUEUE, hs.json_text(mine)))
    if token is not None:
        mine_proofs = hs.json_text(hs.proofs(token, mine, peer, layout.fingerprint()))
        call("proving the token", lambda: store.set(proof_key(CONSUMER_RANK, nonce), mine_proofs))
        proof = call("waiting for its peer's proof", lambda: _producer_proof(store, where, nonce, deadline))
        problems = hs.auth_problems(mine, peer, proof, token, layout)
    else:
        problems = hs.auth_problems(mine, peer, None, token, layout)
    problems = problems or hs.handshake_problems(mine, peer, backend)
    if problems:
        raise hs.refuse(where, problems)
    expected = OK if token is None else f"{OK}:{hs.verdict_mac(token, peer, mine)}"
    call("waiting for the producer's answer", lambda: _verdict(store, where, nonce, expected, deadline))
    key = hs.session_key(token, mine, peer) if token is not None else None
    return peer, Session(key)


def _negative(where: str, verdict: str) -> P2pHandshakeError | None:
    if verdict == BUSY:
        return hs.refuse(where, ["the producer is already paired with a consumer (one consumer per producer)"])
    if verdict == REFUSED:
        return hs.refuse(where, ["the producer refused this consumer (see the producer's log)"])
    return None


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no valid answer from the producer within KVDI_P2P__CONNECT_TIMEOUT_S")
    return left


def _producer_proof(store: Store, where: str, nonce: str, deadline: float) -> bytes:
    """The producer's proof for this consumer; a negative verdict before it ends the wait, an ``ok`` before
    it cannot come from the producer (it always proves first) and is dropped."""
    while True:
        key, value = poll_first(store, [proof_key(PRODUCER_RANK, nonce), verdict_key(nonce)], _remaining(deadline))
        if key != verdict_key(nonce):
            return value
        error = _negative(where, value.decode(errors="replace"))
        if error is not None:
            raise error
        store.delete_key(key)  # an unproven "ok": not the producer's
        time.sleep(POLL_S)


def _verdict(store: Store, where: str, nonce: str, expected: str, deadline: float) -> None:
    """Wait for the producer's verdict: ``expected`` (a verified ``ok``) returns; a negative verdict raises;
    anything else (a forged ``ok``) is dropped and the wait goes on until the deadline."""
    while True:
        key, value = poll_first(store, [verdict_key(nonce)], _remaining(deadline))
        verdict = value.decode(errors="replace")
        if hmac.compare_digest(verdict.encode(), expected.encode()):
            return
        error = _negative(where, verdict)
        if error is not None:
            raise error
        store.delete_key(key)
        time.sleep(POLL_S)


__all__ = ["HELLO_QUEUE", "MAX_PENDING", "ProducerPairing", "answer_busy", "consumer_pair", "pop_hello"]
