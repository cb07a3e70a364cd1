"""RedisBlockStore against a real redis-server: protocol, TTL, secrets, failures and the breaker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

redis = pytest.importorskip("redis")

from kvdi.connectors.redis import (  # noqa: E402
    BreakerState,
    CircuitBreaker,
    RedisBlockStore,
    mask_url,
    open_store,
    send_gathered,
)
from kvdi.connectors.store import BlockStore  # noqa: E402
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header, unframe  # noqa: E402
from kvdi.errors import ConfigError  # noqa: E402
from kvdi.settings import RedisSettings, load_settings  # noqa: E402
from kvdi.testing.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.redis

FINGERPRINT = bytes(range(16))
KEYS = [bytes([i]) * 16 for i in range(1, 6)]

StoreFactory = Callable[..., RedisBlockStore]


def framed(i: int, size: int = 4096) -> tuple[bytes, bytes]:
    """A (header, payload) pair like the generic worker writes, for block key ``KEYS[i]``."""
    payload = bytes((i * 7 + j) % 251 for j in range(size))
    return frame_header(FINGERPRINT, payload, name=KEYS[i]), payload


@pytest.fixture
def make_store(redis_server: RedisServer) -> Iterator[StoreFactory]:
    """``make_store(**options)``: a RedisBlockStore on the test's server with fast failure settings."""
    stores: list[RedisBlockStore] = []

    def make(url: str | None = None, **options: object) -> RedisBlockStore:
        fields: dict[str, object] = {
            "url": url or redis_server.url,
            "connect_timeout_s": 0.5,
            "op_timeout_s": 0.5,
            "breaker_failures": 2,
            "breaker_reset_s": 0.2,
            **options,
        }
        store = RedisBlockStore(RedisSettings.model_validate(fields))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain redis-py client on the test's server, to look behind the store's back."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_store_satisfies_the_block_store_protocol(make_store: StoreFactory) -> None:
    assert isinstance(make_store(), BlockStore)


def test_round_trip_returns_the_whole_frame(make_store: StoreFactory) -> None:
    store = make_store()
    header, payload = framed(0)
    store.put_many([(KEYS[0], [header, payload])])
    (got,) = store.get_many([KEYS[0]])
    assert got is not None
    assert bytes(unframe(got, FINGERPRINT, len(payload), name=KEYS[0])) == payload


def test_absent_keys_read_as_none(make_store: StoreFactory) -> None:
    store = make_store()
    store.put_many([(KEYS[1], framed(1))])
    assert [v is not None for v in store.get_many(KEYS[:3])] == [False, True, False]


def test_count_prefix_stops_at_the_first_gap(make_store: StoreFactory) -> None:
    store = make_store()
    store.put_many([(k, framed(i)) for i, k in enumerate(KEYS) if i != 2])
    assert store.count_prefix(KEYS) == 2


def test_each_object_is_one_key_named_prefix_plus_hex(make_store: StoreFactory, raw: redis.Redis) -> None:
    store = make_store(key_prefix="t1:")
    header, payload = framed(3)
    store.put_many([(KEYS[0], [header, payload])])
    assert raw.keys("*") == [b"t1:" + KEYS[0].hex().encode()]
    assert raw.strlen(b"t1:" + KEYS[0].hex().encode()) == HEADER_SIZE + len(payload)


def test_ttl_is_applied_to_every_object(make_store: StoreFactory, raw: redis.Redis) -> None:
    store = make_store(ttl_s=100)
    store.put_many([(k, framed(i)) for i, k in enumerate(KEYS[:2])])
    ttls = [raw.ttl(b"kvdi:" + k.hex().encode()) for k in KEYS[:2]]
    assert all(0 < t <= 100 for t in ttls)


def test_without_ttl_objects_do_not_expire(make_store: StoreFactory, raw: redis.Redis) -> None:
    make_store(ttl_s=0).put_many([(KEYS[0], framed(0))])  # 0: never expires (the default is one day)
    assert raw.ttl(b"kvdi:" + KEYS[0].hex().encode()) == -1


def test_discard_deletes_and_tolerates_absent_keys(make_store: StoreFactory) -> None:
    store = make_store()
    store.put_many([(KEYS[0], framed(0))])
    store.discard(KEYS[0])
    store.discard(KEYS[1])
    assert store.get_many([KEYS[0]]) == [None]


def test_non_byte_memoryview_is_stored_by_bytes(make_store: StoreFactory) -> None:
    store = make_store()
    words = memoryview(bytes(range(64))).cast("I")  # 16 elements, 64 bytes
    store.put_many([(KEYS[0], [words])])
    assert store.get_many([KEYS[0]]) == [bytes(range(64))]


def test_large_pieces_are_stored_in_order(make_store: StoreFactory) -> None:
    store = make_store()
    pieces = [b"h" * 40, *(bytes([i]) * (40 << 10) for i in range(3)), b"t" * 10]
    store.put_many([(KEYS[0], pieces), (KEYS[1], pieces[::-1])])
    assert store.get_many(KEYS[:2]) == [b"".join(pieces), b"".join(pieces[::-1])]


def test_server_rejection_is_an_oserror_and_leaves_the_breaker_closed(
    redis_server_factory: Callable[..., RedisServer], make_store: StoreFactory
) -> None:
    server = redis_server_factory(extra_args=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction"))
    store = make_store(url=server.url, breaker_failures=1)
    big = [bytes(1 << 20)]
    with pytest.raises(OSError, match="rejected by the server"):
        store.put_many([(k, big) for k in KEYS])
    assert store.breaker.state is BreakerState.CLOSED
    store.put_many([(KEYS[0], [b"small"])])
    assert store.get_many(KEYS[:1]) == [b"small"]  # the connection is still in step with the server


def test_hung_server_times_out_instead_of_stalling(redis_server: RedisServer, make_store: StoreFactory) -> None:
    store = make_store(op_timeout_s=0.2)
    store.put_many([(KEYS[0], framed(0))])  # a pooled connection exists before the server hangs
    redis_server.freeze()
    try:
        with pytest.raises(TimeoutError, match="timed out"):
            store.get_many(KEYS[:1])
    finally:
        redis_server.thaw()


def test_send_gathered_delivers_every_byte_in_order_through_partial_sends() -> None:
    chunks = [bytes([i % 251]) * size for i, size in enumerate((1, 70_000, 0, 5, 1 << 20, 300_000, 2))]
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # force partial sends
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend(_read_all(right)))
    reader.start()
    send_gathered(left, chunks)
    left.close()
    reader.join()
    right.close()
    assert received == b"".join(chunks)


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while data := sock.recv(1 << 16):
        parts.append(data)
    return b"".join(parts)


# Secrets


def test_password_protected_server_works(
    redis_server_factory: Callable[..., RedisServer], make_store: StoreFactory
) -> None:
    server = redis_server_factory(password="secret")
    store = make_store(url=server.url)
    store.put_many([(KEYS[0], framed(0))])
    assert store.count_prefix(KEYS[:1]) == 1


def test_repr_masks_the_password(make_store: StoreFactory) -> None:
    store = make_store(url="redis://:secret@127.0.0.1:1/0")
    assert "secret" not in repr(store)
    assert "***" in repr(store)


def test_wrong_password_error_is_a_connection_error_without_the_password(
    redis_server_factory: Callable[..., RedisServer], make_store: StoreFactory
) -> None:
    server = redis_server_factory(password="secret")
    store = make_store(url=f"redis://:hunter2@127.0.0.1:{server.port}/0")
    with pytest.raises(ConnectionError) as info:
        store.count_prefix(KEYS)
    assert "hunter2" not in str(info.value)
    assert f"redis://:***@127.0.0.1:{server.port}/0" in str(info.value)


def test_rediss_url_speaks_tls_and_fails_as_an_oserror_on_a_plain_server(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = make_store(url=f"rediss://:secret@127.0.0.1:{redis_server.port}/0")
    with pytest.raises(OSError) as info:
        store.count_prefix(KEYS)
    assert "rediss://:***@" in str(info.value) and "secret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("rediss://user:p%40ss@h:1/0", "rediss://user:***@h:1/0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),
        ("redis://:a@b@h:1/0", "redis://:***@h:1/0"),
        ("unix:///run/redis.sock?db=0&password=pw", "unix:///run/redis.sock?db=0&password=***"),
    ],
)
def test_mask_url_hides_passwords(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_settings_reject_a_non_redis_scheme() -> None:
    with pytest.raises(ConfigError, match="keyword argument redis.url"):
        load_settings(redis={"url": "http://x"})


def test_unusable_url_is_a_config_error_without_the_password() -> None:
    with pytest.raises(ConfigError, match="KVDI_REDIS__URL") as info:
        RedisBlockStore(RedisSettings(url="redis://:secret@127.0.0.1:notaport/0"))
    assert "secret" not in str(info.value)


def test_import_kvdi_does_not_import_redis() -> None:
    code = "import sys, kvdi, kvdi.containers, kvdi.registry; sys.exit('redis' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDI_")}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


# Failures and the circuit breaker


def test_dead_server_raises_oserror_naming_the_masked_url(
    redis_server_factory: Callable[..., RedisServer], make_store: StoreFactory
) -> None:
    server = redis_server_factory(password="secret")
    store = make_store(url=server.url)
    store.put_many([(KEYS[0], framed(0))])
    server.kill()
    with pytest.raises(OSError, match=r"redis://:\*\*\*@127\.0\.0\.1") as info:
        store.get_many(KEYS[:1])
    assert "secret" not in str(info.value)


def test_breaker_warning_names_the_masked_url(
    redis_server_factory: Callable[..., RedisServer], make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory(password="secret")
    store = make_store(url=server.url, breaker_failures=1)
    server.kill()
    with caplog.at_level("WARNING", logger="kvdi.connectors.redis"), pytest.raises(OSError):
        store.count_prefix(KEYS)
    assert "circuit breaker open" in caplog.text and "***" in caplog.text
    assert "secret" not in caplog.text


def test_breaker_opens_after_consecutive_failures(redis_server: RedisServer, make_store: StoreFactory) -> None:
    store = make_store(breaker_failures=2)
    redis_server.kill()
    for _ in range(2):
        with pytest.raises(OSError):
            store.count_prefix(KEYS)
    assert store.breaker.state is BreakerState.OPEN


def test_open_breaker_answers_misses_and_refuses_saves(redis_server: RedisServer, make_store: StoreFactory) -> None:
    store = make_store(breaker_failures=1, breaker_reset_s=60)
    store.put_many([(KEYS[0], framed(0))])
    redis_server.kill()
    with pytest.raises(OSError):
        store.get_many(KEYS[:1])
    assert (store.count_prefix(KEYS), store.get_many(KEYS[:2])) == (0, [None, None])
    with pytest.raises(ConnectionError, match="circuit breaker open"):
        store.put_many([(KEYS[1], framed(1))])


def test_open_breaker_does_not_call_a_server_that_came_back(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = make_store(breaker_failures=1, breaker_reset_s=60)
    redis_server.kill()
    with pytest.raises(OSError):
        store.count_prefix(KEYS)
    redis_server.restart()
    with pytest.raises(ConnectionError, match="circuit breaker open"):
        store.put_many([(KEYS[0], framed(0))])


def test_store_recovers_after_restart_and_reset_time(redis_server: RedisServer, make_store: StoreFactory) -> None:
    store = make_store(breaker_failures=1, breaker_reset_s=0.2)
    store.put_many([(KEYS[0], framed(0))])
    redis_server.kill()
    with pytest.raises(OSError):
        store.count_prefix(KEYS)
    redis_server.restart()  # a fresh, empty server on the same port
    for _ in range(200):  # bounded poll: the breaker lets a probe through after 0.2 s
        try:
            store.put_many([(KEYS[1], framed(1))])
            break
        except ConnectionError:
            time.sleep(0.02)
    assert store.count_prefix(KEYS[1:]) == 1
    assert store.breaker.state is BreakerState.CLOSED


def test_open_store_builds_the_store_from_settings(redis_server: RedisServer) -> None:
    """One server by default; every read bounded by the layout's frame size (plus room for a trailer)."""
    from kvdi.connectors.redis import FRAME_ROOM
    from kvdi.layout import KVCacheSpec

    settings = load_settings(kv_connector="redis", redis={"url": redis_server.url})
    layout = KVCacheSpec.from_settings(settings)
    store = open_store(settings.redis, layout, settings)
    try:
        assert isinstance(store, RedisBlockStore)
        assert store.max_object_bytes == HEADER_SIZE + layout.block_bytes + FRAME_ROOM
    finally:
        store.close()


# The breaker's policy, on a fake clock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_stays_closed_below_the_threshold() -> None:
    breaker = CircuitBreaker(3, 1.0, FakeClock())
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.allow()


def test_breaker_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(2, 1.0, FakeClock())
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_breaker_lets_one_probe_through_after_the_reset_time() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(1, 1.0, clock)
    breaker.record_failure()
    clock.now = 1.0
    assert [breaker.allow(), breaker.allow()] == [True, False]


def test_failed_probe_reopens_the_breaker() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(5, 1.0, clock)
    for _ in range(5):
        breaker.record_failure()
    clock.now = 1.0
    breaker.allow()
    breaker.record_failure()
    assert (breaker.state, breaker.allow()) == (BreakerState.OPEN, False)
