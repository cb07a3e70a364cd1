"""What the two p2p peers say to each other through the rendezvous store, and how it is checked.

All keys live under ``kvdi/p2p/``. The producer publishes ``has/<name>`` for every block it
holds; the consumer pushes requests (``{"seq", "keys"}``) and acknowledgements (``{"ack"}``)
onto the ``requests`` queue. Anyone who reaches the store's port can push anything there, so
the producer decodes every message with :meth:`Session.decode`, which accepts only the exact
shapes above (types, sizes, hex lengths, the next sequence number and no other) and, when the pair
shares an auth token, a valid HMAC-SHA256 over the message under the session key. With a
token, block keys never appear in the store: both sides use ``HMAC(session, key)`` as a
block's name, so a reader of the store cannot tell which prompts are held.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

from kvdi.connectors.store.keys import KEY_BYTES

PREFIX = "kvdi/p2p/"
REQUEST_QUEUE = PREFIX + "requests"
PRODUCER_RANK = 0
CONSUMER_RANK = 1
TAGS = 1 << 30
PARTS = 1 << 16  # message tags per fetch
PART_BYTES = 4 << 20  # one message per layer and this many bytes of blocks: hashed while still cached
MAX_KEYS = 1 << 18  # blocks per fetch the producer answers (its header is ~65 B per key)
MAX_SEQ = 1 << 62
MAX_MESSAGE_BYTES = 256 + MAX_KEYS * (2 * KEY_BYTES + 4)
MAC_HEX = 2 * hashlib.sha256().digest_size


def tag(seq: int, part: int) -> int:
    """The process-group message tag of part ``part`` of fetch ``seq`` (0 is the header)."""
    return (seq * PARTS + part) % TAGS


class BadMessage(ValueError):
    """A queue message the producer refuses; ``reason`` is a short, stable word for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """A consumer's fetch: sequence number and block names, in the order it wants them."""

    seq: int
    names: tuple[bytes, ...]


@dataclass(frozen=True)
class Ack:
    """The consumer received fetch ``seq``: the producer may free its blocks."""

    seq: int


def _canonical(body: dict[str, object]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class Session:
    """The shared view of one paired channel: block names and message encoding, keyed or not.

    ``key`` is the session key both peers derived from the auth token and their nonces (see
    :mod:`kvdi.connectors.p2p.handshake`), or None when the pair runs without a token.
    """

    def __init__(self, key: bytes | None) -> None:
        self._key = key
        self._last_seq = 0

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def name(self, key: bytes) -> bytes:
        """The name of block ``key`` on the wire: the key itself, or its HMAC under the session key."""
        if self._key is None:
            return key
        return hmac.new(self._key, b"name" + key, hashlib.sha256).digest()[:KEY_BYTES]

    def published(self, name: bytes) -> str:
        """The store key that says block ``name`` is held."""
        return f"{PREFIX}has/{name.hex()}"

    def _mac(self, body: dict[str, object]) -> str:
        assert self._key is not None
        return hmac.new(self._key, b"msg" + _canonical(body), hashlib.sha256).hexdigest()

    def encode(self, message: Request | Ack) -> str:
        """The queue message for ``message`` (with its MAC when authenticated)."""
        body: dict[str, object] = (
            {"seq": message.seq, "keys": [n.hex() for n in message.names]}
            if isinstance(message, Request)
            else {"ack": message.seq}
        )
        if self._key is not None:
            body["mac"] = self._mac(body)
        return json.dumps(body)

    def decode(self, raw: object) -> Request | Ack:
        """Check one queue message strictly; raises :class:`BadMessage` for anything else.

        A request's ``seq`` must be the next one: one more than the last request accepted (the
        consumer numbers its fetches 1, 2, 3, ... and stops for good at its first failure). An older
        one is a replay (``replay``); a later one (``order``) is dropped too, so a forged request with
        an absurd sequence number, signed or not, neither makes the producer send into the void nor
        moves the counter past the consumer's next fetch.
        """
        if not isinstance(raw, bytes | bytearray):
            raise BadMessage("type", f"a {type(raw).__name__}, not bytes")
        if len(raw) > MAX_MESSAGE_BYTES:
            raise BadMessage("size", f"{len(raw)} bytes > {MAX_MESSAGE_BYTES}")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise BadMessage("json", type(exc).__name__) from None
        if not isinstance(body, dict):
            raise BadMessage("shape", f"a JSON {type(body).__name__}, not an object")
        mac = body.pop("mac", None)
        if self._key is not None:
            if not isinstance(mac, str) or len(mac) != MAC_HEX or not hmac.compare_digest(mac, self._mac(body)):
                raise BadMessage("mac", "missing or wrong message authentication code")
        elif mac is not None:
            raise BadMessage("mac", "a MAC, but this pair has no auth token")
        if set(body) == {"ack"}:
            return Ack(_seq(body["ack"]))
        if set(body) != {"seq", "keys"}:
            raise BadMessage("shape", f"fields {sorted(body)[:4]}, not ['keys', 'seq'] or ['ack']")
        seq = _seq(body["seq"])
        keys = body["keys"]
        if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
            raise BadMessage("keys", f"keys must be a list of 1..{MAX_KEYS} hex names")
        names = tuple(_name(k) for k in keys)
        if seq <= self._last_seq:
            raise BadMessage("replay", f"seq {seq} after {self._last_seq}")
        if seq != self._last_seq + 1:
            raise BadMessage("order", f"seq {seq} is not the next fetch ({self._last_seq + 1})")
        self._last_seq = seq
        return Request(seq, names)


def _seq(value: object) -> int:
    if type(value) is not int or not 0 < value < MAX_SEQ:
        raise BadMessage("seq", f"a sequence number must be an int in 1..{MAX_SEQ - 1}")
    return value


def _name(value: object) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * KEY_BYTES:
        raise BadMessage("keys", f"a block name must be {2 * KEY_BYTES} hex digits")
    try:
        name = bytes.fromhex(value)
    except ValueError:
        name = b""
    if len(name) != KEY_BYTES:
        raise BadMessage("keys", "a block name is not hex")
    return name


__all__ = [
    "CONSUMER_RANK",
    "MAX_KEYS",
    "PART_BYTES",
    "PREFIX",
    "PRODUCER_RANK",
    "REQUEST_QUEUE",
    "Ack",
    "BadMessage",
    "Request",
    "Session",
    "tag",
]
