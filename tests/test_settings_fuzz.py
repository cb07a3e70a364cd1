"""Property tests: any JSON in KVDI_KV_TRANSFER_CONFIG, any TOML in KVDI_SETTINGS_FILE -> settings or ConfigError."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdi.errors import ConfigError
from kvdi.settings import KvdiSettings, load_settings
from kvdi.settings.vllm_compat import VLLM_KEYS

_SECTIONS = {
    name: list(field.annotation.model_fields)
    for name, field in KvdiSettings.model_fields.items()
    if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields")
}
_NAMES = sorted({*KvdiSettings.model_fields, *VLLM_KEYS, *(f for fields in _SECTIONS.values() for f in fields)})

_KEYS = st.one_of(st.sampled_from(_NAMES), st.text(max_size=8))
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["redis://:pw@h/0", "/proc/x", "1e15", "inf", "kv_producer", "cpu", "null", "a\x00b"]),
)


def _deepen(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


_TREES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(_KEYS, children, max_size=4)),
    max_leaves=20,
)
_VALUES = st.one_of(_TREES, st.builds(_deepen, _TREES, st.integers(min_value=25, max_value=60)))
_DOCUMENTS = st.dictionaries(_KEYS, _VALUES, max_size=6)


def _expect_config_error_or_settings() -> None:
    try:
        result = load_settings()
    except ConfigError:
        return
    assert isinstance(result, KvdiSettings)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.one_of(_DOCUMENTS, _VALUES))
def test_random_transfer_config_json_gives_settings_or_config_error(kvdi_env: Path, document: Any) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVDI_KV_TRANSFER_CONFIG", json.dumps(document))
        _expect_config_error_or_settings()


def _toml_value(value: Any) -> str:
    if value is None:
        return '""'  # TOML has no null
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=_DOCUMENTS, junk=st.one_of(st.just(""), st.text(max_size=20)))
def test_random_toml_file_gives_settings_or_config_error(kvdi_env: Path, document: dict[str, Any], junk: str) -> None:
    path = kvdi_env / "random.toml"
    lines = [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in document.items()]
    path.write_text("\n".join(lines) + "\n" + junk, encoding="utf-8", errors="surrogatepass")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVDI_SETTINGS_FILE", str(path))
        _expect_config_error_or_settings()
