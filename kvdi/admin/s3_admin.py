"""Administration of the ``s3`` store: the objects under ``key_prefix`` in one bucket.

Objects are found with ``ListObjectsV2`` under the prefix (pages of 1000, never the whole
bucket); an object is a candidate when its name is the prefix and 32 hex digits (anything else
under the prefix is counted as other and never touched), and kvdi's only when its first bytes
say so (:mod:`.model`). Reads are ranged ``GetObject`` calls of exactly the bytes asked, on the
store's pooled, retrying client (:mod:`kvdi.connectors.s3.client`). ``server_info`` shows the
bucket's lifecycle rules that expire objects under the prefix: they bound the store's age.

An empty ``key_prefix`` is refused: every object of the bucket would look like a candidate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvdi.admin.model import StoreObject, is_key_name
from kvdi.connectors.s3.client import Outcome, make_client, outcome
from kvdi.connectors.s3.probe import expiry_rules
from kvdi.connectors.s3.settings import S3Settings
from kvdi.errors import ConfigError
from kvdi.masking import mask_url

if TYPE_CHECKING:
    from kvdi.settings import KvdiSettings


def s3_options(settings: KvdiSettings) -> S3Settings:
    """The ``s3`` connector's options from kvdi's settings (``KVDI_S3__*`` when ``s3`` is selected); ConfigError."""
    from kvdi.containers import plugin_options

    options: S3Settings = plugin_options("s3", S3Settings, settings)
    return options


class S3StoreAdmin:
    """A :class:`~kvdi.admin.model.StoreAdmin` over ``options.bucket`` under ``options.key_prefix``."""

    kind = "s3"

    def __init__(self, options: S3Settings, client: Any = None) -> None:
        if not options.key_prefix:
            raise ConfigError(
                "KVDI_S3__KEY_PREFIX='': kvdi store lists and removes only objects under a non-empty prefix "
                "(an empty one would take in the whole bucket); set it to the prefix the engines write under "
                "(default 'kvdi/')"
            )
        self.bucket, self.prefix = options.bucket, options.key_prefix
        endpoint = mask_url(options.endpoint_url) if options.endpoint_url else f"aws:{options.region}"
        self.where = f"s3://{self.bucket}@{endpoint} key_prefix={self.prefix!r}"
        self._client = client if client is not None else make_client(options)
        self._pool = ThreadPoolExecutor(options.workers, thread_name_prefix="kvdi-s3-admin")
        self._other = 0

    def objects(self) -> Iterator[StoreObject]:
        self._other = 0
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for entry in page.get("Contents", []):
                key = str(entry.get("Key", ""))
                name = key[len(self.prefix) :]
                size = entry.get("Size")
                if not is_key_name(name) or not isinstance(size, int):
                    self._other += 1
                    continue
                modified = entry.get("LastModified")
                stamp = modified.timestamp() if modified is not None else None
                yield StoreObject(name, self.bucket, size, stamp, ref=key)

    def other_entries(self) -> int:
        """Objects under the prefix seen by the last full listing that are not named as blocks."""
        return self._other

    def read_many(self, objs: Sequence[StoreObject], offset: int, length: int) -> list[bytes | None]:
        return list(self._pool.map(lambda obj: self._read(obj, offset, length), objs))

    def _read(self, obj: StoreObject, offset: int, length: int) -> bytes | None:
        if offset >= obj.size:
            return b""
        try:
            reply = self._client.get_object(
                Bucket=self.bucket, Key=obj.ref, Range=f"bytes={offset}-{offset + length - 1}"
            )
        except Exception as exc:
            if outcome(exc) is Outcome.ABSENT:
                return None
            raise
        body = reply["Body"]
        try:
            data = body.read(length + 1)
        finally:
            body.close()
        return bytes(data[:length]) if isinstance(data, bytes) and len(data) <= length else b""

    def remove(self, obj: StoreObject) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=obj.ref)
        except Exception as exc:
            if outcome(exc) is Outcome.ABSENT:
                return False
            raise
        self._client.delete_object(Bucket=self.bucket, Key=obj.ref)
        return True

    def server_info(self) -> dict[str, Any]:
        """The bucket's enabled lifecycle rules that expire objects under the prefix (what bounds the store's age)."""
        return {"expiry_rules": expiry_rules(self._client, self.bucket, self.prefix) or []}  # None: not readable

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


__all__ = ["S3StoreAdmin", "s3_options"]
