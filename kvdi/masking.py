"""The one place that decides what of a setting may be shown: secrets become ``***``.

- :func:`mask_url`: a URL with the password of its userinfo and every secret-looking query
  parameter replaced by ``***``. It parses the URL instead of matching one pattern, and it
  errs on the side of hiding: a password holding ``/``, ``#``, ``@``, ``:`` or ``?`` (which
  standard parsers split at) is still hidden whole.
- :func:`mask_text`: every URL inside a free text (an exception message) masked;
- :func:`is_secret_key`: whether a key or field name (``password``, ``auth_token``,
  ``api_key``, ``access_key``, ``secret``...) names a secret.
- :func:`mask_value`: any settings value (nested mappings and lists included, SecretStr
  too) made safe to print, given the dotted path it sits at.
- :class:`MaskedMapping` / :data:`MaskedDict`: a free-form mapping setting (such as
  ``kv_connector_extra_config``) whose ``repr``, ``str`` and JSON dumps hide secret-looking
  keys' values, while the program still reads the real values.

Every place that prints settings or URLs (``kvdi info``/``check``, settings error
messages, the demo, the Redis store) goes through these functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, PlainSerializer, SecretStr

MASK = "***"
MAX_DEPTH = 64  # deeper values are shown as MASK rather than walked

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")
_WORD_RE = re.compile(r"[^a-z0-9]+")
_SECRET_WORDS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "pwd",
        "secret",
        "secrets",
        "token",
        "tokens",
        "auth",
        "authorization",
        "credential",
        "credentials",
        "apikey",
        "cookie",
    }
)
_SECRET_NAMES = frozenset({"accesskey", "secretkey", "privatekey", "apikey", "sessionkey"})
_TOKEN_WORDS = frozenset({"token", "tokens"})
_COUNT_WORDS = frozenset({"max", "min", "num", "count", "batched", "total", "per", "limit", "budget", "new", "prompt"})
"""Words that make ``tokens`` a number of LLM tokens (``max_num_batched_tokens``), not a credential."""


def is_secret_key(name: str) -> bool:
    """True when ``name`` (a field, env or mapping key; any case, ``-``/``_``/``.`` separated) names a secret.

    Secret: a word such as ``password``, ``pass``, ``pwd``, ``secret``, ``token``, ``auth``,
    ``credentials``, ``apikey``, or a name ending in ``_key`` (``api_key``, ``access_key``,
    ``integrity_key``). ``key_prefix`` or ``integrity_key_file`` are not secrets, and neither is a
    count of LLM tokens (``max_num_batched_tokens``, ``max_tokens``: ``token(s)`` beside a word such
    as ``max``, ``num`` or ``per``).
    """
    words = [w for w in _WORD_RE.split(name.lower()) if w]
    if not words:
        return False
    counted = not _COUNT_WORDS.isdisjoint(words)
    if any(w in _SECRET_WORDS and not (counted and w in _TOKEN_WORDS) for w in words):
        return True
    if "".join(words) in _SECRET_NAMES:
        return True
    return len(words) > 1 and words[-1] == "key"


def mask_url(url: str) -> str:
    """``url`` with its userinfo password and secret query values (``password=``, ``token=``...) as ``***``.

    The userinfo runs to the *last* ``@``, so ``redis://:pa/ss#x@h/0`` shows ``redis://:***@h/0``.
    A userinfo whose user part holds ``/ ? # & =`` is ambiguous and hidden whole. Text that is not
    ``scheme://...`` is returned unchanged. Never raises.
    """
    match = _SCHEME_RE.match(url)
    if match is None:
        return url
    head, rest = match.group(0), url[match.end() :]
    if "@" in rest and not _ats_inside_secret_query(rest):
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        if any(ch in user for ch in "/?#&="):
            head += f"{MASK}@"
        else:
            head += f"{user}:{MASK}@" if colon else f"{user}@"
    location, question, query = rest.partition("?")
    if not question:
        return head + location
    return f"{head}{location}?{_mask_query(query)}"


def mask_text(text: str) -> str:
    """``text`` (an error message, a log line) with every ``scheme://...`` run in it passed through :func:`mask_url`.

    A URL runs to the next whitespace or quote character.
    """
    return _URL_IN_TEXT_RE.sub(lambda m: mask_url(m.group(0)), text)


def _ats_inside_secret_query(rest: str) -> bool:
    """True when every '@' of ``rest`` sits after a secret query parameter's '=' (``?token=a@b``), not in a userinfo."""
    location, question, query = rest.partition("?")
    if not question or "@" in location:
        return False
    pos = 0
    for param in query.split("&"):
        key, equals, _value = param.partition("=")
        if equals and is_secret_key(key):
            return "@" not in query[: pos + len(key)]
        pos += len(param) + 1
    return False


def _mask_query(query: str) -> str:
    # The fragment is not split off: a '#' may belong to a secret value and is then hidden with it.
    # A '#' inside a secret value makes the rest ambiguous (fragment or more secret): hide all of it.
    parts = []
    for param in query.split("&"):
        key, equals, value = param.partition("=")
        if equals and is_secret_key(key):
            parts.append(f"{key}={MASK}")
            if "#" in value:
                break
        else:
            parts.append(param)
    return "&".join(parts)


def mask_value(path: str, value: Any, _depth: int = 0) -> Any:
    """``value`` made safe to print, given its dotted settings ``path`` (e.g. ``kv_connector_extra_config.token``).

    A secret key's value (see :func:`is_secret_key`) becomes ``***`` unless it is empty; a
    :class:`~pydantic.SecretStr` becomes its masked URL when it holds one, else ``***``;
    strings that are URLs go through :func:`mask_url`; mappings, lists and tuples are walked
    (to :data:`MAX_DEPTH` levels). Other values are returned as they are.
    """
    if _depth > MAX_DEPTH:
        return MASK
    if value is None or value == "":
        return value
    if isinstance(value, SecretStr):
        raw = value.get_secret_value()
        return mask_url(raw) if _SCHEME_RE.match(raw) and not is_secret_key(_leaf(path)) else MASK
    if is_secret_key(_leaf(path)) and not isinstance(value, Mapping | list | tuple | bool):
        return MASK
    if isinstance(value, Mapping):
        return {k: mask_value(f"{path}.{k}" if path else str(k), v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        masked = [mask_value(path, v, _depth + 1) for v in value]
        return masked if isinstance(value, list) else tuple(masked)
    if isinstance(value, str):
        return mask_url(value)
    return value


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


class MaskedMapping(dict[str, Any]):
    """A dict whose ``repr`` and ``str`` show secret-looking keys' values as ``***`` (the values are kept)."""

    def __repr__(self) -> str:
        return repr(mask_value("", dict(self)))

    __str__ = __repr__


def _masked_json(value: dict[str, Any]) -> Any:
    return mask_value("", dict(value))


MaskedDict = Annotated[dict[str, Any], AfterValidator(MaskedMapping), PlainSerializer(_masked_json, when_used="json")]
"""A free-form ``dict[str, Any]`` setting: read as it is, printed (``repr``, ``str``, ``model_dump_json``,
``model_dump(mode="json")``) with secret-looking keys masked."""


__all__ = [
    "MASK",
    "MAX_DEPTH",
    "MaskedDict",
    "MaskedMapping",
    "is_secret_key",
    "mask_text",
    "mask_url",
    "mask_value",
]
