"""The optional integrity key: ``KVDI_INTEGRITY_KEY`` or ``KVDI_INTEGRITY_KEY_FILE`` as a :class:`FrameKey`.

With a key, every frame a store half writes carries an HMAC-SHA256 and every frame it reads
must verify under the key (see :mod:`kvdi.connectors.store.framing`). A key file must be a regular
file (not a symlink) that only its owner can read or write, like an SSH private key.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from kvdi.connectors.store.framing import MIN_KEY_BYTES, FrameKey
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.settings import KvdiSettings

KEY_ENV = "KVDI_INTEGRITY_KEY"
KEY_FILE_ENV = "KVDI_INTEGRITY_KEY_FILE"
MAX_KEY_FILE_BYTES = 4096


def frame_key(settings: KvdiSettings) -> FrameKey | None:
    """The frame key the settings name, or None; a ConfigError naming the variable when it is unusable."""
    secret = settings.integrity_key
    path = settings.integrity_key_file
    if secret is not None and path is not None:
        raise ConfigError(f"set {KEY_ENV} or {KEY_FILE_ENV}, not both")
    if secret is not None:
        raw = secret.get_secret_value().encode("utf-8", "surrogatepass")
        return _key(raw, f"{KEY_ENV} (value hidden)")
    if path is not None:
        return _key(read_key_file(os.fspath(path)), f"{KEY_FILE_ENV}={os.fspath(path)!r}")
    return None


def read_key_file(path: str) -> bytes:
    """The key bytes of ``path`` (one trailing newline dropped); refuses symlinks and group/other access."""
    where = f"{KEY_FILE_ENV}={path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = "is a symlink (point it at the file itself)" if _is_symlink(path) else (exc.strerror or str(exc))
        raise ConfigError(f"{where}: cannot open the integrity key file: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: the integrity key file is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{where}: the integrity key file has mode {stat.S_IMODE(st.st_mode):04o}; "
                f"it must be readable by its owner only (chmod 600)"
            )
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{where}: the integrity key file must belong to the user running kvdi")
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"{where}: the integrity key file is {st.st_size} B; at most {MAX_KEY_FILE_BYTES} B")
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def _key(raw: bytes, where: str) -> FrameKey:
    """The key of ``raw``; a ConfigError when it holds fewer than MIN_KEY_BYTES bytes besides whitespace
    (a file of newlines or spaces, an editor's padding around a short word) or one byte repeated."""
    if len(raw) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: an integrity key needs at least {MIN_KEY_BYTES} bytes, got {len(raw)}")
    meaningful = raw.strip()
    if len(meaningful) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{where}: an integrity key needs at least {MIN_KEY_BYTES} bytes that are not whitespace, got "
            f"{len(meaningful)}; make one with: head -c 32 /dev/urandom | base64"
        )
    if len(set(meaningful)) == 1:
        raise ConfigError(f"{where}: an integrity key of one repeated byte is no secret; make one with: "
                          "head -c 32 /dev/urandom | base64")  # fmt: skip
    return FrameKey(raw)


def _is_symlink(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


__all__ = ["KEY_ENV", "KEY_FILE_ENV", "frame_key", "read_key_file"]
