"""The p2p handshake: both peers announce themselves, optionally prove they share the auth token,
and check that their KV layouts and backends make a pair.

Through the rendezvous store (the keys and the order are in :mod:`kvdi.connectors.p2p.pairing`):
each side sends a hello (role, rank, backend, a fresh random nonce, whether it authenticates)
and reads the other's. Without an auth token the hello also carries the layout, its
fingerprint and the engine id, compared in clear. With one (``KVDI_P2P__AUTH_TOKEN``) the
hello carries nothing else, and each side sends a proof: ``HMAC-SHA256(token, purpose | role
| producer nonce | consumer nonce [| layout fingerprint])`` for the purposes ``auth`` and
``layout``. A peer without the token learns
only the role, the backend and that a token is needed, and cannot compute a proof; the layout
proof says whether the layouts match without showing either. Both then derive the session key
``HMAC(token, "session" | nonces)`` that names blocks and signs queue messages
(:class:`~kvdi.connectors.p2p.protocol.Session`). The producer's ``ok`` carries
``HMAC(token, "verdict|ok" | nonces)``, so no one without the token can accept a consumer.

Every hello also carries the side's tensor/pipeline-parallel shape (``[tp, pp]``, read from its
layout's ``@tpXppY``; ``[1, 1]`` without one), in clear with or without a token: p2p sends each block
as one rank's frame to the peer of the same rank, so two shapes never pair, and a mismatch is refused
in one line naming both shapes before the layouts are compared (docs/p2p.md#parallel-shapes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvdi.connectors.p2p.errors import P2pHandshakeError

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec

ROLES = ("kv_producer", "kv_consumer")
BACKENDS = ("gloo", "nccl")
NONCE_BYTES = 32
_SHAPE = re.compile(r"@tp(\d+)pp(\d+)")


def shape_of(layout: KVCacheSpec) -> list[int]:
    """``[tp, pp]`` named by the layout's model id (``@tp2pp1``, :mod:`kvdi.integrations.vllm.parallel`); [1, 1]."""
    found = _SHAPE.search(layout.model_id)
    return [int(found.group(1)), int(found.group(2))] if found else [1, 1]


def describe_shape(shape: object) -> str:
    """``TP=2 PP=1`` for a hello's shape (what a peer without one sent: ``TP=1 PP=1``)."""
    tp, pp = shape if isinstance(shape, list) and len(shape) == 2 else (1, 1)
    return f"TP={tp} PP={pp}"


def make_hello(*, rank: int, backend: str, layout: KVCacheSpec, engine_id: str, auth: bool) -> dict[str, Any]:
    """This side's hello: what a peer may learn before (or without) authenticating."""
    hello: dict[str, Any] = {
        "role": ROLES[rank],
        "rank": rank,
        "backend": backend,
        "auth": auth,
        "nonce": secrets.token_hex(NONCE_BYTES),
        "shape": shape_of(layout),
    }
    if not auth:
        hello |= {"engine_id": engine_id, "fingerprint": layout.fingerprint().hex(), "layout": asdict(layout)}
    return hello


def parse_hello(raw: bytes, peer_rank: int) -> dict[str, Any]:
    """The peer's hello, checked field by field; raises ValueError naming what is wrong."""
    try:
        hello = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(hello, dict):
        raise ValueError("not a JSON object")
    if hello.get("role") not in ROLES or hello.get("rank") != peer_rank or type(hello.get("rank")) is not int:
        raise ValueError(f"role/rank must be one of {ROLES} on rank {peer_rank}")
    if hello.get("backend") not in BACKENDS or type(hello.get("auth")) is not bool:
        raise ValueError(f"backend must be one of {BACKENDS} and auth a boolean")
    nonce = hello.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES or not _is_hex(nonce):
        raise ValueError(f"nonce must be {2 * NONCE_BYTES} hex digits")
    shape = hello.setdefault("shape", [1, 1])  # a peer of an older kvdi: one rank
    if not isinstance(shape, list) or len(shape) != 2 or not all(type(v) is int and 0 < v < 1 << 16 for v in shape):
        raise ValueError("shape must be [tp, pp], two positive integers")
    if not hello["auth"]:
        if not isinstance(hello.get("fingerprint"), str) or not isinstance(hello.get("engine_id"), str):
            raise ValueError("fingerprint and engine_id must be strings")
        layout = hello.get("layout")
        if not isinstance(layout, dict) or not all(isinstance(v, str | int | float) for v in layout.values()):
            raise ValueError("layout must be an object of plain values")
    return hello


def _is_hex(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) * 2 == len(text)
    except ValueError:
        return False


def _nonces(mine: dict[str, Any], peer: dict[str, Any]) -> bytes:
    producer, consumer = (mine, peer) if mine["rank"] == 0 else (peer, mine)
    return bytes.fromhex(producer["nonce"]) + bytes.fromhex(consumer["nonce"])


def proofs(token: bytes, hello: dict[str, Any], other: dict[str, Any], fingerprint: bytes) -> dict[str, str]:
    """The proofs the side that sent ``hello`` gives (``other`` is its peer's hello)."""
    base = hello["role"].encode() + b"|" + _nonces(hello, other)
    return {
        "auth": hmac.new(token, b"auth|" + base, hashlib.sha256).hexdigest(),
        "layout": hmac.new(token, b"layout|" + base + fingerprint, hashlib.sha256).hexdigest(),
    }


def session_key(token: bytes, mine: dict[str, Any], peer: dict[str, Any]) -> bytes:
    """The key both sides derive once authenticated (names blocks, signs queue messages)."""
    return hmac.new(token, b"session|" + _nonces(mine, peer), hashlib.sha256).digest()


def verdict_mac(token: bytes, hello: dict[str, Any], other: dict[str, Any]) -> str:
    """The MAC of the producer's ``ok`` to one consumer (``hello`` and ``other``: the two hellos, either order)."""
    return hmac.new(token, b"verdict|ok|" + _nonces(hello, other), hashlib.sha256).hexdigest()


def json_text(message: dict[str, Any]) -> str:
    """A hello or proof as stored."""
    return json.dumps(message)


def describe_layout(layout: dict[str, Any]) -> str:
    """One line naming every field of a layout, as both sides of a handshake print it."""
    return ", ".join(f"{k}={v}" for k, v in layout.items())


_SAME_LAYOUT = "both sides need the same model, dtype, layers, heads, head_dim and block_size"


def auth_problems(
    mine: dict[str, Any], peer: dict[str, Any], peer_proof: bytes | None, token: bytes | None, layout: KVCacheSpec
) -> list[str]:
    """What the authentication step says against the peer (empty when both run without a token)."""
    if mine["auth"] and not peer["auth"]:
        return ["the peer does not authenticate: set the same KVDI_P2P__AUTH_TOKEN on both sides"]
    if peer["auth"] and not mine["auth"]:
        return ["the peer requires authentication: set KVDI_P2P__AUTH_TOKEN (the same on both sides)"]
    if token is None:
        return []
    expected = proofs(token, peer, mine, layout.fingerprint())
    try:
        got = json.loads(peer_proof or b"")
    except (ValueError, RecursionError):
        got = None
    if not isinstance(got, dict) or not all(isinstance(got.get(k), str) for k in expected):
        return ["the peer's proof is malformed"]
    if not hmac.compare_digest(got["auth"], expected["auth"]):
        return ["authentication failed: KVDI_P2P__AUTH_TOKEN differs between the two sides"]
    if not hmac.compare_digest(got["layout"], expected["layout"]):
        return [
            shape_problem(mine, peer)
            or f"foreign KV layout: this {mine['role']} has [{describe_layout(asdict(layout))}], "
            f"the {peer['role']}'s layout fingerprint differs; {_SAME_LAYOUT}"
        ]
    return []


def shape_problem(mine: dict[str, Any], peer: dict[str, Any]) -> str:
    """The one-line refusal of two parallel shapes (empty when they agree): a rank's frames fit only its twin."""
    if peer.get("shape", [1, 1]) == mine.get("shape", [1, 1]):
        return ""
    return (
        f"parallel shape differs: this {mine['role']} runs {describe_shape(mine.get('shape'))}, the "
        f"{peer.get('role')} {describe_shape(peer.get('shape'))}; p2p sends each block as one rank's frame to the "
        "peer rank of the same slice, so both sides need the same tensor/pipeline-parallel shape (a canonical "
        "shared store serves mixed shapes: docs/stored-format.md)"
    )


def handshake_problems(mine: dict[str, Any], peer: dict[str, Any], backend: str) -> list[str]:
    """What keeps two hello messages (role, backend, shape and, without a token, the layout) from making a pair."""
    problems: list[str] = []
    shape = shape_problem(mine, peer)
    if shape:
        problems.append(shape)
    elif not mine["auth"] and not peer["auth"] and peer.get("fingerprint") != mine["fingerprint"]:
        problems.append(
            f"foreign KV layout: this {mine['role']} has [{describe_layout(mine['layout'])}], "
            f"the {peer.get('role')} has [{describe_layout(peer.get('layout', {}))}]; {_SAME_LAYOUT}"
        )
    if peer.get("backend") != backend:
        problems.append(
            f"backend differs: this side uses {backend}, the peer {peer.get('backend')} (KVDI_P2P__BACKEND)"
        )
    if peer.get("role") == mine["role"]:
        problems.append(
            f"both sides are {mine['role']}; one must be kv_producer (rank 0), the other kv_consumer (rank 1)"
        )
    return problems


def refuse(where: str, problems: list[str]) -> P2pHandshakeError:
    """The error both sides raise when the handshake found ``problems``."""
    return P2pHandshakeError(f"p2p handshake on {where} refused: " + "; ".join(problems))


__all__ = [
    "auth_problems",
    "describe_layout",
    "describe_shape",
    "json_text",
    "handshake_problems",
    "make_hello",
    "parse_hello",
    "proofs",
    "refuse",
    "session_key",
    "shape_of",
    "shape_problem",
    "verdict_mac",
]
