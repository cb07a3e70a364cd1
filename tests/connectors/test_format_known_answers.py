"""Known answers for the stored format: fixed inputs give these exact bytes, on every machine, forever.

Every other test compares the code with itself; these compare it with values written down
once (format version 3). A change that fails here would orphan (or, worse, misread) every
object already in every store: if it is deliberate, bump ``kvdi.layout.FORMAT_VERSION`` and
write the new answers down here in the same commit.
"""

from __future__ import annotations

import struct

from kvdi.connectors.store.framing import HEADER_SIZE, FrameKey, frame_header, unframe
from kvdi.connectors.store.keys import block_keys, compose_salt
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.layout import FORMAT_VERSION, KVCacheSpec

SPEC = KVCacheSpec("kvdi/known-answer", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
TOKENS = list(range(1, 13))  # three full blocks of four tokens
PAYLOAD = bytes(range(256)) * 2  # SPEC.block_bytes
KEY = FrameKey(b"kvdi known-answer key")

FINGERPRINT = "8efd3a54af0738c8cbebfd3645e455c6"
KEYS = ["c3246f8f8632adca059642573582d5f2", "502d9a3a72ef8f18447b14770011a3b6", "dad9f734fa5e391bdf221e0e3506256b"]
SALT = "s8:tenant-a|l7:adapter|m6:mmhash"
SALTED_KEYS = [
    "8ade5c6a698e05c07d6ed6b7529c87ac",
    "949ecdca5ba69d1fda81778a3520175e",
    "50fbe38e1c9cdc24b1f51991d3db47c4",
]
RANK1_OF_TP2_KEY0 = "1b7a83242cd04621b224b513b190888d"
HEADER = (
    "4b564449"  # magic "KVDI"
    "0300"  # version 3
    "0000"  # flags: no MAC
    "8efd3a54af0738c8cbebfd3645e455c6"  # layout fingerprint
    "c3246f8f8632adca059642573582d5f2"  # name: the block key it is stored under
    "0002000000000000"  # payload length 512
    "71876424d539d319" + "00" * 32  # xxh3_64(payload || the 48 header bytes before it)  # no MAC
)
KEYED_HEADER = (
    "4b564449"
    "0300"
    "0100"  # flags: FLAG_MAC
    "8efd3a54af0738c8cbebfd3645e455c6"
    "c3246f8f8632adca059642573582d5f2"
    "0002000000000000"
    "a91108b7524f66e3"
    "de5013a26a5dc805fed9315c31fa3cd225035920a74d431b5f40a1fe0a6a8471"  # HMAC-SHA256(payload || header[:56])
)


def test_the_format_version_is_the_one_these_answers_were_written_for() -> None:
    assert FORMAT_VERSION == 3
    assert SPEC.block_bytes == len(PAYLOAD) and HEADER_SIZE == 88


def test_layout_fingerprint() -> None:
    assert SPEC.fingerprint().hex() == FINGERPRINT


def test_block_keys_without_a_salt() -> None:
    assert [k.hex() for k in block_keys(TOKENS, SPEC)] == KEYS
    assert [k.hex() for k in block_keys([*TOKENS, 99], SPEC)] == KEYS  # a partial block gets no key


def test_block_keys_with_a_composed_salt() -> None:
    salt = compose_salt("tenant-a", "adapter", ["mmhash"])
    assert salt == SALT
    assert [k.hex() for k in block_keys(TOKENS, SPEC, salt)] == SALTED_KEYS


def test_a_tensor_parallel_ranks_slice_key() -> None:
    assert RankSlice(tp_size=2, tp_rank=1).key(bytes.fromhex(KEYS[0])).hex() == RANK1_OF_TP2_KEY0
    assert RankSlice().key(bytes.fromhex(KEYS[0])).hex() == KEYS[0]  # one rank: the block key itself


def test_frame_header_without_a_key() -> None:
    header = frame_header(SPEC.fingerprint(), PAYLOAD, name=bytes.fromhex(KEYS[0]))
    assert header.hex() == HEADER
    assert struct.unpack_from("<Q", header, 40)[0] == len(PAYLOAD)


def test_frame_header_with_a_key() -> None:
    assert frame_header(SPEC.fingerprint(), PAYLOAD, KEY, name=bytes.fromhex(KEYS[0])).hex() == KEYED_HEADER


def test_the_written_down_frames_still_read() -> None:
    """Objects written by any kvdi of format version 3 load: the reader accepts the known bytes."""
    name = bytes.fromhex(KEYS[0])
    assert bytes(unframe(bytes.fromhex(HEADER) + PAYLOAD, bytes.fromhex(FINGERPRINT), 512, name=name)) == PAYLOAD
    keyed = bytes.fromhex(KEYED_HEADER) + PAYLOAD
    assert bytes(unframe(keyed, bytes.fromhex(FINGERPRINT), 512, KEY, name=name)) == PAYLOAD
