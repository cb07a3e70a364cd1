"""The KV connector contract, split by role as in vLLM's ``KVConnectorBase_V1``.

A connector has two halves. The **scheduler half** (:class:`SchedulerConnector`) runs next
to the scheduler, never touches device memory, and decides which prompt tokens can be
loaded instead of recomputed. The **worker half** (:class:`WorkerConnector`) runs next to
the model, owns no policy, and moves the bytes between the paged KV cache and a store.
The scheduler half tells the worker half what to do each step through a
:class:`KVConnectorMetadata` object.

Per step, in order::

    scheduler: get_num_new_matched_tokens -> (allocate blocks) -> update_state_after_alloc
               -> build_connector_meta(SchedulerOutput)            [once per step]
    worker:    bind_connector_metadata -> start_load_kv -> per layer: wait_for_layer_load,
               (attention), save_kv_layer -> wait_for_save -> get_finished -> clear_connector_metadata
    scheduler: request_finished(request, block_ids)                [when a request ends]
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvdi.errors import ConnectorTypeError

if TYPE_CHECKING:
    import torch

    from kvdi.allocator import Staging
    from kvdi.connectors.store.load_policy import LoadPolicy
    from kvdi.connectors.store.prefetch import PrefetchPlanner
    from kvdi.connectors.store.protocol import BlockStore
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings


class KVConnectorRole(enum.Enum):
    """Which half of a connector an object is."""

    SCHEDULER = 0
    WORKER = 1


@dataclass(frozen=True)
class ConnectorContext:
    """Everything the container hands a connector half at construction.

    ``name`` is the registered connector name (key metrics by it); ``layout`` describes the
    paged KV cache and seeds block keys; ``options`` is the connector's own typed settings
    model (or None); ``backend`` is the object both halves of one engine share (a store, a
    pool, a client), built once per container by the spec's ``backend`` target, or None.
    ``staging`` (worker half only; None for the scheduler half) hands out staging buffers
    accounted by the engine's allocator: ``staging(nbytes, device="cpu", owner=None)`` returns
    a uint8 tensor of ``nbytes`` (host memory pinned when the cache is on CUDA and
    ``KVDI_ALLOCATOR__PIN_MEMORY`` is on). Take staging from here rather than ``torch.empty``.
    """

    name: str
    role: KVConnectorRole
    settings: KvdiSettings
    layout: KVCacheSpec
    options: Any = None
    backend: Any = None
    staging: Staging | None = None

    @property
    def engine_id(self) -> str:
        return self.settings.engine_id


@dataclass(frozen=True)
class KVRequest:
    """What a connector may know about a request: its id, prompt tokens and isolation salt."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``block_ids`` are all blocks the request holds, in token order. ``num_computed_tokens``
    counts tokens whose KV is in the paged cache before this step (loaded tokens included);
    this step computes tokens ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.
    """

    request: KVRequest
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """What the scheduler decided for one step, as connectors see it."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_req_ids: frozenset[str] = frozenset()


class KVConnectorMetadata:
    """Base of the per-step message from the scheduler half to the worker half."""


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move: ``block_ids[i]`` in the paged cache holds ``block_keys[i]``."""

    request_id: str
    block_ids: tuple[int, ...]
    block_keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_keys):
            raise ValueError("block_ids and block_keys must have the same length")


@dataclass(frozen=True)
class BlockTransferMetadata(KVConnectorMetadata):
    """The metadata most connectors use: blocks to load before the forward pass, blocks to save after."""

    loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()


@dataclass
class ConnectorStats:
    """Counters of one connector half; key them by the registered connector name."""

    lookups: int = 0
    lookup_hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    corrupt_dropped: int = 0
    load_failures: int = 0
    save_failures: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)

    def merge(self, other: ConnectorStats) -> ConnectorStats:
        """A new object with each counter summed."""
        mine, theirs = self.as_dict(), other.as_dict()
        return ConnectorStats(**{k: mine[k] + theirs[k] for k in mine})  # type: ignore[arg-type]

    @contextmanager
    def timed(self, counter: str) -> Iterator[None]:
        """Add the wall time of the block to ``counter`` (``load_seconds`` or ``save_seconds``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)


class _Half(ABC):
    """What both halves share: the context, a role, counters and shutdown."""

    ROLE: KVConnectorRole

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context
        self.stats = ConnectorStats()

    @property
    def role(self) -> KVConnectorRole:
        """The role this object was built for."""
        return self.context.role

    @property
    def name(self) -> str:
        """The registered connector name."""
        return self.context.name

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Called once by the owner when the engine shuts down."""


class SchedulerConnector(_Half):
    """Scheduler half: decides what to load and save; never allocates device memory."""

    ROLE = KVConnectorRole.SCHEDULER

    @abstractmethod
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called by the scheduler once for a waiting request, before allocating its blocks.

        Returns ``(n, load_async)``: how many prompt tokens beyond ``num_computed_tokens`` can
        be loaded (a multiple of the block size; never the whole prompt, the last token is
        always computed), and whether the load completes asynchronously. ``n`` None is "ask again"
        (a hit being prefetched into host staging): the request waits, holding no block, for a later
        step to ask again; only a :class:`PrefetchingScheduler` whose host enabled it answers None.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Called by the scheduler after it allocated ``block_ids`` for ``request``.

        ``num_external_tokens`` is the number the scheduler accepted from
        :meth:`get_num_new_matched_tokens` (0 if it decided not to load).
        """

    @abstractmethod
    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        """Called by the scheduler once per step, after scheduling; resets per-step state."""

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called by the scheduler when a request finishes, before its blocks are freed.

        Returns ``(delay_free, kv_transfer_params)``: if ``delay_free`` the scheduler keeps
        the blocks until the worker half reports the request in ``get_finished``.
        """
        return False, None


class WorkerConnector(_Half):
    """Worker half: moves KV between the paged cache and the store; no policy."""

    ROLE = KVConnectorRole.WORKER

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._metadata: KVConnectorMetadata | None = None
        self._load_errors: set[int] = set()

    @abstractmethod
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Called by the worker once, after the allocator created the paged cache (layer name -> tensor)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Called by the worker before each forward pass with the scheduler half's metadata."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called by the worker after each forward pass."""
        self._metadata = None

    @property
    def metadata(self) -> KVConnectorMetadata | None:
        """The metadata bound for the current step, if any."""
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Called by the worker before the forward pass: start copying the step's loads into the cache."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by the worker before a layer's attention: block until that layer's KV is in place."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Called by the worker after a layer's attention wrote its KV: may start saving it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called by the worker after the forward pass: block until this step's saves are durable."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called by the worker after each step: ids whose async (saves, loads) finished."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by the worker after ``start_load_kv``: block ids whose load failed; clears the set."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def report_load_error(self, block_ids: Sequence[int]) -> None:
        """For subclasses: mark blocks whose load failed so the engine recomputes (or fails) them."""
        self._load_errors.update(block_ids)


REMOTE_HIT_SOURCE = "external_unspecified"  # the hit source of what declares none (vLLM's EXTERNAL_UNSPECIFIED)


@runtime_checkable
class AsyncLoadMetadata(Protocol):
    """Step metadata with loads that finish in a later step (the store and p2p connectors' metadata)."""

    async_loads: tuple[BlockTransfer, ...]


@runtime_checkable
class DeclaresHitSource(Protocol):
    """A store or half naming, as a class attribute, vLLM's ``CacheHitSource`` of its hits (else the remote one)."""

    hit_source: str


@runtime_checkable
class StoreHalf(Protocol):
    """A half over one BlockStore: its host reads the store's capabilities through ``StoreCapabilities``."""

    store: BlockStore


@runtime_checkable
class PrefetchingScheduler(Protocol):
    """A scheduler half that can prefetch hits at lookup into host staging (answering "ask again" meanwhile), for a
    host that relays the worker half's :class:`PrefetchingWorker` reports back to :meth:`prefetched`."""

    prefetch: PrefetchPlanner | None  # the planner while prefetch is on (enable_prefetch said True)
    load_policy: LoadPolicy  # how hits load (sync, background, prefetch) and why: the host logs describe() once

    def enable_prefetch(self, unavailable: str | None = None) -> bool:
        """Called once by the host with why prefetch cannot run there (None: it can); True when lookups prefetch."""
        ...

    def prefetched(self, reports: Iterable[tuple[str, int]]) -> None:
        """The worker half's finished prefetches, ``(request id, leading blocks staged)``."""
        ...


@runtime_checkable
class PrefetchingWorker(Protocol):
    """A worker half that fetches hits into host staging ahead of their loads (the store worker half)."""

    def prefetch_reports(self) -> list[tuple[str, int]]:
        """Prefetches finished since the last call, ``(request id, leading blocks staged)``, for the scheduler."""
        ...


@runtime_checkable
class LoadWaiter(Protocol):
    """A worker half whose asynchronous loads an idle step may wait for (GIL released)."""

    def wait_for_loads(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until an asynchronous load (or prefetch) finishes; True once one did."""
        ...


@runtime_checkable
class PreemptionAware(Protocol):
    """A worker half with queued transfers that must finish before a preempted request's blocks are reused."""

    def handle_preemptions(self, preempted_req_ids: Collection[str] | None = None) -> None:
        """Finish the transfers of those requests (None: of every request) before the next forward pass."""
        ...


@runtime_checkable
class BlockEventSource(Protocol):
    """A worker half that can tell its host which blocks landed in its store and which it dropped as corrupt."""

    def watch_blocks(self, event: Callable[[bool, bytes], None]) -> None:
        """Call ``event(True, key)`` per save that landed whole, ``event(False, key)`` per object dropped as corrupt,
        from whichever thread did it (cheap, thread-safe). One watcher: a second call replaces the first."""
        ...


@runtime_checkable
class WorkerGauges(Protocol):
    """A worker half with gauges for its host's metrics."""

    @property
    def inflight_bytes(self) -> int: ...  # bytes of queued asynchronous saves

    @property
    def staged_bytes(self) -> int | None: ...  # bytes prefetches hold in host staging; None: no staging


def run_transfer_step(worker: WorkerConnector, metadata: KVConnectorMetadata) -> set[int]:
    """Drive one worker step with no model (benchmarks, tools): bind, load, save, clear.

    Returns the block ids whose load failed; the metadata is cleared even if a call raises.
    """
    worker.bind_connector_metadata(metadata)
    try:
        worker.start_load_kv()
        failed = worker.get_block_ids_with_load_errors()
        worker.wait_for_save()
    finally:
        worker.clear_connector_metadata()
    return failed


def require_role(connector: object, role: KVConnectorRole, component: str) -> None:
    """Raise ConnectorTypeError (a TypeError) unless ``connector`` is the ``role`` half; call it in ``__init__``."""
    base = SchedulerConnector if role is KVConnectorRole.SCHEDULER else WorkerConnector
    if not isinstance(connector, base) or connector.role is not role:
        got = getattr(connector, "role", None)
        raise ConnectorTypeError(
            f"{component} needs a {base.__name__} built for role {role.name}, "
            f"got {type(connector).__name__} (role {getattr(got, 'name', got)})"
        )


def loadable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """The most prompt tokens a connector may offer: full blocks, leaving the last token to compute."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size
