""":class:`KvdiSettings`, the root settings model, and the one ordered list of its sources.

Precedence (highest first), as :func:`named_sources` returns it: init kwargs > ``KVDI_*`` env >
vLLM-compatible env (``KVDI_KV_TRANSFER_CONFIG`` JSON, ``VLLM_USE_V1``) > ``.env`` (its ``KVDI_*``
keys only: :class:`KvdiDotEnvSource`) > the TOML file named by ``KVDI_SETTINGS_FILE`` > defaults.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvdi.errors import ConfigError
from kvdi.masking import MaskedDict
from kvdi.settings.paths import MAX_NESTING, nesting_depth
from kvdi.settings.sections import (
    AllocatorSettings,
    CpuOffloadSettings,
    KVRole,
    LoadFailurePolicy,
    ModelSettings,
    MultiSettings,
    P2pSettings,
    RedisSettings,
    SchedulerSettings,
    SharedStorageSettings,
    TransferSettings,
)
from kvdi.settings.vllm_compat import TRANSFER_CONFIG_ENV, VllmCompatSource

MAX_SETTINGS_FILE_BYTES = 1 << 20
"""The largest KVDI_SETTINGS_FILE read (real ones are a few KB; parsing a huge one would take seconds)."""
ENV_PREFIX = "KVDI_"
SETTINGS_FILE_ENV = "KVDI_SETTINGS_FILE"
ENV_ONLY_VARS = (SETTINGS_FILE_ENV, TRANSFER_CONFIG_ENV)
"""``KVDI_`` variables read from the process environment only, never from ``.env``."""
TOOLING_ENV_PREFIX = "KVDI_TEST_"
"""Variables of kvdi's test tooling (:mod:`kvdi.testing`, which names them), never settings: settings ignore them."""

# Source names, highest precedence first; "vllm" is shown as "env" by value_sources.
SOURCE_NAMES = ("init", "env", "vllm", "dotenv", "file")


class KvdiDotEnvSource(DotEnvSettingsSource):
    """``.env`` as kvdi reads it: only ``KVDI_*`` keys; every other key belongs to other tools and is ignored.

    A ``.env`` is shared with vLLM, Hugging Face and the app around kvdi (``HF_TOKEN``,
    ``DATABASE_URL``); those keys are none of kvdi's business. A ``KVDI_*`` key that names no
    setting is still refused (it is a typo of ours). The variables that only the process
    environment sets (``KVDI_SETTINGS_FILE``, ``KVDI_KV_TRANSFER_CONFIG``) are ignored here too.
    """

    def _load_env_vars(self) -> Mapping[str, str | None]:
        prefix = ENV_PREFIX.lower()
        env_only = {name.lower() for name in ENV_ONLY_VARS}
        return {
            key: value
            for key, value in super()._load_env_vars().items()
            if key.lower().startswith(prefix)
            and key.lower() not in env_only
            and not key.lower().startswith(TOOLING_ENV_PREFIX.lower())
        }

    def __call__(self) -> dict[str, Any]:
        # pydantic-settings keeps an unknown key with its prefix under extra="forbid"; strip it so
        # the error names the setting (``kv_rolle``) and the variable (``KVDI_KV_ROLLE``) as env does.
        prefix = ENV_PREFIX.lower()
        out: dict[str, Any] = {}
        for key, value in super().__call__().items():
            key = key.removeprefix(prefix)
            head, sep, _rest = key.partition("__")
            if sep and head not in KvdiSettings.model_fields:  # a plugin connector's section: nest it as env does
                _put(out, key.split("__"), value)
            else:
                out[key] = value
        return out


class ConnectorEnvSource(PydanticBaseSettingsSource):
    """``KVDI_<NAME>__<FIELD>`` variables whose ``<NAME>`` is no KvdiSettings field: a plugin connector's options,
    nested as ``{"<name>": {"<field>": value}}`` (``KvdiSettings`` keeps the selected connector's, refuses others)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in os.environ.items():
            lower = key.lower()
            if not lower.startswith(ENV_PREFIX.lower()) or lower.startswith(TOOLING_ENV_PREFIX.lower()):
                continue
            parts = lower[len(ENV_PREFIX) :].split("__")
            if len(parts) > 1 and parts[0] not in KvdiSettings.model_fields:
                _put(out, parts, value)
        return out


def _put(out: dict[str, Any], parts: list[str], value: Any) -> None:
    node = out
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return
        node = child
    node[parts[-1]] = value


class KvdiSettings(BaseSettings):
    """Everything kvdi reads from its environment; field names follow vLLM's KVTransferConfig."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        env_file=".env",
        extra="forbid",
        frozen=True,
        case_sensitive=False,
    )

    kv_connector: str = Field("shared_storage", max_length=256)
    kv_role: KVRole = "kv_both"
    kv_connector_module_path: str | None = Field(None, max_length=1024)
    kv_connector_extra_config: MaskedDict = Field(default_factory=dict)  # secret-looking keys masked when shown
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=256)
    kv_load_failure_policy: LoadFailurePolicy = "recompute"
    use_v1: bool = True
    model_revision: str | None = Field(None, min_length=1, max_length=256)
    """Inside vLLM: the weights' identity in every stored key, instead of a digest of the weight files.

    Set it when you manage weight versions yourself (e.g. ``llama-3-8b@2024-06-01``); equal
    values share KV, so make it name the model and its version. See docs/vllm.md.
    """
    integrity_key: SecretStr | None = None
    """A secret that makes every stored frame carry a keyed MAC (see README "Security")."""
    integrity_key_file: Path | None = None
    """A file holding the integrity key (owner-only, not a symlink); instead of ``integrity_key``."""

    allocator: AllocatorSettings = AllocatorSettings()
    model: ModelSettings = ModelSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    shared_storage: SharedStorageSettings = Field(default_factory=SharedStorageSettings)
    cpu_offload: CpuOffloadSettings = CpuOffloadSettings()
    redis: RedisSettings = RedisSettings()
    multi: MultiSettings = MultiSettings()
    p2p: P2pSettings = P2pSettings()
    transfer: TransferSettings = TransferSettings()
    plugin_options: dict[str, Any] = Field(default_factory=dict, exclude=True)
    """The selected plugin connector's raw options (the ``<name>`` section of every source); validated by the
    connector's own model when the connector is built (:func:`kvdi.containers.connector_options`)."""

    @model_validator(mode="before")
    @classmethod
    def _plugin_section(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = str(data.get("kv_connector") or "").strip().lower()
        key = next((k for k in data if str(k).lower() == name and k not in cls.model_fields), None)
        if key is None:
            return data
        data = dict(data)
        section = data.pop(key)
        data["plugin_options"] = section
        return data

    @field_validator("kv_connector")
    @classmethod
    def _connector_name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("kv_connector must not be empty")
        return value.strip()

    @field_validator("kv_connector_extra_config")
    @classmethod
    def _extra_depth(cls, value: dict[str, Any]) -> dict[str, Any]:
        if nesting_depth(value) > MAX_NESTING:
            raise ValueError(f"nested deeper than {MAX_NESTING} levels")
        return value

    @property
    def is_producer(self) -> bool:
        """True when this engine saves KV (``kv_producer`` or ``kv_both``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True when this engine loads KV (``kv_consumer`` or ``kv_both``)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return named_sources(settings_cls, init_settings, env_settings, dotenv_settings)[1]


def named_sources(
    settings_cls: type[BaseSettings],
    init_settings: PydanticBaseSettingsSource,
    env_settings: PydanticBaseSettingsSource,
    dotenv_settings: PydanticBaseSettingsSource,
) -> tuple[tuple[str, ...], tuple[PydanticBaseSettingsSource, ...]]:
    """The one ordered list of sources, highest precedence first, with a name from :data:`SOURCE_NAMES` for each.

    Raises ConfigError naming ``KVDI_SETTINGS_FILE`` when that file is missing, unreadable,
    not TOML, or nested deeper than :data:`~kvdi.settings.paths.MAX_NESTING` levels.
    """
    names: list[str] = ["init", "env", "env", "vllm", "dotenv"]
    if isinstance(dotenv_settings, DotEnvSettingsSource) and not isinstance(dotenv_settings, KvdiDotEnvSource):
        dotenv_settings = KvdiDotEnvSource(
            settings_cls, env_file=dotenv_settings.env_file, env_file_encoding=dotenv_settings.env_file_encoding
        )
    sources: list[PydanticBaseSettingsSource] = [
        init_settings,
        env_settings,
        ConnectorEnvSource(settings_cls),
        VllmCompatSource(settings_cls),
        dotenv_settings,
    ]
    toml_file = os.environ.get(SETTINGS_FILE_ENV)
    if toml_file:
        names.append("file")
        sources.append(_toml_source(settings_cls, toml_file))
    return tuple(names), tuple(sources)


def _toml_source(settings_cls: type[BaseSettings], toml_file: str) -> TomlConfigSettingsSource:
    where = f"{SETTINGS_FILE_ENV}={toml_file!r}"
    try:
        path = Path(toml_file)
        if not path.is_file():
            raise ConfigError(f"{where}: no such file")
        if path.stat().st_size > MAX_SETTINGS_FILE_BYTES:  # parsing is slow (and read twice on an error)
            raise ConfigError(
                f"{where}: {path.stat().st_size} B; a settings file is at most {MAX_SETTINGS_FILE_BYTES} B"
            )
        source = TomlConfigSettingsSource(settings_cls, toml_file=path)
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {MAX_NESTING} levels") from None
    except (OSError, ValueError) as exc:  # tomllib's / tomli's TOMLDecodeError and UnicodeDecodeError are ValueErrors
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: not a readable TOML file ({type(exc).__name__}: {exc})") from None
    if nesting_depth(source.toml_data) > MAX_NESTING:
        raise ConfigError(f"{where}: nested deeper than {MAX_NESTING} levels")
    return source


__all__ = [
    "ENV_ONLY_VARS",
    "TOOLING_ENV_PREFIX",
    "ENV_PREFIX",
    "SETTINGS_FILE_ENV",
    "SOURCE_NAMES",
    "ConnectorEnvSource",
    "KvdiDotEnvSource",
    "KvdiSettings",
    "named_sources",
]
