"""Settings sources, precedence and one-line errors naming the env var."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdi.errors import ConfigError
from kvdi.settings import load_settings, value_sources

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "settings").glob("*.toml"))


def test_defaults_select_the_embedded_default(kvdi_env: Path) -> None:
    s = load_settings()
    assert (s.kv_connector, s.kv_role, s.kv_load_failure_policy, s.use_v1) == (
        "shared_storage",
        "kv_both",
        "recompute",
        True,
    )


def test_engine_id_defaults_to_a_fresh_uuid(kvdi_env: Path) -> None:
    assert load_settings().engine_id != load_settings().engine_id


def test_env_sets_a_value_and_is_reported_as_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_CONNECTOR", "null")
    assert load_settings().kv_connector == "null"
    assert value_sources()["kv_connector"] == "env"


def test_nested_env_uses_double_underscore(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_ALLOCATOR__BLOCK_SIZE", "32")
    assert load_settings().allocator.block_size == 32


def test_toml_file_is_reported_as_file(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('kv_connector = "null"\n[allocator]\nblock_size = 8\n')
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    s = load_settings()
    assert (s.kv_connector, s.allocator.block_size) == ("null", 8)
    assert value_sources()["allocator.block_size"] == "file"


def test_init_beats_env_beats_dotenv_beats_file(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        'kv_connector = "from-file"\nkv_role = "kv_producer"\nengine_id = "file"\nkv_load_failure_policy = "fail"\n'
    )
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    (kvdi_env / ".env").write_text("KVDI_KV_ROLE=kv_consumer\nKVDI_ENGINE_ID=dotenv\nKVDI_KV_CONNECTOR=from-dotenv\n")
    monkeypatch.setenv("KVDI_KV_CONNECTOR", "from-env")
    monkeypatch.setenv("KVDI_ENGINE_ID", "env")
    s = load_settings(engine_id="init")
    assert (s.engine_id, s.kv_connector, s.kv_role, s.kv_load_failure_policy) == (
        "init",
        "from-env",
        "kv_consumer",
        "fail",
    )
    sources = value_sources(engine_id="init")
    assert [sources[k] for k in ("engine_id", "kv_connector", "kv_role", "kv_load_failure_policy")] == [
        "init",
        "env",
        "dotenv",
        "file",
    ]


@pytest.mark.parametrize("profile", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_shipped_profile_loads(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, profile: Path) -> None:
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(profile))
    s = load_settings()
    assert value_sources()["kv_connector"] == "file"
    assert s.kv_connector


def test_required_profiles_are_shipped() -> None:
    names = {p.stem for p in PROFILES}
    assert {"default", "cpu-offload", "redis", "tiered", "disagg-producer", "disagg-consumer"} <= names


def test_missing_settings_file_names_the_env_var(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_SETTINGS_FILE", "/nonexistent/kvdi.toml")
    with pytest.raises(ConfigError, match="KVDI_SETTINGS_FILE='/nonexistent/kvdi.toml': no such file"):
        load_settings()


def test_vllm_transfer_config_json_maps_onto_fields(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "KVDI_KV_TRANSFER_CONFIG",
        '{"kv_connector": "null", "kv_role": "kv_consumer", "kv_port": 15000, "kv_connector_extra_config": {"a": 1}}',
    )
    s = load_settings()
    assert (s.kv_connector, s.kv_role, s.p2p.kv_port, s.kv_connector_extra_config) == (
        "null",
        "kv_consumer",
        15000,
        {"a": 1},
    )


def test_explicit_env_beats_transfer_config_json(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", '{"kv_role": "kv_consumer"}')
    monkeypatch.setenv("KVDI_KV_ROLE", "kv_producer")
    assert load_settings().kv_role == "kv_producer"


def test_vllm_use_v1_is_honoured_when_kvdi_use_v1_is_unset(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V1", "0")
    assert load_settings().use_v1 is False
    monkeypatch.setenv("KVDI_USE_V1", "1")
    assert load_settings().use_v1 is True


def test_bad_role_names_env_var_value_allowed_and_suggestion(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_ROLE", "kv_produce")
    with pytest.raises(ConfigError) as err:
        load_settings()
    text = str(err.value)
    assert "KVDI_KV_ROLE='kv_produce'" in text and "'kv_consumer'" in text and "did you mean 'kv_producer'" in text
    assert "\n" not in text


def test_negative_block_size_names_the_nested_env_var(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_ALLOCATOR__BLOCK_SIZE", "-4")
    with pytest.raises(ConfigError, match=r"KVDI_ALLOCATOR__BLOCK_SIZE='-4'\): Input should be greater than 0"):
        load_settings()


def test_malformed_transfer_config_json_names_the_env_var(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", '{"kv_connector": ')
    with pytest.raises(ConfigError, match="KVDI_KV_TRANSFER_CONFIG is not valid JSON"):
        load_settings()


def test_unknown_key_in_transfer_config_is_rejected(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", '{"kv_conector": "null"}')
    with pytest.raises(ConfigError, match="unknown key 'kv_conector'.*did you mean 'kv_connector'"):
        load_settings()


@pytest.mark.parametrize(
    ("var", "suggestion"),
    [("KVDI_KV_CONECTOR", "KVDI_KV_CONNECTOR"), ("KVDI_ALLOCATOR__BLOK_SIZE", "KVDI_ALLOCATOR__BLOCK_SIZE")],
)
def test_unknown_kvdi_env_var_is_an_error_with_suggestion(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, var: str, suggestion: str
) -> None:
    monkeypatch.setenv(var, "x")
    with pytest.raises(ConfigError, match=f"{var} is not a kvdi setting \\(did you mean '{suggestion}'\\?\\)"):
        load_settings()


def test_unknown_key_in_toml_file_is_rejected(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[allocator]\nblok_size = 8\n")
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    with pytest.raises(
        ConfigError,
        match=r"allocator.blok_size \(KVDI_SETTINGS_FILE='.*p\.toml' key allocator\.blok_size\): unknown setting"
        r".*did you mean 'block_size'",
    ):
        load_settings()


def test_both_budgets_are_refused(kvdi_env: Path) -> None:
    with pytest.raises(ConfigError, match="num_blocks or memory_fraction, not both"):
        load_settings(allocator={"num_blocks": 4, "memory_fraction": 0.5})


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1"])
def test_memory_fraction_outside_unit_interval_is_refused(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, fraction: str
) -> None:
    monkeypatch.setenv("KVDI_ALLOCATOR__MEMORY_FRACTION", fraction)
    with pytest.raises(ConfigError, match="KVDI_ALLOCATOR__MEMORY_FRACTION"):
        load_settings()


def test_bad_device_names_allowed_values(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_ALLOCATOR__DEVICE", "gpu")
    with pytest.raises(ConfigError, match="KVDI_ALLOCATOR__DEVICE='gpu'.*auto, cpu, cuda or cuda:N"):
        load_settings()


def test_redis_password_never_appears_in_repr(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_REDIS__URL", "redis://:hunter2@127.0.0.1:6379/0")
    s = load_settings()
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())
    assert s.redis.url.get_secret_value().startswith("redis://:hunter2@")


def test_redis_url_scheme_is_validated(kvdi_env: Path) -> None:
    with pytest.raises(ConfigError, match="KVDI_REDIS__URL.*redis://, rediss:// or unix://"):
        load_settings(redis={"url": "http://127.0.0.1"})
