"""boto3 for the ``s3`` store: one pooled, retrying client, and every botocore outcome sorted into a few kinds.

boto3 is the reference S3 client: botocore signs requests (SigV4) for AWS and every S3-compatible
server, sends ``If-None-Match: *`` on ``PutObject`` (conditional create), retries throttling
(``503 SlowDown``) and 5xx with backoff (``standard`` / ``adaptive`` modes), pools connections per
client and finds credentials through its own chain (env, profile, web identity, instance role).
Only this package imports boto3.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import boto3
import botocore.config
import botocore.exceptions

if TYPE_CHECKING:
    from kvdi.connectors.s3.settings import S3Settings


class Outcome(enum.Enum):
    """What a failed S3 call means for the store."""

    ABSENT = "absent"  # 404: no such object (the server answered)
    EXISTS = "exists"  # 412 / 409 on a conditional create: someone published it first
    REFUSED = "refused"  # any other answer (403, 400, 416...): the server is alive, the object is a miss
    FAILED = "failed"  # no usable answer (connection, timeout, 5xx / throttling after retries): feeds the breaker


def make_client(options: S3Settings) -> Any:
    """A boto3 S3 client: bounded timeouts, ``max_attempts`` with botocore's backoff, ``workers`` pooled connections."""
    config = botocore.config.Config(
        region_name=options.region,
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        retries={"total_max_attempts": options.max_attempts, "mode": options.retry_mode},  # the first included
        max_pool_connections=options.workers,
        # kvdi's frames carry their own checksum: no second CRC over every byte on each side.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # S3-compatible servers (MinIO, Ceph RGW, moto) want the bucket in the path, not the host name.
        s3={"addressing_style": "path" if options.endpoint_url else "auto"},
    )
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=options.endpoint_url, verify=options.verify_tls, config=config)


def outcome(exc: BaseException) -> Outcome:
    """Sort an exception raised by a boto3 call."""
    if isinstance(exc, botocore.exceptions.ClientError):
        response: Any = exc.response
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        code = str(response.get("Error", {}).get("Code") or "")
        if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
            return Outcome.ABSENT
        if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return Outcome.EXISTS
        if status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout"):
            return Outcome.FAILED
        return Outcome.REFUSED
    return Outcome.FAILED  # BotoCoreError (connect, read timeout, endpoint gone), OSError, anything odd


def describe(exc: BaseException) -> str:
    """One line about a failed call, without request ids or anything signed."""
    if isinstance(exc, botocore.exceptions.ClientError):
        response: Any = exc.response
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{response.get('Error', {}).get('Code') or 'error'} (HTTP {status})"
    return type(exc).__name__
