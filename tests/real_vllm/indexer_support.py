"""A small KV-cache indexer for the shared-identity tests, built as llm-d's (llm-d-kv-cache ``kvevents.Pool``).

A ZMQ SUB socket bound on loopback (vLLM's publishers connect to it) decodes vLLM's
``KVEventBatch``es with msgspec in a background thread. Each batch is credited to the middle
segment of its topic, ``kv@<identity>@<model>`` (a pod, or llm-d-router#2586's ``pool:``/``node:``
identities). Blocks are keyed by request keys the indexer computes itself from the event's
tokens, chained from the parent's request key, and the engine's block hash maps to that key.
llm-d's rule: a ``BlockStored`` whose parent hash is unknown, or one without tokens naming
blocks the indexer does not know, is dropped (counted in :attr:`Indexer.dropped`).

Imports vLLM's event types, pyzmq and msgspec only inside functions (vLLM's venv has them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.real_vllm.serve_support import free_port

RequestKey = tuple[Any, tuple[int, ...], str]


class Indexer:
    """See the module docstring. :meth:`credited` is a router's lookup: the prefix of a prompt each identity holds."""

    def __init__(self) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's default topic filter
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sock.bind(self.endpoint)
        self._decoder = Decoder(type=KVEventBatch)
        self.engine_keys: dict[Any, RequestKey] = {}  # the engines' block hash -> request key
        self.holders: dict[RequestKey, set[tuple[str, str]]] = {}  # request key -> {(identity, medium)}
        self.topics: list[str] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait_connected(self, publishers: int, timeout: float = 10.0) -> None:
        """Wait until ``publishers`` publishers completed their handshake, then for their subscriptions to land."""
        from zmq.utils.monitor import recv_monitor_message

        deadline = time.monotonic() + timeout
        seen = 0
        while seen < publishers:
            left = deadline - time.monotonic()
            if left <= 0 or not self._monitor.poll(int(left * 1000)):
                raise AssertionError(f"{seen} of {publishers} publishers connected within {timeout}s")
            recv_monitor_message(self._monitor)
            seen += 1
        time.sleep(0.3)  # the subscription reaches each PUB socket after the handshake (PUB filters on its side)

    def _run(self) -> None:
        import zmq

        while self._running:
            try:
                topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            with self._lock:
                self.topics.append(topic.decode())
                self.apply(topic.decode(), self._decoder.decode(payload).events)

    def apply(self, topic: str, events: Sequence[Any]) -> None:
        """llm-d's event processing (``processEventBatch``) for one batch published on ``topic``."""
        parts = topic.split("@")
        identity, model = (parts[1], parts[2]) if len(parts) == 3 else (topic, "")
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event, identity, model)
            elif kind == "BlockRemoved":
                for block_hash in event.block_hashes:
                    key = self.engine_keys.get(block_hash)
                    if key is not None:
                        self.holders.get(key, set()).discard((identity, str(event.medium or "GPU")))

    def _stored(self, event: Any, identity: str, model: str) -> None:
        medium, name = str(event.medium or "GPU"), event.lora_name or model
        if event.parent_block_hash is not None and event.parent_block_hash not in self.engine_keys:
            self.dropped += 1  # llm-d: the parent's request key is unknown, the event is skipped
            return
        if not event.token_ids:  # a location-only update: only blocks already known are credited
            known = [self.engine_keys[h] for h in event.block_hashes if h in self.engine_keys]
            self.dropped += not known
            for key in known:
                self.holders.setdefault(key, set()).add((identity, medium))
            return
        parent = None if event.parent_block_hash is None else self.engine_keys[event.parent_block_hash]
        bs = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            parent = (parent, tuple(event.token_ids[i * bs : (i + 1) * bs]), name)
            self.engine_keys[block_hash] = parent
            self.holders.setdefault(parent, set()).add((identity, medium))

    def credited(self, tokens: Sequence[int], block_size: int, model: str = "m") -> dict[str, int]:
        """A router's lookup: per identity, how many of the prompt's first full blocks it holds (in a row)."""
        with self._lock:
            out: dict[str, int] = {}
            parent: Any = None
            alive: set[str] | None = None
            for i in range(len(tokens) // block_size):
                parent = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]), model)
                here = {who for who, _medium in self.holders.get(parent, ())}
                alive = here if alive is None else alive & here
                if not alive:
                    break
                for who in alive:
                    out[who] = i + 1
            return out

    def wait_for(self, found: Callable[[], bool], timeout: float = 10.0) -> None:
        """Until ``found()`` holds; AssertionError with what was indexed after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found():
                return
            time.sleep(0.05)
        raise AssertionError(f"not indexed within {timeout}s: topics {self.topics}, dropped {self.dropped}")

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
