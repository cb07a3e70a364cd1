"""Redis keys expire by default (``redis.ttl_s``, one day); 0 keeps them forever; the bounds are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from kvdi.settings.sections import DEFAULT_REDIS_TTL_S, MAX_REDIS_TTL_S


def test_redis_keys_expire_after_a_day_by_default(kvdi_env: Path) -> None:
    assert load_settings().redis.ttl_s == DEFAULT_REDIS_TTL_S == 86_400


def test_zero_means_keys_never_expire(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_REDIS__TTL_S", "0")
    assert load_settings().redis.ttl_s == 0


@pytest.mark.parametrize("value", ["-1", str(MAX_REDIS_TTL_S + 1)])
def test_ttl_out_of_bounds_names_the_variable(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVDI_REDIS__TTL_S", value)
    with pytest.raises(ConfigError, match=rf"redis\.ttl_s \(KVDI_REDIS__TTL_S='{value}'\)"):
        load_settings()
