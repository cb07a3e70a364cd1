"""The p2p channel: rendezvous store, handshake, a two-rank process group, and the consumer's side
of the fetch protocol. The producer's side runs in :mod:`kvdi.connectors.p2p.serving`.

The producer (rank 0) hosts a ``TCPStore`` on ``kv_ip:kv_port`` (bound there only); the
consumer (rank 1) connects to it. Protocol (store keys under ``kvdi/p2p/``, messages in
:mod:`kvdi.connectors.p2p.protocol`):

- handshake (:mod:`kvdi.connectors.p2p.pairing`, checks in :mod:`kvdi.connectors.p2p.handshake`):
  hellos, optional HMAC proofs of the auth token, layout and backend checks; a mismatch raises
  :class:`P2pHandshakeError` on the consumer before any process group exists, while the
  producer refuses that peer and waits for a valid one up to ``connect_timeout_s``.
- publish: the producer sets ``has/<name>`` for every block it holds and deletes it when the
  block is freed; the consumer counts a prompt's published prefix with ``check`` (a binary
  search, so a few round trips per prompt).
- fetch: the consumer pushes a request onto the ``requests`` queue; the producer answers over
  the process group with a small header tensor (layer bytes, one found-flag per key, the frame
  headers of the found blocks) and then each layer of the found blocks as uint8 messages of a
  few MiB (which the consumer can receive straight into its paged cache). The consumer then
  pushes an acknowledgement and the producer frees those blocks (they also expire after
  ``hold_s``).

Failure model: starting up waits at most ``connect_timeout_s``; every lookup and fetch after
that at most ``timeout_s`` (store reads run on a watchdog thread because a frozen store server
never answers them; gloo sends and receives take a timeout). The first failure marks the
channel broken for good: the consumer then reports no matches and its loads fail at once, so
the engine recomputes; a broken producer unpublishes everything. One producer serves one
consumer; neither reconnects (restart both to pair again).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist

from kvdi.connectors.p2p import handshake as hs
from kvdi.connectors.p2p.errors import P2pHandshakeError, P2pTransferError
from kvdi.connectors.p2p.groups import close_group, drain, make_group, settle, wait_work
from kvdi.connectors.p2p.held import Frames, HeldBlocks
from kvdi.connectors.p2p.lookup import PAIRED_KEY, count_published
from kvdi.connectors.p2p.pairing import ProducerPairing, consumer_pair
from kvdi.connectors.p2p.protocol import (
    CONSUMER_RANK,
    PART_BYTES,
    PREFIX,
    PRODUCER_RANK,
    REQUEST_QUEUE,
    Ack,
    Request,
    Session,
    tag,
)
from kvdi.connectors.p2p.rendezvous import host_store, join_store, require_token
from kvdi.connectors.p2p.serving import Server
from kvdi.connectors.p2p.watchdog import Watchdog
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.settings import P2pSettings

if TYPE_CHECKING:  # torch.distributed re-exports it at run time only
    from torch._C._distributed_c10d import TCPStore

    from kvdi.layout import KVCacheSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")
Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class Answer:
    """The producer's answer to one fetch: which keys it holds, their frame headers, the deadline."""

    seq: int
    found: tuple[bool, ...]
    headers: torch.Tensor  # uint8, HEADER_SIZE per found block, in key order (host)
    deadline: float

    @property
    def count(self) -> int:
        return sum(self.found)


class P2pChannel:
    """One end of a producer/consumer pair; both connector halves of an engine share it."""

    def __init__(
        self,
        options: P2pSettings,
        layout: KVCacheSpec,
        *,
        producer: bool,
        backend: Backend,
        device: str,
        engine_id: str,
        wire_budget: int = 64 << 20,
    ) -> None:
        """``wire_budget``: the producer's bytes of device copies in flight while it answers a fetch over
        NCCL (``allocator.max_staging_bytes``; :class:`~kvdi.connectors.p2p.serving.Server`)."""
        self.options = options
        self.layout = layout
        self.producer = producer
        self.backend = backend
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = PRODUCER_RANK if producer else CONSUMER_RANK
        self.layer_bytes = layout.layer_block_bytes
        self.held = HeldBlocks(options.hold_s, options.max_held_bytes)
        self._token = options.auth_token.get_secret_value().encode() if options.auth_token else None
        require_token(options.kv_ip, self._token is not None)  # off loopback, a token is not optional
        self._timeout = timedelta(seconds=options.timeout_s)
        self._connect_timeout = timedelta(seconds=options.connect_timeout_s)
        self._broken: str | None = None
        self._seq = 0
        self._watchdog = Watchdog()
        self._pairing: ProducerPairing | None = None
        self._store = self._setup("connecting to the rendezvous store", self._connect)
        self._peer, self.session = self._handshake(engine_id)
        self._pg = self._setup("creating the process group", self._make_group)
        self._server: Server | None = None
        if producer:
            self._server = Server(
                self._store, self._pg, self.held, self.session,
                layer_bytes=self.layer_bytes, parts=self._parts, wire=self._wire,
                timeout_s=options.timeout_s, hold_s=options.hold_s, on_break=self._break, backend=backend,
                wire_budget=wire_budget if backend == "nccl" else None,
            )  # fmt: skip
            self._server.start()

    # -- setup --------------------------------------------------------------------
    @property
    def where(self) -> str:
        return f"{self.options.kv_ip}:{self.options.kv_port}"

    @property
    def refused_peers(self) -> int:
        """Producer: would-be consumers its handshake refused before pairing (0 on a consumer)."""
        return self._pairing.refused if self._pairing is not None else 0

    @property
    def rejected_messages(self) -> int:
        """Producer: bad request messages its serving loop dropped so far (0 on a consumer)."""
        return self._server.rejected if self._server is not None else 0

    def _setup(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return self._watchdog.call(fn, self.options.connect_timeout_s)
        except P2pHandshakeError:
            raise
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise P2pHandshakeError(
                f"p2p {'producer' if self.producer else 'consumer'} (rank {self.rank}) failed {what} on {self.where} "
                f"within KVDI_P2P__CONNECT_TIMEOUT_S={self.options.connect_timeout_s}: {str(exc).splitlines()[0]}; "
                "start both processes with the same KVDI_P2P__KV_IP / KVDI_P2P__KV_PORT, producer on rank 0"
            ) from None

    def _connect(self) -> TCPStore:
        o = self.options
        if self.producer:
            return host_store(o.kv_ip, o.kv_port, self._connect_timeout)
        return join_store(o.kv_ip, o.kv_port, self._connect_timeout)

    def _handshake(self, engine_id: str) -> tuple[dict[str, Any], Session]:
        """Pair (see :mod:`kvdi.connectors.p2p.pairing`): the producer waits for a valid consumer."""
        auth = self._token is not None
        mine = hs.make_hello(rank=self.rank, backend=self.backend, layout=self.layout, engine_id=engine_id, auth=auth)
        o = self.options
        if not self.producer:
            paired = consumer_pair(
                self._store, self.where, mine, self.layout, self.backend, self._token,
                connect_timeout_s=o.connect_timeout_s, call=self._setup,
            )  # fmt: skip
            # for a scheduler half in another process (kvdi.connectors.p2p.lookup): the hello is public anyway
            self._setup("announcing the pairing", lambda: self._store.set(PAIRED_KEY, hs.json_text(mine)))
            return paired
        self._pairing = ProducerPairing(
            self._store, self.where, self.layout, self.backend, self._token,
            connect_timeout_s=o.connect_timeout_s, timeout_s=o.timeout_s, call=self._watchdog.call,
        )  # fmt: skip
        try:
            return self._pairing.pair(mine)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise P2pHandshakeError(
                f"p2p producer (rank {self.rank}) failed waiting for a consumer on {self.where}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None

    def _make_group(self) -> Any:
        store = dist.PrefixStore(PREFIX + "pg", self._store)  # type: ignore[attr-defined]
        deadline = time.monotonic() + self.options.connect_timeout_s
        return make_group(
            self.backend, store, self.rank, timeout=self._timeout, device=self.device, host=self.options.kv_ip,
            deadline=deadline,
        )  # fmt: skip

    # -- state --------------------------------------------------------------------
    @property
    def broken(self) -> str | None:
        """Why the channel stopped working, or None while it works."""
        return self._broken

    def _break(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
            logger.warning("p2p channel on %s is broken, transfers stop (engine recomputes): %s", self.where, reason)

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor on the device the process group moves data from (NCCL needs CUDA)."""
        return tensor.to(self.device) if self.backend == "nccl" else tensor

    @property
    def wire_device(self) -> torch.device:
        """Where tensors handed to :meth:`receive` must live: the CPU for gloo, the GPU for NCCL."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _parts(self, count: int) -> list[tuple[int, int, int]]:
        """``(layer, first, stop)`` of every message of a batch of ``count`` blocks, in sending order."""
        step = max(1, PART_BYTES // self.layer_bytes)
        return [
            (layer, a, min(a + step, count)) for layer in range(self.layout.num_layers) for a in range(0, count, step)
        ]

    # -- consumer -----------------------------------------------------------------
    def count_published(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the producer holds; 0 once broken."""
        if self._broken is not None or not keys:
            return 0
        try:
            return count_published(self._store, self.session, keys, self._watchdog.call, self.options.timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            self._break(f"lookup failed: {str(exc).splitlines()[0]}")
            return 0

    def request(self, keys: Sequence[bytes]) -> Answer:
        """Ask the producer for ``keys``; then :meth:`receive` the layers and :meth:`finish`.

        Raises P2pTransferError within ``timeout_s`` on any failure (the channel is then broken).
        """
        if self._broken is not None:
            raise P2pTransferError(f"p2p channel on {self.where} is broken: {self._broken}")
        self._seq += 1
        seq, n = self._seq, len(keys)
        deadline = time.monotonic() + self.options.timeout_s
        with self._failing(seq, n):
            message = self.session.encode(Request(seq, tuple(self.session.name(k) for k in keys)))
            self._watchdog.call(lambda: self._store.queue_push(REQUEST_QUEUE, message), deadline - time.monotonic())
            header = torch.empty(8 + n * (1 + HEADER_SIZE), dtype=torch.uint8)
            wire = self._wire(header)
            self._wait(self._pg.recv([wire], PRODUCER_RANK, tag(seq, 0)), deadline)
            header = wire.cpu()
            layer_bytes = int(header[:8].view(torch.int64).item())
            if layer_bytes != self.layer_bytes:
                raise RuntimeError(
                    f"producer sends {layer_bytes} B per layer block, this layout needs {self.layer_bytes} B"
                )
            found = tuple(bool(f) for f in header[8 : 8 + n].tolist())
            headers = header[8 + n : 8 + n + sum(found) * HEADER_SIZE]
        return Answer(seq, found, headers, deadline)

    def receive(
        self, answer: Answer, buffers: Sequence[torch.Tensor], on_part: Callable[[int, int, int], None]
    ) -> None:
        """Receive layer ``l`` of every found block into ``buffers[l]`` (contiguous uint8 on :attr:`wire_device`).

        Each layer comes in parts of a few MiB, all posted at once; ``on_part(layer, first,
        stop)`` runs as soon as blocks ``[first, stop)`` of that layer are in (still in the CPU
        cache), while later parts are still arriving. On any failure (a part's wait, or ``on_part``)
        every receive still posted is settled before this raises (:func:`~kvdi.connectors.p2p.groups.settle`):
        nothing lands in ``buffers`` after it returns.
        """
        lb = self.layer_bytes
        with self._failing(answer.seq, len(answer.found)):
            posted, waited = [], 0
            try:
                for part, (layer, a, b) in enumerate(self._parts(answer.count), start=1):
                    piece = buffers[layer][a * lb : b * lb]
                    posted.append((layer, a, b, self._pg.recv([piece], PRODUCER_RANK, tag(answer.seq, part))))
                for layer, a, b, work in posted:
                    waited += 1  # a gloo work is waited once: a second wait blocks until it times out
                    self._wait(work, answer.deadline)
                    on_part(layer, a, b)
            except BaseException:
                settle([work for *_, work in posted[waited:]], answer.deadline, self.backend)
                raise

    def finish(self, answer: Answer) -> None:
        """Tell the producer this fetch is over (it frees the blocks); ends the fetch begun by :meth:`request`."""
        if self._broken is None:
            message = self.session.encode(Ack(answer.seq))
            with self._failing(answer.seq, len(answer.found)):
                self._watchdog.call(lambda: self._store.queue_push(REQUEST_QUEUE, message), self.options.timeout_s)

    @contextlib.contextmanager
    def _failing(self, seq: int, n: int) -> Iterator[None]:
        """Turn any failure into P2pTransferError and break the channel."""
        try:
            yield
        except (RuntimeError, TimeoutError) as exc:
            reason = f"fetch {seq} of {n} blocks failed: {str(exc).splitlines()[0]}"
            self._break(reason)
            drain(self._pg)  # receives still posted must not land late in blocks the engine recomputes
            raise P2pTransferError(reason) from None

    def _wait(self, work: Any, deadline: float) -> None:
        wait_work(work, deadline, self.backend)

    # -- producer -----------------------------------------------------------------
    def hold(self, keys: Sequence[bytes], frames: Frames) -> int:
        """Hold framed blocks and publish their keys; returns how many keys were newly published."""
        if self._broken is not None:
            return 0
        new, evicted = self.held.hold([self.session.name(k) for k in keys], frames)
        try:
            if new:
                published = [self.session.published(n) for n in new]
                self._store.multi_set(published, ["1"] * len(new))  # type: ignore[attr-defined]
            for name in evicted:
                self._store.delete_key(self.session.published(name))
        except RuntimeError as exc:
            self._break(f"publishing failed: {str(exc).splitlines()[0]}")
            return 0
        return len(new)

    # -- shutdown -----------------------------------------------------------------
    def stop_serving(self) -> None:
        """Producer: stop answering fetches. Held blocks stay published until :meth:`close`, so a
        consumer that asks meanwhile times out after ``timeout_s`` and recomputes."""
        if self._server is not None:
            self._server.stop(self.options.timeout_s + 1.0)

    def close(self) -> None:
        """Stop serving, unpublish and free held blocks, release the process group (NCCL: aborted). Idempotent."""
        self.stop_serving()
        with contextlib.suppress(RuntimeError):
            for name in self.held.clear():
                self._store.delete_key(self.session.published(name))
        close_group(self._pg, self.backend)
        self._pg = None
        self._broken = self._broken or "closed"


__all__ = ["Answer", "P2pChannel"]
