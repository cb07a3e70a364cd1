"""kvdi.masking: secrets in URLs, extra config and error messages are never shown."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from kvdi.masking import MASK, is_secret_key, mask_text, mask_url, mask_value


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("redis://:pa/ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://:pa#ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://:p/a#s?s@h:1/0", "redis://:***@h:1/0"),
        ("redis://u:p@ss:w@h:1/0", "redis://u:***@h:1/0"),
        ("redis://u:a:b:c@h:1/0", "redis://u:***@h:1/0"),
        ("rediss://user:p%40ss@h:1/0", "rediss://user:***@h:1/0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),
        ("unix:///run/redis.sock?db=0&password=pw", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://h:1/0?password=a#b&c", "redis://h:1/0?password=***"),
        ("redis://h:1/0?db=2&token=t/o@k:e#n", "redis://h:1/0?db=2&token=***"),
        ("redis://h:1/0?token=a@b&db=1", "redis://h:1/0?token=***&db=1"),
        ("redis://:pa?ss@h/0?password=x", "redis://:***@h/0?password=***"),
        ("redis://h:1/0?Auth=x&db=1", "redis://h:1/0?Auth=***&db=1"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_mask_url_hides_every_password(url: str, shown: str) -> None:
    """Userinfo passwords (with / # @ : ?) and secret query values never survive; plain URLs are unchanged."""
    assert mask_url(url) == shown


_PASSWORD = st.text(alphabet=string.ascii_letters + string.digits + "/#@:?&=%!$", min_size=6, max_size=24).filter(
    lambda pw: any(c.isalnum() for c in pw)
)


@settings(max_examples=300, deadline=None)
@given(pw=_PASSWORD, user=st.sampled_from(["", "user", "default"]))
def test_no_password_survives_in_the_userinfo(pw: str, user: str) -> None:
    """Whatever characters the password holds, none of it is printed."""
    assume(pw not in f"redis://{user}:***@127.0.0.1:6379/0")  # a password that is part of the rest proves nothing
    shown = mask_url(f"redis://{user}:{pw}@127.0.0.1:6379/0")
    assert pw not in shown


@settings(max_examples=300, deadline=None)
@given(
    pw=_PASSWORD.filter(lambda pw: "&" not in pw), key=st.sampled_from(["password", "pass", "token", "auth", "secret"])
)
def test_no_password_survives_in_the_query(pw: str, key: str) -> None:
    """A secret query parameter is hidden up to the next '&', a '#' in it included."""
    assume(pw not in f"redis://127.0.0.1:6379/0?db=1&{key}=***")  # e.g. "pass" inside "password"
    assert pw not in mask_url(f"redis://127.0.0.1:6379/0?db=1&{key}={pw}")


@pytest.mark.parametrize(
    "name",
    [
        "password",
        "PASSWORD",
        "passwd",
        "pwd",
        "token",
        "auth",
        "auth_token",
        "api_key",
        "apiKey",
        "api-key",
        "access_key",
        "secret",
        "client_secret",
        "credentials",
        "integrity_key",
        "private_key",
        "redis.password",
    ],
)
def test_secret_names(name: str) -> None:
    assert is_secret_key(name)


@pytest.mark.parametrize(
    "name", ["url", "key_prefix", "integrity_key_file", "author", "kv_port", "key", "block_size", ""]
)
def test_plain_names(name: str) -> None:
    assert not is_secret_key(name)


def test_extra_config_secret_keys_are_masked_at_any_depth() -> None:
    """password, token, auth, api_key, access_key, secret (and URL passwords) are hidden; other values stay."""
    extra = {
        "password": "p1",
        "token": "p2",
        "auth": "p3",
        "api_key": "p4",
        "access_key": "p5",
        "secret": "p6",
        "nested": {"deeper": [{"Token": "p7"}], "url": "redis://u:p8/x@h/0", "port": 1},
        "plain": "visible",
        "empty_password": "",
    }
    shown = mask_value("kv_connector_extra_config", extra)
    assert "p1" not in repr(shown) and all(f"p{i}" not in repr(shown) for i in range(1, 9))
    assert shown["password"] == MASK and shown["nested"]["deeper"][0]["Token"] == MASK
    assert shown["nested"]["url"] == "redis://u:***@h/0" and shown["nested"]["port"] == 1
    assert shown["plain"] == "visible" and shown["empty_password"] == ""


def test_secretstr_shows_its_masked_url_or_nothing() -> None:
    assert mask_value("redis.url", SecretStr("redis://:pw@h:1/0")) == "redis://:***@h:1/0"
    assert mask_value("p2p.auth_token", SecretStr("redis://x")) == MASK
    assert mask_value("integrity_key", SecretStr("k3y")) == MASK


def test_mask_value_stops_at_its_depth_limit() -> None:
    """A value nested far deeper than any setting is cut, not recursed into."""
    deep: object = "redis://:pw@h"
    for _ in range(5000):
        deep = [deep]
    assert "pw" not in repr(mask_value("x", deep)[0])


def test_mask_text_masks_urls_inside_messages() -> None:
    text = "redis at redis://:pa/ss#w@h:1/0 failed; retry 'rediss://u:x@y/0' later"
    shown = mask_text(text)
    assert "pa/ss" not in shown and "ss#w" not in shown and "u:x@" not in shown
    assert shown == "redis at redis://:***@h:1/0 failed; retry 'rediss://u:***@y/0' later"


@pytest.mark.parametrize(
    "name", ["max_num_batched_tokens", "max_tokens", "num_tokens", "tokens_per_block", "max_new_tokens"]
)
def test_counts_of_llm_tokens_are_not_secrets(name: str) -> None:
    assert not is_secret_key(name)
    assert mask_value(f"scheduler.{name}", 2048) == 2048


@pytest.mark.parametrize("name", ["token", "tokens", "auth_token", "hf_token", "access_tokens", "api_token"])
def test_credentials_named_token_stay_secrets(name: str) -> None:
    assert is_secret_key(name)


def test_kvdi_info_shows_the_batched_token_budget(kvdi_env: object) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "info"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    (line,) = [line for line in out.splitlines() if "max_num_batched_tokens" in line]
    assert MASK not in line and any(ch.isdigit() for ch in line)


EXTRA = {"api_key": "SECRET-1", "nested": {"password": "SECRET-2", "urls": ["redis://:SECRET-3@h/0"]}, "plain": 5}


def test_secret_looking_extra_config_keys_are_masked_in_repr_str_and_json(kvdi_env: object) -> None:
    from kvdi.settings import load_settings

    settings = load_settings(kv_connector_extra_config=EXTRA)
    for shown in (repr(settings), str(settings), settings.model_dump_json(), str(settings.model_dump(mode="json"))):
        assert "SECRET-" not in shown
    assert "'plain': 5" in repr(settings.kv_connector_extra_config)
    assert settings.kv_connector_extra_config == EXTRA  # the program still reads the real values
    assert settings.model_dump()["kv_connector_extra_config"]["api_key"] == "SECRET-1"
