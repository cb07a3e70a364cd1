"""The p2p channel: a TCPStore rendezvous, a layout handshake, and a two-rank process group.

The producer (rank 0) hosts a ``TCPStore`` on ``kv_ip:kv_port``; the consumer (rank 1)
connects to it. Protocol, all keys under ``kvdi/p2p/``:

- handshake: each side sets ``hello/<rank>`` (role, backend, layout, fingerprint) and
  reads the other's; a different fingerprint or backend raises :class:`P2pHandshakeError`
  on both sides before any process group exists.
- publish: the producer sets ``has/<key hex>`` for every block it holds and deletes it
  when the block is freed; the consumer counts a prompt's published prefix with
  ``check`` (a binary search, so a few round trips per prompt).
- fetch: the consumer pushes ``{"seq", "keys"}`` onto the ``requests`` queue; the
  producer's serving thread answers over the process group with a small header tensor
  (layer bytes, one found-flag per key, the frame headers of the found blocks) and then,
  if any was found, each layer of the found blocks as uint8 tensors of a few MiB (large
  messages the consumer can receive straight into its paged cache). The consumer
  then pushes ``{"ack": seq}`` and the producer frees those blocks (they also expire
  after ``hold_s``).

Failure model: starting up (rendezvous, handshake, process group) waits at most
``connect_timeout_s``; every lookup and fetch after that at most ``timeout_s`` (TCPStore
reads run on a watchdog thread because a frozen store server never answers them; gloo
sends and receives take a timeout). The first failure marks the channel broken for good:
the consumer then reports no matches and its loads fail at once, so the engine recomputes;
a broken producer unpublishes everything. One producer serves one consumer; neither
reconnects (restart both to pair again).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from kvdi.connectors.framing import HEADER_SIZE
from kvdi.connectors.p2p import P2pHandshakeError, P2pTransferError
from kvdi.connectors.p2p_held import Frames, HeldBlocks
from kvdi.connectors.p2p_rendezvous import Watchdog, handshake_problems
from kvdi.layout import KVCacheSpec
from kvdi.settings import P2pSettings

logger = logging.getLogger(__name__)

PREFIX = "kvdi/p2p/"
REQUEST_QUEUE = PREFIX + "requests"
PRODUCER_RANK = 0
CONSUMER_RANK = 1
# The serving thread polls the request queue (a blocking pop logs a C++ warning per timeout):
# every POLL_HOT_S for HOT_S after a message (a consumer fetches once per engine step),
# backing off to POLL_MAX_S when idle.
POLL_HOT_S = 0.0002
HOT_S = 0.05
POLL_MAX_S = 0.002
SWEEP_S = 0.1
_TAGS = 1 << 30
_PARTS = 1 << 16  # message tags per fetch
PART_BYTES = 4 << 20  # one message per layer and this many bytes of blocks: hashed while still cached
T = TypeVar("T")
Backend = Literal["gloo", "nccl"]


def _published(key: bytes) -> str:
    return f"{PREFIX}has/{key.hex()}"


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
    ) -> None:
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
        self._timeout = timedelta(seconds=options.timeout_s)
        self._connect_timeout = timedelta(seconds=options.connect_timeout_s)
        self._broken: str | None = None
        self._stop = threading.Event()
        self._seq = 0
        self._inflight: dict[int, tuple[list[bytes], float]] = {}
        self._watchdog = Watchdog()
        self._store = self._setup("connecting to the rendezvous store", self._connect)
        self._peer = self._handshake(engine_id)
        self._pg = self._setup("creating the process group", self._make_group)
        self._server: threading.Thread | None = None
        if producer:
            self._server = threading.Thread(target=self._serve, name="kvdi-p2p-serve", daemon=True)
            self._server.start()

    # -- setup --------------------------------------------------------------------
    @property
    def where(self) -> str:
        return f"{self.options.kv_ip}:{self.options.kv_port}"

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
        return TCPStore(o.kv_ip, o.kv_port, None, self.producer, self._connect_timeout, wait_for_workers=False)

    def _hello(self, engine_id: str) -> dict[str, Any]:
        return {
            "role": "kv_producer" if self.producer else "kv_consumer",
            "rank": self.rank,
            "engine_id": engine_id,
            "backend": self.backend,
            "fingerprint": self.layout.fingerprint().hex(),
            "layout": asdict(self.layout),
        }

    def _handshake(self, engine_id: str) -> dict[str, Any]:
        mine = self._hello(engine_id)
        peer_rank = 1 - self.rank
        store = self._store
        self._setup("announcing itself", lambda: store.set(f"{PREFIX}hello/{self.rank}", json.dumps(mine)))
        self._setup("waiting for its peer", lambda: store.wait([f"{PREFIX}hello/{peer_rank}"], self._connect_timeout))
        peer: dict[str, Any] = json.loads(
            self._setup("reading its peer", lambda: store.get(f"{PREFIX}hello/{peer_rank}"))
        )
        self._setup("confirming the handshake", lambda: store.set(f"{PREFIX}seen/{self.rank}", "1"))
        if self.producer:  # the store dies with us: let the consumer read our hello before we may raise
            with contextlib.suppress(RuntimeError, TimeoutError):
                self._watchdog.call(
                    lambda: store.wait([f"{PREFIX}seen/{peer_rank}"], self._timeout), self.options.timeout_s
                )
        problems = handshake_problems(mine, peer, self.backend)
        if problems:
            raise P2pHandshakeError(f"p2p handshake on {self.where} refused: " + "; ".join(problems))
        return peer

    def _make_group(self) -> Any:
        store = PrefixStore(PREFIX + "pg", self._store)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = self._timeout
            return dist.ProcessGroupNCCL(store, self.rank, 2, nccl_options)
        gloo_options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo_options._timeout = self._timeout  # also bounds every send and receive
        gloo_options._devices = [ProcessGroupGloo.create_device(hostname=self.options.kv_ip)]
        return ProcessGroupGloo(store, self.rank, 2, gloo_options)

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

    def _tag(self, seq: int, part: int) -> int:
        return (seq * _PARTS + part) % _TAGS

    # -- consumer -----------------------------------------------------------------
    def count_published(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the producer holds; 0 once broken."""
        if self._broken is not None or not keys:
            return 0
        names = [_published(k) for k in keys]
        store = self._store

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

        try:
            return self._watchdog.call(search, self.options.timeout_s)
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
            message = json.dumps({"seq": seq, "keys": [k.hex() for k in keys]})
            self._watchdog.call(lambda: self._store.queue_push(REQUEST_QUEUE, message), deadline - time.monotonic())
            header = torch.empty(8 + n * (1 + HEADER_SIZE), dtype=torch.uint8)
            wire = self._wire(header)
            self._wait(self._pg.recv([wire], PRODUCER_RANK, self._tag(seq, 0)), deadline)
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
        cache), while later parts are still arriving.
        """
        lb = self.layer_bytes
        with self._failing(answer.seq, len(answer.found)):
            posted = []
            for part, (layer, a, b) in enumerate(self._parts(answer.count), start=1):
                piece = buffers[layer][a * lb : b * lb]
                posted.append((layer, a, b, self._pg.recv([piece], PRODUCER_RANK, self._tag(answer.seq, part))))
            for layer, a, b, work in posted:
                self._wait(work, answer.deadline)
                on_part(layer, a, b)

    def _parts(self, count: int) -> list[tuple[int, int, int]]:
        """``(layer, first, stop)`` of every message of a batch of ``count`` blocks, in sending order."""
        step = max(1, PART_BYTES // self.layer_bytes)
        return [
            (layer, a, min(a + step, count)) for layer in range(self.layout.num_layers) for a in range(0, count, step)
        ]

    def finish(self, answer: Answer) -> None:
        """Tell the producer this fetch is over (it frees the blocks); ends the fetch begun by :meth:`request`."""
        if self._broken is None:
            message = json.dumps({"ack": answer.seq})
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
            raise P2pTransferError(reason) from None

    def _wait(self, work: Any, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within KVDI_P2P__TIMEOUT_S={self.options.timeout_s}")
        work.wait(timedelta(seconds=left))

    # -- producer -----------------------------------------------------------------
    def hold(self, keys: Sequence[bytes], frames: Frames) -> int:
        """Hold framed blocks and publish their keys; returns how many keys were newly published."""
        if self._broken is not None:
            return 0
        new, evicted = self.held.hold(keys, frames)
        try:
            if new:
                self._store.multi_set([_published(k) for k in new], ["1"] * len(new))  # type: ignore[attr-defined]
            for key in evicted:
                self._store.delete_key(_published(key))
        except RuntimeError as exc:
            self._break(f"publishing failed: {str(exc).splitlines()[0]}")
            return 0
        return len(new)

    def _serve(self) -> None:
        store = self._store.clone()  # type: ignore[attr-defined]
        idle = POLL_HOT_S
        last = time.monotonic()
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_sweep:
                    self._unpublish(store, self.held.expire())
                    self._forget_stale()
                    next_sweep = time.monotonic() + SWEEP_S
                try:
                    raw = store.queue_pop(REQUEST_QUEUE, False)
                except dist.QueueEmptyError:
                    self._stop.wait(idle)
                    if time.monotonic() - last > HOT_S:
                        idle = min(idle * 2, POLL_MAX_S)
                    continue
                idle, last = POLL_HOT_S, time.monotonic()
                msg = json.loads(raw)
                if "ack" in msg:
                    keys, _ = self._inflight.pop(int(msg["ack"]), ([], 0.0))
                    self._unpublish(store, self.held.release(keys))
                else:
                    self._answer(int(msg["seq"]), [bytes.fromhex(k) for k in msg["keys"]])
        except (RuntimeError, ValueError, KeyError) as exc:
            self._break(f"serving failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            with contextlib.suppress(RuntimeError):  # offer nothing a broken channel cannot send
                self._unpublish(store, self.held.clear())

    def _answer(self, seq: int, keys: list[bytes]) -> None:
        found, frames = self.held.lookup(keys)
        n = len(keys)
        header = torch.zeros(8 + n * (1 + HEADER_SIZE), dtype=torch.uint8)
        header[:8].view(torch.int64)[0] = self.layer_bytes
        header[8 : 8 + n] = torch.tensor(found, dtype=torch.uint8)
        works = []
        if frames is not None:
            header[8 + n : 8 + n + frames.headers.numel()] = frames.headers
        works.append(self._pg.send([self._wire(header)], CONSUMER_RANK, self._tag(seq, 0)))
        if frames is not None:
            lb = self.layer_bytes
            for part, (layer, a, b) in enumerate(self._parts(frames.count), start=1):
                piece = self._wire(frames.layers[layer, a * lb : b * lb])
                works.append(self._pg.send([piece], CONSUMER_RANK, self._tag(seq, part)))
        for work in works:
            work.wait(self._timeout)
        self._inflight[seq] = ([k for k, f in zip(keys, found, strict=True) if f], time.monotonic())

    def _forget_stale(self) -> None:
        """Drop sent batches never acknowledged (their blocks expire on their own)."""
        limit = time.monotonic() - self.options.hold_s
        for seq in [s for s, (_, t) in self._inflight.items() if t < limit]:
            del self._inflight[seq]

    def _unpublish(self, store: Store, keys: Sequence[bytes]) -> None:
        for key in keys:
            store.delete_key(_published(key))

    # -- shutdown -----------------------------------------------------------------
    def stop_serving(self) -> None:
        """Producer: stop answering fetches. Held blocks stay published until :meth:`close`, so a
        consumer that asks meanwhile times out after ``timeout_s`` and recomputes."""
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=self.options.timeout_s + 1.0)
            self._server = None

    def close(self) -> None:
        """Stop serving, unpublish and free held blocks, drop the process group. Idempotent."""
        self.stop_serving()
        with contextlib.suppress(RuntimeError):
            self._unpublish(self._store, self.held.clear())
        self._pg = None
        self._broken = self._broken or "closed"


__all__ = ["Answer", "P2pChannel"]
