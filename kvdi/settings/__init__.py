"""Typed settings for kvdi, read from init kwargs, ``KVDI_*`` env, ``.env`` and a TOML file.

A ``.env`` is shared with other tools: only its ``KVDI_*`` keys are read (:class:`KvdiDotEnvSource`).

Modules, one concept each (imports run top to bottom, no cycle):

- :mod:`~kvdi.settings.sections`: the section models (``KVDI_<SECTION>__*``) and their bounds;
- :mod:`~kvdi.settings.paths`: dotted-path flattening and nesting depth of settings data;
- :mod:`~kvdi.settings.vllm_compat`: the vLLM-compatible source (``KVDI_KV_TRANSFER_CONFIG``, ``VLLM_USE_V1``);
- :mod:`~kvdi.settings.root`: :class:`KvdiSettings` and the source order;
- :mod:`~kvdi.settings.diagnostics`: error wording, env-key checks, secret-safe value display;
- :mod:`~kvdi.settings.loading`: :func:`load_settings` and provenance (:func:`value_sources`).

Build settings with :func:`load_settings`, which turns every failure into a one-line
:class:`~kvdi.errors.ConfigError` naming the variable the user set.
"""

from kvdi.settings.diagnostics import (
    NON_SETTING_ENV_VARS,
    check_env_keys,
    describe_validation_error,
    env_var_for,
)
from kvdi.settings.loading import load_settings, value_sources
from kvdi.settings.paths import MAX_NESTING, flatten, nesting_depth
from kvdi.settings.root import ENV_PREFIX, SETTINGS_FILE_ENV, KvdiDotEnvSource, KvdiSettings, named_sources
from kvdi.settings.sections import (
    MAX_BLOCKS,
    MAX_DURATION_S,
    MAX_REDIS_TTL_S,
    MAX_STORE_BYTES,
    AllocatorSettings,
    CpuOffloadSettings,
    Dtype,
    KVRole,
    LoadFailurePolicy,
    ModelSettings,
    MultiSettings,
    P2pSettings,
    RedisSettings,
    SchedulerSettings,
    SharedStorageSettings,
    TransferSettings,
    default_cache_dir,
    physical_memory_bytes,
)
from kvdi.settings.vllm_compat import TRANSFER_CONFIG_ENV, VllmCompatSource, parse_transfer_config

__all__ = [
    "ENV_PREFIX",
    "MAX_BLOCKS",
    "MAX_DURATION_S",
    "MAX_NESTING",
    "MAX_REDIS_TTL_S",
    "MAX_STORE_BYTES",
    "NON_SETTING_ENV_VARS",
    "SETTINGS_FILE_ENV",
    "TRANSFER_CONFIG_ENV",
    "AllocatorSettings",
    "CpuOffloadSettings",
    "Dtype",
    "KVRole",
    "KvdiDotEnvSource",
    "KvdiSettings",
    "LoadFailurePolicy",
    "ModelSettings",
    "MultiSettings",
    "P2pSettings",
    "TransferSettings",
    "RedisSettings",
    "SchedulerSettings",
    "SharedStorageSettings",
    "VllmCompatSource",
    "check_env_keys",
    "default_cache_dir",
    "describe_validation_error",
    "env_var_for",
    "flatten",
    "load_settings",
    "named_sources",
    "nesting_depth",
    "parse_transfer_config",
    "physical_memory_bytes",
    "value_sources",
]
