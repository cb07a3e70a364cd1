"""The ``s3`` connector's options (``KVDI_S3__*``, ``kvdi.s3.*`` extra config, ``[s3]`` in the settings file).

Credentials are not options: boto3's own chain finds them (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, web identity, an instance or task role), so kvdi
never holds, shows or logs a secret.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"


def _seconds(default: float) -> float:
    return Field(default, gt=0, le=3600, allow_inf_nan=False)


class S3Settings(BaseModel):
    """Where the blocks live and how hard kvdi tries to reach them."""

    bucket: str = Field(..., pattern=BUCKET_PATTERN)
    """The bucket (it must exist: kvdi never creates one). 3-63 characters: a-z, 0-9, '.', '-'."""
    endpoint_url: str | None = Field(None, max_length=2048)
    """An S3-compatible endpoint (MinIO, Ceph RGW, ...), ``http(s)://host[:port]``; unset: AWS's own."""
    key_prefix: str = Field("kvdi/", max_length=512)
    """Every object kvdi writes is ``<key_prefix><hex block key>``; a lifecycle rule can match it."""
    region: str = Field("us-east-1", min_length=1, max_length=64)
    verify_tls: bool = True
    """Check the endpoint's certificate (off only for a private endpoint with a self-signed one)."""
    connect_timeout_s: float = _seconds(2.0)
    read_timeout_s: float = _seconds(5.0)
    max_attempts: int = Field(3, ge=1, le=10)
    """Attempts per request (the first included), with botocore's backoff on throttling (503 SlowDown) and 5xx."""
    retry_mode: Literal["standard", "adaptive"] = "standard"
    """botocore's retry mode: ``adaptive`` also rate-limits the client after throttling replies."""
    workers: int = Field(16, ge=1, le=256)
    """Requests in flight at once (a thread pool and as many pooled connections)."""
    breaker_failures: int = Field(3, gt=0, le=1_000_000)
    breaker_reset_s: float = _seconds(5.0)
    compression: Literal["none", "zstd", "zstd-split", "auto"] = "none"
    """Store blocks zstd-compressed (``zstd``: whenever smaller; ``zstd-split``: denser, bytes split by their
    place in the element first; ``auto``: zstd when the link is slower than compressing pays, measured);
    recorded in each frame, so any reader loads any (docs/compression.md). Needs ``zstandard``."""
    format: Literal["per_rank", "canonical"] = "per_rank"
    """``canonical``: sections any TP/PP shape shares, replicated KV once (docs/stored-format.md); no compression."""
    section_layers: int = Field(0, ge=0, le=1024)
    """Layers per canonical section (0: all); must divide the model's layers and every PP stage's."""
    section_heads: int = Field(1, gt=0, le=1024)
    """KV heads per canonical section; must divide every TP rank's heads (1 fits all; fewer objects when larger)."""

    @field_validator("endpoint_url")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("endpoint_url must start with http:// or https://")
        return value or None
