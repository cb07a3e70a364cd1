"""Wording of settings errors: which variable, which value (never a secret's), what is allowed.

- :func:`env_var_for`: the ``KVDI_*`` variable of a field path;
- :func:`check_env_keys`: a ``KVDI_*`` variable that names no setting is refused with a
  did-you-mean; :data:`NON_SETTING_ENV_VARS` lists the ``KVDI_`` variables that are not settings;
- :func:`describe_validation_error`: one line per pydantic error, blamed on the variable the
  user set (``blame``), with the input masked: a secret field's input is shown as ``***``.

Every message is bounded, whatever the input: at most :data:`MAX_ERRORS` errors are described
(then "and N more"), each name or value echoed is cut to :data:`MAX_ECHO` characters with an
ellipsis (:func:`clip`), a list of known names is given once per section, and a did-you-mean is
looked for only for names of a plausible length. A settings file with 100 000 unknown keys or a
100 000-character variable name gives one short line, at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, get_args

from pydantic import BaseModel, SecretStr, ValidationError

from kvdi.errors import ConfigError, did_you_mean
from kvdi.masking import MASK, is_secret_key, mask_value
from kvdi.settings.root import ENV_PREFIX, SETTINGS_FILE_ENV, TOOLING_ENV_PREFIX, KvdiSettings
from kvdi.settings.vllm_compat import TRANSFER_CONFIG_ENV

# KVDI_ variables that are not settings: the settings file and vLLM's transfer-config JSON; check_env_keys lets
# them pass, and every variable of kvdi's test tooling (TOOLING_ENV_PREFIX, named by kvdi.testing).
NON_SETTING_ENV_VARS = frozenset({SETTINGS_FILE_ENV, TRANSFER_CONFIG_ENV})

Loc = tuple[str | int, ...]

MAX_ERRORS = 10
"""Errors described in one message; the rest are counted."""
MAX_ECHO = 80
"""Characters of a user's name or value echoed in a message."""
_MAX_GUESS = 200  # names longer than this get no did-you-mean (difflib is quadratic)


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` when cut."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def guess(value: str, choices: list[str]) -> str:
    """:func:`~kvdi.errors.did_you_mean`, bounded: nothing for a name too long to be a typo of a choice."""
    return did_you_mean(value, choices) if len(value) <= _MAX_GUESS else ""


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
    listed: set[Loc] = set()  # sections whose known names were already listed
    errors = exc.errors(include_url=False)
    for err in errors[:MAX_ERRORS]:
        loc = tuple(p for p in err["loc"] if not isinstance(p, int))
        setting = clip(".".join(str(p) for p in loc) or "settings")
        value = err.get("input")
        msg = clip(err["msg"], 4 * MAX_ECHO)
        hint = ""
        expected = (err.get("ctx") or {}).get("expected")
        secret = _is_secret_field(model, loc)
        if isinstance(value, str) and isinstance(expected, str) and not secret:
            hint = guess(value, re.findall(r"'([^']+)'", expected))
        if err["type"] == "extra_forbidden":
            known = _known_names(model, loc[:-1])
            hint = guess(str(loc[-1]), known)
            msg = "unknown setting" if loc[:-1] in listed else f"unknown setting; known: {', '.join(sorted(known))}"
            listed.add(loc[:-1])
            value_txt = ""
        else:
            value_txt = f"={MASK if secret else _show(setting, value)}"
        parts.append(f"{setting} ({clip(name_of(loc), 6 * MAX_ECHO)}{value_txt}): {msg}{hint}")
    if len(errors) > MAX_ERRORS:
        parts.append(f"and {len(errors) - MAX_ERRORS} more errors (fix these first)")
    return "invalid settings: " + "; ".join(parts)


def _show(path: str, value: Any) -> str:
    if isinstance(value, str | bytes) and len(value) > 4 * MAX_ECHO:
        value = value[: 4 * MAX_ECHO]  # repr of a huge value is not built just to be cut
    elif isinstance(value, dict | list | tuple | set) and len(value) > MAX_ERRORS:
        return f"<{type(value).__name__} of {len(value)} items>"
    return clip(repr(mask_value(path, value)), 60)


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


def check_env_keys(environ: Mapping[str, str] | None = None, connector: str | None = None) -> None:
    """Raise ConfigError for a ``KVDI_*`` env var that names no setting (with a did-you-mean).

    ``KVDI_<CONNECTOR>__*`` variables of the selected ``connector`` (a plugin's options) pass; its model checks them.
    The variables of :data:`NON_SETTING_ENV_VARS` and of kvdi's test tooling (``KVDI_TEST_*``) are allowed.
    """
    env = os.environ if environ is None else environ
    for key in env:
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NON_SETTING_ENV_VARS or upper.startswith(TOOLING_ENV_PREFIX):
            continue
        path = upper[len(ENV_PREFIX) :].lower().split("__")
        if connector and len(path) > 1 and path[0] == connector.lower() and path[0] not in KvdiSettings.model_fields:
            continue
        model: type[BaseModel] = KvdiSettings
        for depth, part in enumerate(path):
            fields = model.model_fields
            if part not in fields:
                candidates = [env_var_for((*path[:depth], name)) for name in fields]
                if depth == 0:
                    candidates += sorted(NON_SETTING_ENV_VARS)
                raise ConfigError(f"{clip(key)} is not a kvdi setting{guess(upper, candidates)}")
            annotation = fields[part].annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                break  # a leaf; deeper parts belong to a dict value such as extra config
            model = annotation


__all__ = [
    "MAX_ECHO",
    "MAX_ERRORS",
    "NON_SETTING_ENV_VARS",
    "check_env_keys",
    "clip",
    "describe_validation_error",
    "env_var_for",
]
