"""A ``.env`` shared with other tools: kvdi reads only its ``KVDI_*`` keys from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdi.containers import build_engine_container
from kvdi.errors import ConfigError
from kvdi.settings import load_settings, value_sources

# What vLLM, Hugging Face and web-app users keep next to their code.
OTHER_TOOLS = """\
HF_TOKEN=hf_notarealtoken
DATABASE_URL=postgres://app:pw@db.internal:5432/app
OPENAI_API_KEY=sk-notreal
VLLM_LOGGING_LEVEL=INFO
CUDA_VISIBLE_DEVICES=0
export PYTHONUNBUFFERED=1
"""


@pytest.fixture
def shared_dotenv(kvdi_env: Path) -> Path:
    """A ``.env`` in the working directory with other tools' variables and one kvdi setting."""
    (kvdi_env / ".env").write_text(OTHER_TOOLS + "KVDI_KV_ROLE=kv_consumer\nKVDI_ALLOCATOR__BLOCK_SIZE=32\n")
    return kvdi_env


def test_other_tools_keys_in_dotenv_are_ignored_and_kvdi_keys_are_read(shared_dotenv: Path) -> None:
    """HF_TOKEN, DATABASE_URL and the like never reach kvdi's settings; KVDI_* keys still do."""
    settings = load_settings()
    assert (settings.kv_role, settings.allocator.block_size) == ("kv_consumer", 32)
    sources = value_sources()
    assert sources["kv_role"] == sources["allocator.block_size"] == "dotenv"
    assert not any("token" in key or "database" in key for key in sources)


def test_a_misspelt_kvdi_key_in_dotenv_is_still_refused_with_a_suggestion(shared_dotenv: Path) -> None:
    """Only kvdi's own keys are checked: a typo of a kvdi setting names the .env variable and the fix."""
    (shared_dotenv / ".env").write_text(OTHER_TOOLS + "KVDI_KV_ROLLE=kv_consumer\n")
    with pytest.raises(ConfigError) as err:
        load_settings()
    text = str(err.value)
    assert "kv_rolle (.env: KVDI_KV_ROLLE): unknown setting" in text
    assert "did you mean 'kv_role'" in text
    assert "hf_token" not in text.lower() and "database" not in text.lower()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("KVDI_REDIS__URL__HOST=x", "redis.url (.env: KVDI_REDIS__URL__HOST="),
        ("KVDI_TRANSFER__ASYNC_LOAD__X=1", "transfer.async_load (.env: KVDI_TRANSFER__ASYNC_LOAD__X="),
        ("KVDI_REDIS=x", ".env: KVDI_REDIS is not valid JSON"),
    ],
)
def test_a_nesting_error_in_dotenv_names_the_variable_the_user_set(shared_dotenv: Path, line: str, named: str) -> None:
    """A key nested below a plain setting, or a section given a plain value, is blamed on the .env line as written."""
    (shared_dotenv / ".env").write_text(OTHER_TOOLS + line + "\n")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert named in str(err.value)


def test_env_only_variables_in_dotenv_are_ignored(shared_dotenv: Path) -> None:
    """KVDI_SETTINGS_FILE and KVDI_KV_TRANSFER_CONFIG are process-environment variables; a .env copy is ignored."""
    (shared_dotenv / ".env").write_text(
        OTHER_TOOLS + 'KVDI_SETTINGS_FILE=/nonexistent.toml\nKVDI_KV_TRANSFER_CONFIG={"kv_role": "kv_producer"}\n'
    )
    assert load_settings().kv_role == "kv_both"


def test_kvdi_cli_runs_in_a_folder_with_other_tools_dotenv(shared_dotenv: Path) -> None:
    """`kvdi info` started from that folder exits 0 and shows the .env's kvdi setting."""
    done = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert '"value": "kv_consumer",\n      "source": "dotenv"' in done.stdout


def test_an_app_composing_kvdi_builds_in_a_folder_with_other_tools_dotenv(shared_dotenv: Path, tmp_path: Path) -> None:
    """A dependency-injector app around kvdi (containers/prefill_decode_pair.py) builds and validates its engines."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "containers"))
    try:
        from prefill_decode_pair import PrefillDecodePair
    finally:
        sys.path.pop(0)
    app = PrefillDecodePair()
    app.config.from_dict({"store_dir": str(tmp_path / "kv"), "num_blocks": 16})
    try:
        assert app.prefill_settings().kv_role == "kv_producer"
        assert app.decode_settings().allocator.block_size == 32
        container = build_engine_container(app.decode_settings())
        assert container.kv.connector().spec.name == "shared_storage"
    finally:
        app.shutdown_resources()


def test_deep_json_in_dotenv_is_blamed_on_the_dotenv_variable(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON nested past the parser's depth in a ``.env`` line names that line's variable, not a ``KVDI_*``
    variable of the environment that merely holds brackets (issue 28, item 6)."""
    monkeypatch.setenv("KVDI_MULTI__TIERS", '["cpu_offload", "shared_storage"]')
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    (kvdi_env / ".env").write_text(OTHER_TOOLS + f"KVDI_KV_CONNECTOR_EXTRA_CONFIG={deep}\n")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert ".env: KVDI_KV_CONNECTOR_EXTRA_CONFIG is nested deeper than 32 levels" in str(err.value)
    assert "KVDI_MULTI__TIERS" not in str(err.value) and "hf_" not in str(err.value)
