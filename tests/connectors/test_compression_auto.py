"""``compression=auto``'s rule (:mod:`kvdi.connectors.store.codec_auto`): fed numbers, never timed."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("zstandard")

from kvdi.connectors.store.codec import AUTO_MIN_SAVING, Compressor
from kvdi.connectors.store.codec_auto import LinkRule
from kvdi.connectors.store.framing import FLAG_ZSTD, HEADER_SIZE, frame_codec, frame_header
from kvdi.testing.conformance import KEYS, LAYOUT

MB = 1_000_000
N = LAYOUT.block_bytes
NAME = KEYS[0]


def rule(codec_mbs: float, ratio: float, link_mbs: float) -> LinkRule:
    measured = LinkRule(AUTO_MIN_SAVING)
    measured.codec_sample(100 * MB, round(100 * MB / ratio), 100 / codec_mbs)
    measured.link_sample(10 * MB, 10 / link_mbs)
    return measured


def test_before_any_measurement_the_sample_decides() -> None:
    fresh = LinkRule(AUTO_MIN_SAVING)
    assert fresh.pays() is None
    assert fresh.decide(True) is True and fresh.decide(False) is False
    fresh.codec_sample(MB, MB // 2, 0.01)  # the codec alone measured: still the sample's call
    assert fresh.pays() is None and fresh.decide(True) is True


def test_a_slow_link_compresses_and_a_fast_one_stores_plain() -> None:
    """500 MB/s at 1.4x saves 0.29 s per 100 MB of a 100 MB/s link and costs 0.2 s: compress; at 1 GB/s, not."""
    assert rule(500, 1.4, 100).pays() is True
    assert rule(500, 1.4, 1000).pays() is False
    assert rule(500, 1.4, 100).decide(True) is True
    assert rule(500, 1.4, 1000).decide(True) is False


def test_the_ten_percent_floor_holds_on_any_link() -> None:
    assert rule(500, 1.4, 0.001).decide(False) is False


def test_estimates_are_running_averages_and_flips_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    measured = rule(500, 2.0, 100)  # pays: (1 - 1/2) x 500 = 250 MB/s of link time saved > 100
    assert measured.decide(True) is True
    for _ in range(40):  # the link turns fast: the running estimate follows
        measured.link_sample(10 * MB, 10 / 10_000)
    assert measured.link_bps is not None and measured.link_bps > 5000 * MB
    with caplog.at_level(logging.DEBUG, logger="kvdi.connectors.store.codec_auto"):
        assert measured.decide(True) is False
        assert measured.decide(True) is False
    snapshot = measured.snapshot()
    assert (snapshot.compressed, snapshot.plain, snapshot.flips) == (1, 2, 1)
    assert [r.getMessage() for r in caplog.records if "now stores blocks plain" in r.getMessage()]
    assert "1 compressed, 2 plain, 1 flips" in snapshot.describe()


def test_a_compressor_follows_the_link_the_store_reports() -> None:
    """Zeros always compress well; what decides is the link: 1 B/s => compressed, 1 PB/s => plain."""
    payload = bytes(N)
    framed = [frame_header(LAYOUT.fingerprint(), payload, name=NAME), payload]

    slow = Compressor("auto")
    slow.link_sample(1, 1.0)
    assert frame_codec(b"".join(slow.frame(NAME, framed))[:HEADER_SIZE]) == FLAG_ZSTD

    fast = Compressor("auto")
    fast.link_sample(10**15, 1.0)
    assert b"".join(fast.frame(NAME, framed)) == b"".join(framed)
    assert fast.rule is not None and fast.rule.snapshot().plain == 1 and fast.plain_blocks == 1
    assert fast.rule.codec_bps is not None and fast.rule.ratio is not None and fast.rule.ratio > 10


def test_only_auto_has_a_rule_and_link_samples_are_ignored_elsewhere() -> None:
    zstd = Compressor("zstd")
    zstd.link_sample(10**15, 1.0)
    assert zstd.rule is None
    payload = bytes(N)
    assert frame_codec(b"".join(zstd.frame(NAME, [frame_header(LAYOUT.fingerprint(), payload, name=NAME), payload])))


def test_on_a_link_where_it_does_not_pay_only_one_block_in_eight_is_sampled() -> None:
    payload = bytes(N)
    framed = [frame_header(LAYOUT.fingerprint(), payload, name=NAME), payload]
    fast, slow = Compressor("auto"), Compressor("auto")
    fast.link_sample(10**15, 1.0)
    slow.link_sample(1, 1.0)
    for _ in range(16):
        fast.frame(NAME, framed)
        slow.frame(NAME, framed)
    assert fast.rule is not None and slow.rule is not None
    assert fast.rule.samples == 2  # the first block (nothing measured yet), then the 8th skipped one
    assert fast.plain_blocks == 16 and fast.rule.snapshot().plain == 16
    assert slow.rule.samples == 16 and slow.compressed_blocks == 16
