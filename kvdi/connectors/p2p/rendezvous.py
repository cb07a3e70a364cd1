"""The rendezvous store of a p2p pair: the producer hosts it, bound to ``kv_ip`` only.

``torch.distributed.TCPStore`` listens on every interface when it creates its own socket, so
the producer binds a listening socket to ``kv_ip:kv_port`` itself and hands it over
(``master_listen_fd``): with ``kv_ip=127.0.0.1`` (the default) nothing outside the host can
connect. The store speaks no authentication; with ``KVDI_P2P__AUTH_TOKEN`` set, what is put
in it is useless to a peer without the token (see :mod:`kvdi.connectors.p2p.handshake`).

A token is required whenever ``kv_ip`` is not a loopback address (:func:`require_token`):
without one, anything that reaches the port can read which blocks are held, fetch them, and
disturb the pair, so kvdi refuses to offer that to a network.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from kvdi.errors import ConfigError

if TYPE_CHECKING:  # torch.distributed re-exports these public names at run time only
    from torch._C._distributed_c10d import TCPStore

BACKLOG = 64


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, ValueError):  # unresolvable, or not even a host name (UnicodeError)
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def require_token(kv_ip: str, has_token: bool) -> None:
    """ConfigError unless the pair is reachable from this host only or authenticates with a token."""
    if has_token or is_loopback(kv_ip):
        return
    shown = kv_ip if len(kv_ip) <= 64 else kv_ip[:61] + "..."
    raise ConfigError(
        f"KVDI_P2P__KV_IP={shown!r} is not a loopback address and KVDI_P2P__AUTH_TOKEN is not set: "
        "anything that reaches this port could read, fetch and disturb the pair's KV; set the same "
        "KVDI_P2P__AUTH_TOKEN (16+ characters) on both sides, or use kv_ip=127.0.0.1 on one host"
    )


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (the first address ``host`` resolves to)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    """Producer: the store server, listening on ``host:port`` only."""
    sock = listen(host, port)
    try:
        store: TCPStore = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's event loop owns and closes the descriptor now
    return store


def join_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    """Consumer: a client of the producer's store."""
    client: TCPStore = dist.TCPStore(host, port, None, False, timeout)  # type: ignore[attr-defined]
    return client


__all__ = ["host_store", "is_loopback", "join_store", "listen", "require_token"]
