"""The ``s3`` store when the endpoint fails: killed mid-load, slow past its timeouts, refused by its breaker."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from kvdi.connectors.base import ScheduledRequest, SchedulerOutput, run_transfer_step
from kvdi.connectors.breaker import BreakerState
from kvdi.connectors.s3 import S3BlockStore, S3Settings
from kvdi.testing.conformance import BLOCKS, FRAME_BYTES, KEYS, PROMPT, Halves, frame
from kvdi.testing.latency_proxy import LatencyProxy
from tests.helpers.s3 import ThrottlingProxy, new_bucket, s3_server

FAST_FAIL = {"connect_timeout_s": 0.3, "read_timeout_s": 0.3, "max_attempts": 1, "breaker_reset_s": 60.0}


def test_a_server_killed_between_lookup_and_load_is_a_load_failure_then_recompute() -> None:
    """The lookup offers 16 tokens, the server dies, the load fails (counted) and every block is recomputed."""
    with s3_server() as url:
        store = S3BlockStore(S3Settings(bucket=new_bucket(url), endpoint_url=url, **FAST_FAIL), FRAME_BYTES)
        Halves(store, seed=1).prefill()
        consumer = Halves(store)
        offered, _ = consumer.scheduler.get_num_new_matched_tokens(PROMPT, 0)
        assert offered == 16
    consumer.scheduler.update_state_after_alloc(PROMPT, BLOCKS, offered)
    meta = consumer.scheduler.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(PROMPT, BLOCKS, 16, 2),)))
    assert run_transfer_step(consumer.worker, meta) == {1, 2, 3, 4}
    assert consumer.worker.stats.loaded_blocks == 0 and store.misses["failed"] >= 1
    store.close()


def test_a_reply_slower_than_the_read_timeout_is_a_counted_miss_within_the_bound() -> None:
    """Behind a proxy that delays each way by 0.5 s, a read with a 0.3 s timeout misses in well under 2 s."""
    with s3_server() as url:
        bucket = new_bucket(url)
        fast = S3BlockStore(S3Settings(bucket=bucket, endpoint_url=url), FRAME_BYTES)
        fast.put_many([(KEYS[0], [frame(1)])])
        host_port = url.removeprefix("http://").split(":")
        with LatencyProxy((host_port[0], int(host_port[1])), delay_ms=500) as proxy:
            slow = S3BlockStore(S3Settings(bucket=bucket, endpoint_url=proxy.url("http", ""), **FAST_FAIL), FRAME_BYTES)
            began = time.monotonic()
            assert slow.get_many([KEYS[0]]) == [None]
            assert time.monotonic() - began < 2.0
            assert slow.misses["failed"] == 1
            slow.close()
        fast.close()


def test_after_breaker_failures_calls_are_refused_without_reaching_the_endpoint() -> None:
    """Three failed reads open the breaker: lookups and reads miss at once, saves raise, health says False."""
    with s3_server() as url:
        store = S3BlockStore(S3Settings(bucket=new_bucket(url), endpoint_url=url, **FAST_FAIL), FRAME_BYTES)
    for _ in range(3):
        assert store.get_many([KEYS[0]]) == [None]
    assert store.breaker.state is BreakerState.OPEN and store.health() == {store.label: False}
    began = time.monotonic()
    assert store.count_prefix(KEYS) == 0 and store.get_many(KEYS) == [None] * len(KEYS)
    with pytest.raises(ConnectionError):
        store.put_many([(KEYS[0], [frame(1)])])
    assert time.monotonic() - began < 0.1 and store.misses["breaker"] == 2 * len(KEYS) + 1
    store.close()


def test_throttling_is_retried_with_backoff_within_max_attempts() -> None:
    """Two ``503 SlowDown`` replies, then the object: with max_attempts=3 botocore retries and the read succeeds."""
    with s3_server() as url:
        bucket = new_bucket(url)
        proxy = ThrottlingProxy(url)
        try:
            store = S3BlockStore(S3Settings(bucket=bucket, endpoint_url=proxy.url, max_attempts=3), FRAME_BYTES)
            store.put_many([(KEYS[0], [frame(1)])])
            proxy.throttle = 2
            got = store.get_many([KEYS[0]])[0]
            assert got is not None and bytes(got) == frame(1)
            assert proxy.throttled == 2 and not store.misses
            store.close()
        finally:
            proxy.close()


def test_throttling_past_max_attempts_is_a_counted_miss_that_feeds_the_breaker() -> None:
    """SlowDown on every attempt: the read misses, counted ``failed``, and a breaker of one failure opens."""
    with s3_server() as url:
        bucket = new_bucket(url)
        proxy = ThrottlingProxy(url)
        try:
            options = S3Settings(bucket=bucket, endpoint_url=proxy.url, max_attempts=2, breaker_failures=1)
            store = S3BlockStore(options, FRAME_BYTES)
            store.put_many([(KEYS[0], [frame(1)])])
            proxy.throttle = 2
            assert store.get_many([KEYS[0]]) == [None]
            assert proxy.throttled == 2 and store.misses["failed"] == 1
            assert store.breaker.state is BreakerState.OPEN
            store.close()
        finally:
            proxy.close()
