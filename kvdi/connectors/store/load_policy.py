"""How a store connector's hits load under ``transfer.async_load``, decided in one place (:class:`LoadPolicy`).

Three ways to load a hit: **sync** (before the forward pass, in the step that needs it),
**background** (beside the compute, reported in the step it finishes: ``load_async``) and
**prefetch** (fetched into host staging at lookup while the request waits holding no block,
then loaded synchronously from there; only with a host that relays the worker's reports, the
vLLM adapter). ``on`` and ``off`` pick background and sync; ``prefetch`` asks for prefetch;
``auto`` (the default) decides per store, once, at start:

- prefetch, where the host can run it, for a store that says it is remote
  (``prefers_async_load``) or whose lookup round trip measures :data:`AUTO_PREFETCH_LOOKUP_S`
  or more (the fastest of five lookups of a key no store holds);
- otherwise background for a store that says it is remote or a hit of
  :data:`ASYNC_LOAD_MIN_BYTES` or more, sync for the rest.

:meth:`LoadPolicy.describe` says what was decided and why, in one line the host logs once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kvdi.connectors.store.prefetch import lookup_round_trip
from kvdi.connectors.store.protocol import BlockStore, prefers_async_load

if TYPE_CHECKING:
    from kvdi.settings import TransferSettings

ASYNC_LOAD_MIN_BYTES = 16 << 20
"""Under ``async_load=auto``, a hit at least this large loads asynchronously even from a local store:
reading and verifying it (about 2-4 GB/s here) takes longer than the step of latency an async load adds."""

AUTO_PREFETCH_LOOKUP_S = 1e-3
"""Under ``async_load=auto`` with a host that relays prefetch reports (vLLM): a store that says it is remote
(``prefers_async_load``) or whose lookup round trip (the fastest of 5 at start) takes at least this long (a store
across a network) loads its hits through prefetch at lookup. Measured (``benchmarks/vllm/bench_remote.py``, Redis
behind a proxy): on loopback a synchronous load is the cheapest; at 1 and 5 ms each way prefetch's loading round
stays within 1.0x of (local hit + raw transfer) where a synchronous one takes 1.05x and 1.71x and stalls the tail
of running requests' inter-token latency (p90 2.6x at 5 ms)."""

AUTO_ASYNC_LOOKUP_S = 1e-3
"""Under ``scheduler.lookup=auto`` with a host that asks again (vLLM): a store that says it is remote
(``prefers_async_load``) or whose lookup round trip (the fastest of 5 at start, the measurement ``async_load=auto``
uses) takes at least this long is looked up in the background (:mod:`.lookups`), off the scheduler's step; a faster
(local) store is asked inside it, where one call costs less than the step of latency an asynchronous answer adds."""

Way = Literal["sync", "background", "prefetch"]


def auto_way(remote: bool, lookup_s: float | None, hit_bytes: int, prefetch_here: bool) -> Way:
    """``auto``'s rule, its one copy: how a hit of ``hit_bytes`` loads from a store that says it is ``remote`` (or
    not) and whose lookup took ``lookup_s`` (None: not measured), where prefetch can run (``prefetch_here``) or not."""
    if prefetch_here and (remote or (lookup_s or 0.0) >= AUTO_PREFETCH_LOOKUP_S):
        return "prefetch"
    return "background" if remote or hit_bytes >= ASYNC_LOAD_MIN_BYTES else "sync"


class LoadPolicy:
    """The ``transfer.async_load`` decision for one store: which way hits load, and why.

    :meth:`background` answers per hit (sync or background); :meth:`decide_prefetch` is called
    at most once, by a host that can relay prefetch reports, and may turn prefetch on.
    """

    def __init__(self, transfer: TransferSettings, store: BlockStore, block_bytes: int) -> None:
        self.setting = transfer.async_load
        self.prefetch_max_bytes = transfer.prefetch_max_bytes
        self.block_bytes = block_bytes
        self._store = store
        self.remote = prefers_async_load(store)  # declared by the store; measured too by decide_prefetch
        self.lookup_s: float | None = None  # the store's lookup round trip, once measured under auto
        self.prefetch = False
        self._unavailable: str | None = None  # why prefetch cannot run here, as the host said
        self._decided = False
        self._measured = False
        self.lookup_async = False  # lookups run in the background (decide_lookup)
        self._lookup_why = "no host that asks again"

    def _round_trip(self) -> float | None:
        """The store's lookup round trip, measured once (shared by the prefetch and the lookup decisions)."""
        if not self._measured:
            self._measured, self.lookup_s = True, lookup_round_trip(self._store)
        return self.lookup_s

    def decide_lookup(self, setting: str, unavailable: str | None = None) -> bool:
        """``scheduler.lookup`` for a host that asks again; ``unavailable``: why lookups cannot leave the step there
        (None: they can). True when lookups run in the background (:mod:`.lookups`)."""
        if unavailable is not None:
            self.lookup_async, self._lookup_why = False, f"sync: {unavailable}"
        elif setting in ("sync", "async"):
            self.lookup_async, self._lookup_why = setting == "async", f"{setting}: scheduler.lookup={setting}"
        elif self.remote:
            self.lookup_async, self._lookup_why = True, "async: auto, a store that says it is remote"
        else:
            rtt = self._round_trip()
            self.lookup_async = rtt is not None and rtt >= AUTO_ASYNC_LOOKUP_S
            shown = "?" if rtt is None else f"{rtt * 1e3:.2f} ms"
            self._lookup_why = f"{'async' if self.lookup_async else 'sync'}: auto, store lookup {shown}"
        return self.lookup_async

    def describe_lookup(self) -> str:
        """One line: whether lookups leave the scheduler's step, and why."""
        where = "in the background, batched per step" if self.lookup_async else "inside the scheduler's step"
        return f"store lookups {where} ({self._lookup_why})"

    def background(self, num_blocks: int) -> bool:
        """Whether a hit of ``num_blocks`` that is not prefetched loads in the background (else synchronously)."""
        if self.setting in ("on", "off"):
            return self.setting == "on"  # prefetch without a host that relays its reports, or past its bound: auto
        return auto_way(self.remote, None, num_blocks * self.block_bytes, prefetch_here=False) == "background"

    def decide_prefetch(self, unavailable: str | None = None) -> bool:
        """Called once by a host that relays prefetch reports; ``unavailable``: why prefetch cannot run there
        (None: it can). True when hits prefetch at lookup from now on; the answer of the first call stands."""
        if not self._decided:
            self._decided, self._unavailable = True, unavailable
            if unavailable is None and self.setting == "prefetch":
                self.prefetch = True
            elif unavailable is None and self.setting == "auto":
                self.lookup_s = self._round_trip()
                self.prefetch = auto_way(self.remote, self.lookup_s, 0, prefetch_here=True) == "prefetch"
        return self.prefetch

    @property
    def way(self) -> Way:
        """How a small hit loads: prefetch, background or sync (large hits under auto load in the background)."""
        if self.prefetch:
            return "prefetch"
        return "background" if self.background(1) else "sync"

    @property
    def refused(self) -> bool:
        """``async_load=prefetch`` was asked for and the host cannot run it (a warning, not an error)."""
        return self.setting == "prefetch" and self._decided and not self.prefetch

    def describe(self) -> str:
        """One line: what was decided and why (the vLLM adapter logs it once per scheduler half)."""
        rtt = f"{self.lookup_s * 1e3:.2f} ms" if self.lookup_s is not None else None
        if self.prefetch:
            measured = f"; store lookup {rtt}" if rtt is not None else ""
            return (
                f"prefetch at lookup on (async_load={self.setting}{measured}; "
                f"host staging up to {self.prefetch_max_bytes} B)"
            )
        if self.refused:
            return f"transfer.async_load=prefetch is not available here ({self._unavailable}); hits load as with auto"
        if self.setting in ("on", "off"):
            how = "in the background" if self.setting == "on" else "synchronously"
            return f"async_load={self.setting}: every hit loads {how}"
        local = "a store that says it is remote: in the background" if self.remote else (
            f"a local store (lookup {rtt or '?'}): no prefetch; synchronous, in the background from "
            f"{ASYNC_LOAD_MIN_BYTES >> 20} MiB"
        )  # fmt: skip
        where = f"no prefetch here ({self._unavailable}); " if self._unavailable else ""
        return f"async_load=auto: {where}{local}"


__all__ = ["ASYNC_LOAD_MIN_BYTES", "AUTO_ASYNC_LOOKUP_S", "AUTO_PREFETCH_LOOKUP_S", "LoadPolicy", "Way", "auto_way"]
