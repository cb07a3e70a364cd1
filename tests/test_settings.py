"""Settings sources, precedence and one-line errors naming the env var."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, SecretStr, ValidationError

from kvdi.errors import ConfigError
from kvdi.settings import (
    NON_SETTING_ENV_VARS,
    describe_validation_error,
    flatten,
    load_settings,
    nesting_depth,
    value_sources,
)

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
    with pytest.raises(ConfigError, match="keyword argument redis.url.*redis://, rediss:// or unix://"):
        load_settings(redis={"url": "http://127.0.0.1"})


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("KVDI_ALLOCATOR__NUM_BLOCKS", "1e15", "valid integer"),
        ("KVDI_ALLOCATOR__NUM_BLOCKS", str(2**31), "less than or equal to 2147483647"),
        ("KVDI_CPU_OFFLOAD__MAX_BYTES", "1e18", "valid integer"),
        ("KVDI_CPU_OFFLOAD__MAX_BYTES", str(10**18), "physical memory"),
        ("KVDI_P2P__MAX_HELD_BYTES", str(10**18), "physical memory"),
        ("KVDI_REDIS__TTL_S", "9223372036854775808", "less than or equal to 2147483647"),
        ("KVDI_REDIS__OP_TIMEOUT_S", "1e300", "less than or equal to 86400"),
        ("KVDI_REDIS__CONNECT_TIMEOUT_S", "nan", "finite number"),
        ("KVDI_P2P__TIMEOUT_S", "inf", "finite number"),
        ("KVDI_P2P__HOLD_S", "-inf", "finite number"),
        ("KVDI_SHARED_STORAGE__PATH", "/proc/self/kv", "kernel file system"),
        ("KVDI_SHARED_STORAGE__MAX_BYTES", str(2**63), "less than or equal to"),
        ("KVDI_MODEL__NUM_LAYERS", "100000", "less than or equal to 1024"),
        ("KVDI_SCHEDULER__MAX_NUM_SEQS", str(2**40), "less than or equal to"),
    ],
)
def test_absurd_numbers_and_paths_are_refused_naming_the_variable(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str, expected: str
) -> None:
    """Every number has an upper bound (finite durations, Redis' TTL, the machine's memory)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=rf"\({var}='{re.escape(value)}'\): .*{expected}"):
        load_settings()


def test_a_store_path_that_is_a_file_is_refused(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (kvdi_env / "file").write_text("x")
    monkeypatch.setenv("KVDI_SHARED_STORAGE__PATH", str(kvdi_env / "file"))
    with pytest.raises(ConfigError, match="KVDI_SHARED_STORAGE__PATH=.*exists and is not a directory"):
        load_settings()


def test_a_store_path_with_nul_is_refused_from_a_toml_file(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The environment cannot carry NUL, a TOML string can; the error names the file."""
    path = tmp_path / "p.toml"
    path.write_text('[shared_storage]\npath = "/tmp/a\\u0000b"\n')
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    with pytest.raises(ConfigError, match=r"KVDI_SETTINGS_FILE='.*p\.toml' key shared_storage\.path=.*NUL"):
        load_settings()


def test_a_bad_port_in_transfer_config_is_blamed_on_that_variable(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", '{"kv_port": 70000}')
    with pytest.raises(ConfigError, match=r"p2p\.kv_port \(KVDI_KV_TRANSFER_CONFIG key kv_port=70000\)") as info:
        load_settings()
    assert "KVDI_P2P__KV_PORT" not in str(info.value)


def test_a_section_json_env_var_is_blamed_with_its_key(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_P2P", '{"timeout_s": 1e300}')
    with pytest.raises(ConfigError, match=r"p2p\.timeout_s \(KVDI_P2P key timeout_s=1e\+300\)"):
        load_settings()


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5000 + "]" * 5000,
        "x." * 5000 + "y = 1",
        "[kv_connector_extra_config]\na = " + "[" * 40 + "]" * 40,
    ],
    ids=["arrays", "dotted-keys", "extra-config"],
)
def test_deeply_nested_toml_is_a_config_error(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str
) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(text + "\n")
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    with pytest.raises(ConfigError, match="KVDI_SETTINGS_FILE=.*nested deeper than 32 levels"):
        load_settings()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVDI_KV_TRANSFER_CONFIG", '{"kv_connector_extra_config": ' + "[" * 5000 + "]" * 5000 + "}"),
        ("KVDI_KV_TRANSFER_CONFIG", '{"kv_connector_extra_config": {"a": ' + "[" * 40 + "]" * 40 + "}}"),
        ("KVDI_KV_CONNECTOR_EXTRA_CONFIG", '{"a": ' + "[" * 5000 + "]" * 5000 + "}"),
    ],
    ids=["transfer-config-recursion", "transfer-config-depth", "extra-config-env"],
)
def test_deeply_nested_json_is_a_config_error(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var}.*nested deeper than 32 levels"):
        load_settings()


def test_kvdi_test_redis_server_is_not_taken_for_a_setting(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kvdi's test tooling names its own variable (kvdi.testing), under the prefix settings leave alone, in the
    process environment and in a .env alike; production settings do not know it."""
    import kvdi.settings
    from kvdi.settings.root import TOOLING_ENV_PREFIX
    from kvdi.testing.redis_server import TEST_REDIS_SERVER_ENV

    assert TEST_REDIS_SERVER_ENV.startswith(TOOLING_ENV_PREFIX) and TEST_REDIS_SERVER_ENV not in NON_SETTING_ENV_VARS
    assert not hasattr(kvdi.settings, "TEST_REDIS_SERVER_ENV")
    monkeypatch.setenv(TEST_REDIS_SERVER_ENV, "/usr/bin/redis-server")
    assert load_settings().kv_connector == "shared_storage"
    monkeypatch.delenv(TEST_REDIS_SERVER_ENV)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text(f"{TEST_REDIS_SERVER_ENV}=/usr/bin/redis-server\n")
    assert load_settings().kv_connector == "shared_storage"


def test_a_secret_fields_input_is_never_echoed(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_REDIS__URL", "http://h/0?password=hunter2")
    with pytest.raises(ConfigError, match=r"redis\.url \(KVDI_REDIS__URL=\*\*\*\): .*must start with redis://") as info:
        load_settings()
    assert "hunter2" not in str(info.value)


def test_a_url_in_a_plain_field_is_shown_masked(kvdi_env: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(kv_role="redis://:pa/ss#wd@h/0")
    assert "redis://:***@h/0" in str(info.value) and "pa/ss" not in str(info.value)


def test_value_sources_name_the_transfer_config_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", '{"kv_port": 15000}')
    assert value_sources()["p2p.kv_port"] == "env"
    assert load_settings().p2p.kv_port == 15000


def test_any_secretstr_field_error_shows_stars_not_its_input() -> None:
    """Not only redis.url: every SecretStr field (optional ones too) hides its input in error messages."""

    class WithSecret(BaseModel):
        blob: SecretStr | None = Field(None, min_length=20)

    with pytest.raises(ValidationError) as info:
        WithSecret(blob="short-but-secret")
    text = describe_validation_error(info.value, model=WithSecret)
    assert "blob (KVDI_BLOB=***)" in text and "short-but-secret" not in text


def test_flatten_keeps_extra_config_whole_and_survives_depth() -> None:
    data = {"a": {"b": 1, "c": {}}, "kv_connector_extra_config": {"x": {"y": 2}}}
    assert flatten(data) == [("a.b", 1), ("a.c", {}), ("kv_connector_extra_config", {"x": {"y": 2}})]
    deep: dict[str, object] = {}
    node = deep
    for _ in range(5000):
        node["k"] = node = {}
    assert len(flatten(deep)) == 1 and nesting_depth(deep) == 33
