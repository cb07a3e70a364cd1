"""A TCP proxy on loopback that delays every chunk by a fixed time each way: a store "across a network".

:class:`LatencyProxy` listens on a free ``127.0.0.1`` port and forwards each accepted
connection to ``target``. Every chunk read from one side is written to the other side
``delay_ms`` after it was read, in the order it was read, in both directions; a request and
its reply therefore cross the proxy in at least ``2 * delay_ms``. Bandwidth is whatever
loopback and the forwarding threads give (no shaping). ``delay_ms`` may be changed while
connections are open: a chunk read after the change takes the new delay, and a chunk never
overtakes one read before it.

    with RedisServer() as server, LatencyProxy(("127.0.0.1", server.port), delay_ms=5) as proxy:
        url = proxy.url("redis")   # redis://127.0.0.1:<proxy port>/0

Each connection costs two threads per direction (a reader and a delayed writer); a side that
closes or fails closes the whole connection. :meth:`close` (or leaving the ``with`` block)
stops accepting, closes every connection and joins every thread.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from types import TracebackType

_CHUNK = 1 << 18
_EOF = b""


class _Pipe:
    """One direction of one connection: reads ``src``, writes each chunk to ``dst`` once its delay passed."""

    def __init__(self, proxy: LatencyProxy, conn: _Connection, src: socket.socket, dst: socket.socket) -> None:
        self.proxy, self.conn, self.src, self.dst = proxy, conn, src, dst
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.threads = [
            threading.Thread(target=self._read, name="latency-proxy-read", daemon=True),
            threading.Thread(target=self._write, name="latency-proxy-write", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(_CHUNK)
                due = time.monotonic() + self.proxy.delay_ms / 1000.0
                with self.ready:
                    self.queue.append((due, data))
                    self.ready.notify()
                if not data:
                    return
        except OSError:
            with self.ready:
                self.queue.append((0.0, _EOF))
                self.ready.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.ready:
                    while not self.queue:
                        self.ready.wait()
                    due, data = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)  # pass the half-close on, after everything before it
                    break
                self.dst.sendall(data)
        except OSError:
            self.conn.close()
        self.conn.pipe_done()


class _Connection:
    """A client socket and its upstream socket, with a pipe each way."""

    def __init__(self, proxy: LatencyProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.pipes = [_Pipe(proxy, self, client, upstream), _Pipe(proxy, self, upstream, client)]
        self._lock = threading.Lock()
        self._open_pipes = 2
        self.closed = False

    def start(self) -> None:
        for p in self.pipes:
            p.start()

    def pipe_done(self) -> None:
        with self._lock:
            self._open_pipes -= 1
            last = self._open_pipes == 0
        if last:
            self.close()

    def close(self) -> None:
        """Close both sockets (idempotent); blocked readers wake up with an error or EOF."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for p in self.pipes:  # wake writers waiting on an empty queue
            with p.ready:
                p.queue.append((0.0, _EOF))
                p.ready.notify()

    def join(self, timeout: float) -> None:
        for p in self.pipes:
            for t in p.threads:
                t.join(timeout)


class LatencyProxy:
    """Forwards ``127.0.0.1:port`` to ``target``, every chunk delayed ``delay_ms`` each way; a context manager."""

    def __init__(self, target: tuple[str, int], delay_ms: float = 0.0) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
        self.target = target
        self.delay_ms = float(delay_ms)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="latency-proxy-accept", daemon=True)
        self._acceptor.start()

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        """``scheme://127.0.0.1:PORT`` + ``path``: where a client should connect instead of ``target``."""
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    @property
    def connections(self) -> int:
        """Connections currently open through the proxy."""
        with self._lock:
            return sum(not c.closed for c in self._connections)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client, upstream)
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._connections = [c for c in self._connections if not c.closed] + [conn]
            conn.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, join every thread (each within ``timeout``)."""
        with self._lock:
            self._closing = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(timeout)
        for conn in connections:
            conn.close()
        for conn in connections:
            conn.join(timeout)

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LatencyProxy(127.0.0.1:{self.port} -> {self.target[0]}:{self.target[1]}, {self.delay_ms:g} ms each way)"
        )


__all__ = ["LatencyProxy"]
