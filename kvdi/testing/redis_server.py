"""A throwaway ``redis-server`` on a free loopback port, for tests and benchmarks.

:class:`RedisServer` starts ``redis-server --port N --bind 127.0.0.1 --save '' --appendonly no``
in a temporary directory, waits until it answers ``PING``, and stops it on exit. It can also
:meth:`~RedisServer.kill` the server (SIGKILL, as a crash), :meth:`~RedisServer.restart` it on
the same port, or :meth:`~RedisServer.freeze` it (SIGSTOP, as a hung server). It talks to the
server over a raw socket, so it needs no redis-py.

:class:`RedisClusterServers` starts a Redis Cluster the same way (``--cluster-enabled yes``
per node, ``redis-cli --cluster create``), optionally with replicas, and waits until it
serves; :func:`command` sends one command to a node.

    with RedisServer(password="secret") as server:
        store = open_store(RedisSettings(url=server.url), ...)
    with RedisClusterServers(masters=3, replicas=1) as cluster:
        store = open_store(RedisSettings(url=cluster.url, cluster=True), ...)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

TEST_REDIS_SERVER_ENV = "KVDI_TEST_REDIS_SERVER"
"""The ``redis-server`` binary these launchers start (else the one on ``$PATH``); a tooling variable, not a setting."""
INSTALL_HINT = "install it with: apt-get install -y redis-server (or brew install redis)"
_PING_REPLIES = (b"+PONG", b"-NOAUTH")  # a password-protected server refuses PING but is up


class RedisServerError(RuntimeError):
    """The redis-server binary is missing or the server did not come up."""


def find_redis_server() -> str | None:
    """Path of the ``redis-server`` binary (``KVDI_TEST_REDIS_SERVER`` or ``$PATH``), or None."""
    explicit = os.environ.get(TEST_REDIS_SERVER_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ping(port: int, timeout: float = 0.2) -> bool:
    """True when something on ``127.0.0.1:port`` answers ``PING`` like a Redis server."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(_PING_REPLIES)


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        *,
        password: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 10.0,
    ) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RedisServerError(f"redis-server not found; {INSTALL_HINT}")
        self.binary = binary
        self.password = password
        self.port = port if port is not None else free_port()
        self._fixed_port = port is not None
        self.extra_args = extra_args
        self.start_timeout_s = start_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id, or None when stopped."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; retries other ports if a chosen one was taken."""
        if self.running:
            return self
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvdi-redis-")
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except RedisServerError:
                if attempt == attempts - 1:
                    raise
                self.port = free_port()
        return self  # unreachable; keeps type checkers content

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        self._terminate(signal.SIGTERM)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; the port stays reserved for :meth:`restart`."""
        self._terminate(signal.SIGKILL)

    def freeze(self) -> None:
        """SIGSTOP the server: it keeps its port and connections but answers nothing (a hung server)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT a frozen server."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start a fresh server (empty data) on the same port."""
        self._terminate(signal.SIGKILL)
        self._fixed_port = True
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        from kvdi.masking import mask_url

        shown = mask_url(self.url)
        return f"RedisServer({shown}, {state})"

    def _command(self) -> list[str]:
        assert self._tmp is not None
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self._tmp.name,
            "--logfile", str(self._log_path),
        ]  # fmt: skip
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd + list(self.extra_args)

    @property
    def _log_path(self) -> Path:
        assert self._tmp is not None
        return Path(self._tmp.name) / "redis.log"

    def _spawn_and_wait(self) -> None:
        assert self._tmp is not None
        with open(Path(self._tmp.name) / "stdio.log", "ab") as stdio:
            self._proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=stdio, stderr=stdio)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if ping(self.port):
                return
            time.sleep(0.01)
        self._terminate(signal.SIGKILL)
        raise RedisServerError(f"redis-server on 127.0.0.1:{self.port} did not come up: {self._log_tail()}")

    def _terminate(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.send_signal(signal.SIGCONT)  # a frozen server must wake up to handle SIGTERM
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _log_tail(self) -> str:
        assert self._tmp is not None
        lines: list[str] = []
        for path in (Path(self._tmp.name) / "stdio.log", self._log_path):
            try:
                lines += path.read_text(errors="replace").strip().splitlines()[-3:]
            except OSError:
                continue
        return " | ".join(lines) or "no log"


def command(port: int, *args: str, password: str | None = None, timeout: float = 2.0) -> object:
    """Send one command to ``127.0.0.1:port`` over a raw socket; the reply as int, bytes, list, or RedisServerError."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        stream = sock.makefile("rb")
        if password:
            sock.sendall(_pack("AUTH", password))
            _read_reply(stream)
        sock.sendall(_pack(*args))
        return _read_reply(stream)


def _pack(*args: str) -> bytes:
    parts = [a.encode() for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _read_reply(stream: BinaryIO) -> object:
    line = stream.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:]
    if kind == b"+":
        return rest
    if kind == b"-":
        return RedisServerError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else stream.read(size + 2)[:size]
    if kind == b"*":
        count = int(rest)
        return None if count < 0 else [_read_reply(stream) for _ in range(count)]
    raise RedisServerError(f"unexpected reply from redis-server: {line[:40]!r}")


class RedisClusterServers:
    """A throwaway Redis Cluster on loopback: ``masters`` nodes (and ``replicas`` per master), stopped by pid.

    Each node is a :class:`RedisServer` started with ``--cluster-enabled yes`` (its own client
    and bus ports, config file in its own directory); ``redis-cli --cluster create ...
    --cluster-yes`` joins them, and :meth:`start` returns once every node says
    ``cluster_state:ok`` (and every replica is in sync). ``node_timeout_ms`` is short so a
    killed master fails over in about a second.
    """

    def __init__(
        self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000, start_timeout_s: float = 60.0
    ) -> None:
        self.master_count = masters
        self.replica_count = replicas
        self.node_timeout_ms = node_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` of the first node (any node will do as a startup node)."""
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        """Start every node, create the cluster and wait until it serves; stops what it started on failure."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisServerError(f"redis-cli not found; {INSTALL_HINT}")
        try:
            for _ in range(self.master_count * (1 + self.replica_count)):
                bus = free_port()
                args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus),
                        "--cluster-node-timeout", str(self.node_timeout_ms))  # fmt: skip
                self.nodes.append(RedisServer(extra_args=args).start())
            create = [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"]
            if self.replica_count:
                create += ["--cluster-replicas", str(self.replica_count)]
            done = subprocess.run(create, capture_output=True, timeout=self.start_timeout_s, check=False)
            if done.returncode != 0:
                output = (done.stdout + done.stderr)[-400:].decode(errors="replace")
                raise RedisServerError(f"redis-cli --cluster create failed: {output}")
            self.wait_ok(self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node (by pid) and remove their directories."""
        for node in self.nodes:
            node.stop()
        self.nodes = []

    def running(self) -> list[RedisServer]:
        """The nodes whose process is alive."""
        return [n for n in self.nodes if n.running]

    def role(self, node: RedisServer) -> str:
        """``master`` or ``slave`` (from ``ROLE``)."""
        reply = command(node.port, "ROLE")
        return bytes(reply[0]).decode() if isinstance(reply, list) and reply else "unknown"

    def masters(self) -> list[RedisServer]:
        """The running nodes that are masters now."""
        return [n for n in self.running() if self.role(n) == "master"]

    def dbsize(self, node: RedisServer) -> int:
        """How many keys ``node`` holds."""
        reply = command(node.port, "DBSIZE")
        return reply if isinstance(reply, int) else -1

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node says ``cluster_state:ok``, knows every live replica, replicas in sync."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                replicas = sum(self.role(n) == "slave" for n in self.running())
                if all(self._serving(n, replicas) for n in self.running()):
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise RedisServerError(f"redis cluster did not reach cluster_state:ok in {timeout_s}s ({last})")

    def _serving(self, node: RedisServer, replicas: int) -> bool:
        """Whether ``node`` serves every slot, knows all ``replicas`` (clients read its slot map) and is in sync."""
        info = command(node.port, "CLUSTER", "INFO")
        if not isinstance(info, bytes) or b"cluster_state:ok" not in info or b"cluster_slots_ok:16384" not in info:
            return False
        nodes = command(node.port, "CLUSTER", "NODES")
        flags = [line.split()[2].split(b",") for line in nodes.splitlines()] if isinstance(nodes, bytes) else []
        if sum(b"slave" in f and b"fail" not in f for f in flags) != replicas:
            return False
        if self.role(node) != "slave":
            return True
        replication = command(node.port, "INFO", "replication")
        return isinstance(replication, bytes) and b"master_link_status:up" in replication

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisClusterServers({[n.port for n in self.nodes]}, masters={self.master_count})"
