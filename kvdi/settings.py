"""Typed settings for kvdi, read from init kwargs, ``KVDI_*`` env, ``.env`` and a TOML file.

Precedence (highest first) is the tuple returned by
:meth:`KvdiSettings.settings_customise_sources`: init kwargs > ``KVDI_*`` env >
vLLM-compatible env (``KVDI_KV_TRANSFER_CONFIG`` JSON, ``VLLM_USE_V1``) > ``.env`` >
the TOML file named by ``KVDI_SETTINGS_FILE`` > defaults.
Build settings with :func:`load_settings`, which turns validation failures into one-line
:class:`~kvdi.errors.ConfigError` messages naming the env var.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvdi.errors import ConfigError, did_you_mean

ENV_PREFIX = "KVDI_"
SETTINGS_FILE_ENV = "KVDI_SETTINGS_FILE"
TRANSFER_CONFIG_ENV = "KVDI_KV_TRANSFER_CONFIG"

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
LoadFailurePolicy = Literal["recompute", "fail"]
Dtype = Literal["float32", "float16", "bfloat16"]

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def default_cache_dir() -> Path:
    """Where the embedded default stores KV: ``$XDG_CACHE_HOME/kvdi/kv`` (or ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvdi" / "kv"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AllocatorSettings(_Section):
    """Where and how large the paged KV cache is (``KVDI_ALLOCATOR__*``)."""

    device: str = "auto"
    dtype: Dtype = "float32"
    block_size: int = Field(16, gt=0, le=4096)
    num_blocks: int | None = Field(None, gt=0)
    memory_fraction: float | None = Field(None, gt=0.0, le=1.0)
    pin_memory: bool = True

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> AllocatorSettings:
        if self.num_blocks is not None and self.memory_fraction is not None:
            raise ValueError("set num_blocks or memory_fraction, not both")
        return self


class ModelSettings(_Section):
    """Shape of the reference engine's model (``KVDI_MODEL__*``)."""

    model_id: str = "kvdi-tiny"
    num_layers: int = Field(4, gt=0)
    hidden_size: int = Field(256, gt=0)
    num_heads: int = Field(8, gt=0)
    num_kv_heads: int = Field(4, gt=0)
    head_dim: int = Field(32, gt=0)
    intermediate_size: int = Field(512, gt=0)
    vocab_size: int = Field(1024, gt=1)
    max_model_len: int = Field(4096, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _gqa(self) -> ModelSettings:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class SchedulerSettings(_Section):
    """Reference engine scheduler limits (``KVDI_SCHEDULER__*``)."""

    max_num_batched_tokens: int = Field(2048, gt=0)
    max_num_seqs: int = Field(16, gt=0)


class SharedStorageSettings(_Section):
    """Local directory of framed KV objects (``KVDI_SHARED_STORAGE__*``)."""

    path: Path = Field(default_factory=default_cache_dir)
    max_bytes: int | None = Field(None, gt=0)


class CpuOffloadSettings(_Section):
    """Host memory pool (``KVDI_CPU_OFFLOAD__*``)."""

    max_bytes: int = Field(1 << 30, gt=0)


class RedisSettings(_Section):
    """Redis server (``KVDI_REDIS__*``); the URL may carry a password and is masked when shown."""

    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    key_prefix: str = "kvdi:"
    ttl_s: int | None = Field(None, gt=0)
    connect_timeout_s: float = Field(1.0, gt=0)
    op_timeout_s: float = Field(2.0, gt=0)
    breaker_failures: int = Field(3, gt=0)
    breaker_reset_s: float = Field(5.0, gt=0)

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value()
        if not raw.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("url must start with redis://, rediss:// or unix://")
        return value


class MultiSettings(_Section):
    """Tiers tried in order for loads, all written on saves (``KVDI_MULTI__*``)."""

    tiers: tuple[str, ...] = ("cpu_offload", "shared_storage")

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("tiers must name at least one connector")
        if "multi" in value:
            raise ValueError("multi cannot be one of its own tiers")
        return value


class P2pSettings(_Section):
    """Peer-to-peer transfer over torch.distributed (``KVDI_P2P__*``)."""

    kv_ip: str = "127.0.0.1"
    kv_port: int = Field(14579, gt=0, lt=65536)
    kv_rank: int = Field(0, ge=0)
    kv_parallel_size: int = Field(2, gt=1)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False)
    connect_timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    hold_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    max_held_bytes: int = Field(1 << 30, gt=0, le=1 << 40)
    auth_token: SecretStr | None = None  # shared by both peers; HMAC challenge in the handshake


# vLLM KVTransferConfig keys accepted in KVDI_KV_TRANSFER_CONFIG, and where each lands.
_VLLM_KEYS: dict[str, tuple[str, ...]] = {
    "kv_connector": ("kv_connector",),
    "kv_role": ("kv_role",),
    "kv_connector_module_path": ("kv_connector_module_path",),
    "kv_connector_extra_config": ("kv_connector_extra_config",),
    "engine_id": ("engine_id",),
    "kv_load_failure_policy": ("kv_load_failure_policy",),
    "kv_ip": ("p2p", "kv_ip"),
    "kv_port": ("p2p", "kv_port"),
    "kv_rank": ("p2p", "kv_rank"),
    "kv_parallel_size": ("p2p", "kv_parallel_size"),
}


class VllmCompatSource(PydanticBaseSettingsSource):
    """Reads vLLM-style config: ``KVDI_KV_TRANSFER_CONFIG`` JSON and ``VLLM_USE_V1``."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        raw = os.environ.get(TRANSFER_CONFIG_ENV)
        if raw:
            out.update(parse_transfer_config(raw))
        vllm_v1 = os.environ.get("VLLM_USE_V1")
        if vllm_v1 is not None and vllm_v1.strip() != "":
            out["use_v1"] = vllm_v1
        return out


def parse_transfer_config(raw: str) -> dict[str, Any]:
    """Map vLLM's ``--kv-transfer-config`` JSON onto kvdi's fields; raise ConfigError if malformed."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{TRANSFER_CONFIG_ENV} is not valid JSON ({exc.msg} at char {exc.pos}): {raw[:80]!r}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{TRANSFER_CONFIG_ENV} must be a JSON object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _VLLM_KEYS:
            raise ConfigError(
                f"{TRANSFER_CONFIG_ENV} has unknown key {key!r}; allowed: {', '.join(_VLLM_KEYS)}"
                f"{did_you_mean(key, _VLLM_KEYS)}"
            )
        *parents, leaf = _VLLM_KEYS[key]
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


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

    kv_connector: str = "shared_storage"
    kv_role: KVRole = "kv_both"
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    kv_load_failure_policy: LoadFailurePolicy = "recompute"
    use_v1: bool = True

    allocator: AllocatorSettings = AllocatorSettings()
    model: ModelSettings = ModelSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    shared_storage: SharedStorageSettings = Field(default_factory=SharedStorageSettings)
    cpu_offload: CpuOffloadSettings = CpuOffloadSettings()
    redis: RedisSettings = RedisSettings()
    multi: MultiSettings = MultiSettings()
    p2p: P2pSettings = P2pSettings()

    @field_validator("kv_connector")
    @classmethod
    def _connector_name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("kv_connector must not be empty")
        return value.strip()

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
    """The one ordered list of sources, highest precedence first, with a name for each."""
    names: list[str] = ["init", "env", "env", "dotenv"]
    sources: list[PydanticBaseSettingsSource] = [
        init_settings,
        env_settings,
        VllmCompatSource(settings_cls),
        dotenv_settings,
    ]
    toml_file = os.environ.get(SETTINGS_FILE_ENV)
    if toml_file:
        path = Path(toml_file)
        if not path.is_file():
            raise ConfigError(f"{SETTINGS_FILE_ENV}={toml_file!r}: no such file")
        names.append("file")
        sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
    return tuple(names), tuple(sources)


def load_settings(**overrides: Any) -> KvdiSettings:
    """Build and validate settings; init kwargs beat every other source. Raises ConfigError."""
    check_env_keys()
    try:
        return KvdiSettings(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except ValueError as exc:  # TOML syntax errors and source-level failures
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"cannot read settings: {exc}") from None


def env_var_for(loc: tuple[str | int, ...]) -> str:
    """The env var that sets a field path, e.g. ``('allocator', 'block_size')`` -> ``KVDI_ALLOCATOR__BLOCK_SIZE``."""
    return ENV_PREFIX + "__".join(str(part).upper() for part in loc)


def describe_validation_error(exc: ValidationError) -> str:
    """One line per error joined with '; ': setting, env var, bad value, what is allowed."""
    parts = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not isinstance(p, int))
        setting = ".".join(str(p) for p in loc) or "settings"
        value = err.get("input")
        msg = err["msg"]
        hint = ""
        expected = (err.get("ctx") or {}).get("expected")
        if isinstance(value, str) and isinstance(expected, str):
            hint = did_you_mean(value, re.findall(r"'([^']+)'", expected))
        if err["type"] == "extra_forbidden":
            known = _known_names(loc[:-1])
            hint = did_you_mean(str(loc[-1]), known)
            msg = f"unknown setting; known: {', '.join(sorted(known))}"
            value_txt = ""
        else:
            value_txt = f"={_show(value)}"
        parts.append(f"{setting} ({env_var_for(loc)}{value_txt}): {msg}{hint}")
    return "invalid settings: " + "; ".join(parts)


def _show(value: Any) -> str:
    text = repr(value)
    if re.search(r"://[^/@]*:[^/@]*@", text):
        text = re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", text)
    return text if len(text) <= 60 else text[:57] + "..."


def _known_names(parent: tuple[str | int, ...]) -> list[str]:
    model: type[BaseModel] = KvdiSettings
    for part in parent:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def check_env_keys(environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for a ``KVDI_*`` env var that names no setting (with a did-you-mean)."""
    env = os.environ if environ is None else environ
    allowed = {SETTINGS_FILE_ENV, TRANSFER_CONFIG_ENV}
    for key in env:
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in allowed:
            continue
        path = upper[len(ENV_PREFIX) :].lower().split("__")
        model: type[BaseModel] = KvdiSettings
        for depth, part in enumerate(path):
            fields = model.model_fields
            if part not in fields:
                candidates = [env_var_for((*path[:depth], name)) for name in fields]
                if depth == 0:
                    candidates += sorted(allowed)
                raise ConfigError(f"{key} is not a kvdi setting{did_you_mean(upper, candidates)}")
            annotation = fields[part].annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                break  # a leaf; deeper parts belong to a dict value such as extra config
            model = annotation


def value_sources(**overrides: Any) -> dict[str, str]:
    """Which source gave each set value, as ``{'allocator.block_size': 'env', ...}``; unset means default."""
    cls = KvdiSettings
    names, sources = named_sources(
        cls,
        InitSettingsSource(cls, init_kwargs=overrides),
        EnvSettingsSource(cls),
        DotEnvSettingsSource(cls),
    )
    found: dict[str, str] = {}
    # Walk lowest precedence first so higher sources overwrite.
    for name, source in reversed(list(zip(names, sources, strict=True))):
        for path in _flatten(source()):
            found[path] = name
    return found


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and key != "kv_connector_extra_config":
            paths.extend(_flatten(value, path + "."))
        else:
            paths.append(path)
    return paths
