"""Wording of settings errors: which variable, which value (never a secret's), what is allowed.

- :func:`env_var_for`: the ``KVDI_*`` variable of a field path;
- :func:`check_env_keys`: a ``KVDI_*`` variable that names no setting is refused with a
  did-you-mean; :data:`NON_SETTING_ENV_VARS` lists the ``KVDI_`` variables that are not settings;
- :func:`describe_validation_error`: one line per pydantic error, blamed on the variable the
  user set (``blame``), with the input masked: a secret field's input is shown as ``***``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, get_args

from pydantic import BaseModel, SecretStr, ValidationError

from kvdi.errors import ConfigError, did_you_mean
from kvdi.masking import MASK, is_secret_key, mask_value
from kvdi.settings.root import ENV_PREFIX, SETTINGS_FILE_ENV, KvdiSettings
from kvdi.settings.vllm_compat import TRANSFER_CONFIG_ENV

TEST_REDIS_SERVER_ENV = "KVDI_TEST_REDIS_SERVER"

# KVDI_ variables that are not settings: the settings file, vLLM's transfer-config JSON, and the
# Redis server kvdi's own tests use (kvdi.testing.redis_server); check_env_keys lets them pass.
NON_SETTING_ENV_VARS = frozenset({SETTINGS_FILE_ENV, TRANSFER_CONFIG_ENV, TEST_REDIS_SERVER_ENV})

Loc = tuple[str | int, ...]


def env_var_for(loc: Loc) -> str:
    """The env var that sets a field path, e.g. ``('allocator', 'block_size')`` -> ``KVDI_ALLOCATOR__BLOCK_SIZE``."""
    return ENV_PREFIX + "__".join(str(part).upper() for part in loc)


def describe_validation_error(
    exc: ValidationError,
    blame: Callable[[Loc], str] | None = None,
    model: type[BaseModel] = KvdiSettings,
) -> str:
    """One part per error joined with '; ': setting, variable, value, what is allowed.

    The variable is ``blame(loc)`` (default :func:`env_var_for`). The value shown is masked
    (:func:`kvdi.masking.mask_value`); a secret field's input is ``***``.
    """
    name_of = blame or env_var_for
    parts = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not isinstance(p, int))
        setting = ".".join(str(p) for p in loc) or "settings"
        value = err.get("input")
        msg = err["msg"]
        hint = ""
        expected = (err.get("ctx") or {}).get("expected")
        secret = _is_secret_field(model, loc)
        if isinstance(value, str) and isinstance(expected, str) and not secret:
            hint = did_you_mean(value, re.findall(r"'([^']+)'", expected))
        if err["type"] == "extra_forbidden":
            known = _known_names(model, loc[:-1])
            hint = did_you_mean(str(loc[-1]), known)
            msg = f"unknown setting; known: {', '.join(sorted(known))}"
            value_txt = ""
        else:
            value_txt = f"={MASK if secret else _show(setting, value)}"
        parts.append(f"{setting} ({name_of(loc)}{value_txt}): {msg}{hint}")
    return "invalid settings: " + "; ".join(parts)


def _show(path: str, value: Any) -> str:
    text = repr(mask_value(path, value))
    return text if len(text) <= 60 else text[:57] + "..."


def _field_annotation(model: type[BaseModel], loc: Loc) -> Any:
    annotation: Any = model
    for part in loc:
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        field = annotation.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
    return annotation


def _is_secret_field(model: type[BaseModel], loc: Loc) -> bool:
    if loc and is_secret_key(str(loc[-1])):
        return True
    annotation = _field_annotation(model, loc)
    return annotation is SecretStr or SecretStr in get_args(annotation)


def _known_names(model: type[BaseModel], parent: Loc) -> list[str]:
    annotation = _field_annotation(model, parent)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def check_env_keys(environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for a ``KVDI_*`` env var that names no setting (with a did-you-mean).

    The variables of :data:`NON_SETTING_ENV_VARS` are allowed.
    """
    env = os.environ if environ is None else environ
    for key in env:
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NON_SETTING_ENV_VARS:
            continue
        path = upper[len(ENV_PREFIX) :].lower().split("__")
        model: type[BaseModel] = KvdiSettings
        for depth, part in enumerate(path):
            fields = model.model_fields
            if part not in fields:
                candidates = [env_var_for((*path[:depth], name)) for name in fields]
                if depth == 0:
                    candidates += sorted(NON_SETTING_ENV_VARS)
                raise ConfigError(f"{key} is not a kvdi setting{did_you_mean(upper, candidates)}")
            annotation = fields[part].annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                break  # a leaf; deeper parts belong to a dict value such as extra config
            model = annotation


__all__ = [
    "NON_SETTING_ENV_VARS",
    "TEST_REDIS_SERVER_ENV",
    "check_env_keys",
    "describe_validation_error",
    "env_var_for",
]
