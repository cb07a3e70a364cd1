"""Every settings error is one short line, whatever the input: lists capped, echoed names and values cut."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from kvdi.settings.diagnostics import MAX_ERRORS

LINE = 2000  # the longest error line any test below accepts


def config_error(**overrides: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_settings_file_with_100000_unknown_keys_is_one_short_line(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "huge.toml"
    path.write_text("[allocator]\n" + "".join(f"unknown_{i} = 1\n" for i in range(100_000)))
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    message = config_error()
    assert len(message) < LINE and "KVDI_SETTINGS_FILE" in message and "at most" in message


def test_many_unknown_keys_are_capped_and_the_known_names_listed_once(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "many.toml"
    path.write_text("[allocator]\n" + "".join(f"u{i} = 1\n" for i in range(20_000)))
    monkeypatch.setenv("KVDI_SETTINGS_FILE", str(path))
    message = config_error()
    assert len(message) < LINE
    assert f"and {20_000 - MAX_ERRORS} more errors" in message
    assert message.count("known: ") == 1 and "block_size" in message


def test_a_100000_character_unknown_variable_name_is_cut(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_" + "X" * 100_000, "1")
    message = config_error()
    assert len(message) < 300 and "..." in message and "is not a kvdi setting" in message


def test_a_100000_character_unknown_key_in_a_section_is_cut(kvdi_env: Path) -> None:
    message = config_error(allocator={"b" * 100_000: 1})
    assert len(message) < LINE and "..." in message and "unknown setting" in message


@pytest.mark.parametrize(
    "overrides",
    [
        {"kv_connector": "x" * 100_000},
        {"allocator": {"block_size": "9" * 100_000}},
        {"allocator": {"dtype": "f" * 10**5}},
    ],
    ids=["long-string", "long-number", "long-choice"],
)
def test_a_huge_bad_value_is_cut_with_an_ellipsis(kvdi_env: Path, overrides: dict[str, object]) -> None:
    message = config_error(**overrides)
    assert len(message) < LINE and "..." in message


def test_many_bad_values_in_one_mapping_are_capped(kvdi_env: Path) -> None:
    message = config_error(allocator={f"k{i}": i for i in range(5000)})
    assert len(message) < LINE and "more errors" in message


@pytest.mark.parametrize("kind", ["file", "env"])
def test_the_cli_prints_one_bounded_line_and_exits_2(kind: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDI_")}
    if kind == "file":
        path = tmp_path / "many.toml"
        path.write_text("[allocator]\n" + "".join(f"u{i} = 1\n" for i in range(20_000)))
        env["KVDI_SETTINGS_FILE"] = str(path)
    else:
        env["KVDI_" + "Y" * 100_000] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "info"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < LINE and "Traceback" not in done.stderr
