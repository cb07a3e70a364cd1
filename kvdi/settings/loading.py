"""Building settings and telling where they came from.

:func:`load_settings` turns every failure into a one-line ConfigError naming the variable the
user set; :func:`value_sources` tells which source gave each value (provenance).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError
from pydantic_settings import DotEnvSettingsSource, EnvSettingsSource, InitSettingsSource

from kvdi.errors import ConfigError, KvdiError
from kvdi.settings.diagnostics import Loc, check_env_keys, describe_validation_error, env_var_for
from kvdi.settings.paths import MAX_NESTING, flatten
from kvdi.settings.root import ENV_PREFIX, SETTINGS_FILE_ENV, KvdiDotEnvSource, KvdiSettings, named_sources
from kvdi.settings.vllm_compat import TRANSFER_CONFIG_ENV, VLLM_KEYS, VLLM_USE_V1_ENV, is_adapter_config

_SHOWN_AS = {"vllm": "env"}
_FIELD_FROM_SOURCE = re.compile(r'field "([^"]+)" from source "(\w+)"')
KEYWORD = "keyword argument"
_ENV_VAR = re.compile(r"\bKVDI_[A-Z0-9_]*[A-Z0-9]")
_KEYWORD_ARG = re.compile(KEYWORD + r" ([a-z0-9_]+(?:\.[a-z0-9_]+)*)")


def as_keyword(dotted: str) -> str:
    """How an error names a setting given as a keyword argument: ``keyword argument redis.url``."""
    return f"{KEYWORD} {dotted}"


def as_written(text: str, overrides: dict[str, Any], name: Callable[[str], str] = as_keyword) -> str:
    """``text`` with each ``KVDI_*`` variable (and ``keyword argument x``) of a setting that ``overrides`` sets
    renamed ``name(dotted path)``: the name the user wrote (a keyword argument, an extra-config key)."""
    paths: set[str] = set()
    for path, _value in flatten(overrides):
        parts = path.split(".")
        paths.update(".".join(parts[:cut]) for cut in range(1, len(parts) + 1))
    by_var = {env_var_for(tuple(p.split("."))): p for p in paths}
    text = _ENV_VAR.sub(lambda m: name(by_var[m[0]]) if m[0] in by_var else m[0], text)
    return _KEYWORD_ARG.sub(lambda m: name(m[1]) if m[1] in paths else m[0], text)


@contextmanager
def errors_as_written(overrides: dict[str, Any], name: Callable[[str], str] = as_keyword) -> Iterator[None]:
    """Re-raise a :class:`~kvdi.errors.KvdiError` from the block with its message :func:`as_written`: validation and
    backend errors alike name the keyword argument (or ``name``) the caller wrote, not a ``KVDI_*`` variable."""
    try:
        yield
    except KvdiError as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (as_written(exc.args[0], overrides, name),)
        raise


def load_settings(**overrides: Any) -> KvdiSettings:
    """Build and validate settings; init kwargs beat every other source.

    Raises ConfigError (one line) for anything wrong: an unknown ``KVDI_*`` variable, a bad
    value (blamed on the variable, file or JSON key that gave it), unparsable JSON/TOML, or
    data nested deeper than :data:`~kvdi.settings.paths.MAX_NESTING` levels. Never echoes a secret.
    """
    check_env_keys(connector=_selected_connector(overrides))
    try:
        return KvdiSettings(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, _blamer(overrides))) from None
    except RecursionError:
        raise ConfigError(f"{_deepest_env_var()} is nested deeper than {MAX_NESTING} levels") from None
    except ValueError as exc:  # pydantic-settings' SettingsError (bad JSON in an env var) and the like
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(_describe_source_error(exc)) from None


def _selected_connector(overrides: dict[str, Any]) -> str | None:
    """``kv_connector`` as the highest source that sets it gives it (None when none does or a source is unreadable)."""
    try:
        for source in named_sources(
            KvdiSettings,
            InitSettingsSource(KvdiSettings, init_kwargs=overrides),
            EnvSettingsSource(KvdiSettings),
            DotEnvSettingsSource(KvdiSettings),
        )[1]:
            value = source().get("kv_connector")
            if value is not None:
                return str(value).strip()
    except Exception:  # the error surfaces, worded, when the settings are built
        return None
    return None


def value_sources(**overrides: Any) -> dict[str, str]:
    """Which source gave each set value, as ``{'allocator.block_size': 'env', ...}``; unset means default.

    Sources are ``init``, ``env`` (``KVDI_*`` and the vLLM-compatible variables), ``dotenv`` and ``file``.
    """
    return {path: _SHOWN_AS.get(name, name) for path, name in _origins(overrides).items()}


def _origins(overrides: dict[str, Any]) -> dict[str, str]:
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
        for path, _value in flatten(source()):
            found[path] = name
    return found


def _blamer(overrides: dict[str, Any]) -> Callable[[Loc], str]:
    try:
        origins = _origins(overrides)
    except Exception:  # the error being described may come from the same data; fall back to env names
        origins = {}

    def blame(loc: Loc) -> str:
        dotted = ".".join(str(p) for p in loc)
        name = _origin_of(dotted, origins)
        if name == "vllm":
            if loc == ("use_v1",):
                return VLLM_USE_V1_ENV
            if is_adapter_config(os.environ.get(TRANSFER_CONFIG_ENV)):  # vLLM's JSON: kvdi.* extra-config keys
                key = dotted if loc[0] in ("kv_role", "engine_id") else f"kvdi.{dotted}"
                return f"{TRANSFER_CONFIG_ENV} key {key}"
            keys = [k for k, target in VLLM_KEYS.items() if tuple(loc[: len(target)]) == target]
            return f"{TRANSFER_CONFIG_ENV} key {keys[0]}" if keys else TRANSFER_CONFIG_ENV
        if name == "file":
            return f"{SETTINGS_FILE_ENV}={os.environ.get(SETTINGS_FILE_ENV, '')!r} key {dotted}"
        if name == "dotenv":
            return f".env: {_dotenv_var_set_for(loc)}"
        if name == "env":
            return _env_var_set_for(loc)
        if name == "init":
            return as_keyword(dotted)
        return env_var_for(loc)

    return blame


def option_blamer() -> Callable[[Loc], str]:
    """What an error at a settings path blames: the variable, extra-config key or file key that set it."""
    return _blamer({})


def _origin_of(dotted: str, origins: dict[str, str]) -> str | None:
    path = dotted
    while path:
        if path in origins:
            return origins[path]
        path = path.rpartition(".")[0]
    below = [name for p, name in origins.items() if p.startswith(dotted + ".")]
    return below[0] if below else None


def _env_var_set_for(loc: Loc) -> str:
    """The ``KVDI_*`` variable really set for ``loc``: the field's own, or a section's JSON (``KVDI_REDIS key url``)."""
    present = {key.upper() for key in os.environ}
    for cut in range(len(loc), 0, -1):
        var = env_var_for(loc[:cut])
        if var in present:
            rest = ".".join(str(p) for p in loc[cut:])
            return f"{var} key {rest}" if rest else var
    return env_var_for(loc)


def _dotenv_var_set_for(loc: Loc) -> str:
    """The ``.env`` variable really set for ``loc``: the field's own, one nested below it
    (``KVDI_REDIS__URL__HOST`` for ``redis.url``), or a section's JSON (``KVDI_REDIS key url``)."""
    own = env_var_for(loc)
    try:
        keys = {key.upper() for key in KvdiDotEnvSource(KvdiSettings)._load_env_vars()}
    except Exception:  # the .env is unreadable: name the field's own variable
        return own
    if own in keys:
        return own
    below = sorted(key for key in keys if key.startswith(own + "__"))
    if below:
        return ", ".join(below[:3]) + (f" and {len(below) - 3} more" if len(below) > 3 else "")
    for cut in range(len(loc) - 1, 0, -1):
        var = env_var_for(loc[:cut])
        if var in keys:
            return f"{var} key {'.'.join(str(p) for p in loc[cut:])}"
    return own


def _describe_source_error(exc: ValueError) -> str:
    match = _FIELD_FROM_SOURCE.search(str(exc))
    if match is None:
        return f"cannot read settings: {type(exc).__name__}"
    field, source = match.groups()
    dotenv = f".env: {env_var_for((field,))}"
    where = {"EnvSettingsSource": env_var_for((field,)), "DotEnvSettingsSource": dotenv, "KvdiDotEnvSource": dotenv}
    return f"{where.get(source, field)} is not valid JSON; expected a JSON value for setting {field!r}"


def _deepest_env_var() -> str:
    """The ``KVDI_*`` variable (of the environment or the ``.env`` file, shown as ``.env: KEY``) whose value nests
    brackets deepest: a guess at what overflowed the parser."""
    candidates = [(key, value) for key, value in os.environ.items() if key.upper().startswith(ENV_PREFIX)]
    try:
        from dotenv import dotenv_values

        dotenv = dotenv_values(KvdiSettings.model_config.get("env_file") or ".env")  # type: ignore[arg-type]
    except Exception:  # no readable .env: the environment's variables are the only candidates
        dotenv = {}
    candidates += [(f".env: {key}", value or "") for key, value in dotenv.items() if key.upper().startswith(ENV_PREFIX)]
    best, best_depth = f"a {ENV_PREFIX}* variable", -1
    for key, value in candidates:
        depth = deepest = 0
        for ch in value:
            depth += 1 if ch in "[{" else -1 if ch in "]}" else 0
            deepest = max(deepest, depth)
        if deepest > best_depth:
            best, best_depth = key, deepest
    return best


__all__ = [
    "KEYWORD",
    "as_keyword",
    "as_written",
    "errors_as_written",
    "load_settings",
    "option_blamer",
    "value_sources",
]
