"""What the fleet tests need around a real ``vllm serve``: a ZMQ event subscriber (as a router runs one),
vLLM's dev endpoints, ``/metrics`` parsed with prometheus_client's own parser.

Imports vLLM's event types, pyzmq and msgspec only inside functions (vLLM's venv has them).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.real_vllm.serve_support import VllmServer, free_port


class FleetServer(VllmServer):
    """:class:`VllmServer` that can also POST (vLLM's dev endpoints, ``VLLM_SERVER_DEV_MODE=1``)."""

    def post(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer: dict[str, Any] = json.loads(reply.read() or b"{}")
            return answer


class EventSubscriber:
    """A ZMQ SUB socket bound on loopback (vLLM's publisher connects to it), decoding ``KVEventBatch``es
    with msgspec in a background thread, as a KV-aware router does."""

    def __init__(self) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(self.endpoint)
        self._decoder = Decoder(type=KVEventBatch)
        self.batches: list[Any] = []
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def events_config(self) -> str:
        """The ``--kv-events-config`` that makes vLLM publish to this subscriber."""
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint})

    def _run(self) -> None:
        import zmq

        while self._running:
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            batch = self._decoder.decode(payload)
            with self._lock:
                self.batches.append(batch)

    def events(self) -> list[Any]:
        with self._lock:
            return [e for b in self.batches for e in b.events]

    def wait_for(self, found: Callable[[list[Any]], bool], timeout: float = 60.0) -> list[Any]:
        """All events so far once ``found(events)`` holds; AssertionError with the events after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if found(events):
                return events
            time.sleep(0.2)
        raise AssertionError(f"events not seen within {timeout}s: {self.events()[-20:]}")

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def scrape(server: VllmServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` by (name, sorted labels), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def exposed(server: VllmServer) -> set[str]:
    """Every series name ``/metrics`` exposes: its samples' names, and each family's (a labelled family with no
    child yet, such as a Redis node's breaker before any node reported, still shows its ``# TYPE`` line)."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(server.metrics()):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def series(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    return sum(v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items())
