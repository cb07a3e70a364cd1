"""A real S3 server on loopback for the ``s3`` tests: moto's threaded server, started and stopped by a fixture."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvdi-test", "AWS_SECRET_ACCESS_KEY": "kvdi-test-secret"}
"""What moto accepts; set in the environment so boto3's own chain finds them (as it would in production)."""


def use_test_credentials() -> None:
    """Point boto3's chain at :data:`CREDENTIALS` (and away from any profile or config file of the machine)."""
    os.environ.update(CREDENTIALS)
    os.environ.pop("AWS_PROFILE", None)
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull


@contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server on a free loopback port; yields its endpoint URL and stops it on exit."""
    from moto.server import ThreadedMotoServer

    use_test_credentials()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def raw_client(endpoint_url: str) -> Any:
    """A plain boto3 client on the server (for planting objects by hand and listing what is there)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")


def new_bucket(endpoint_url: str) -> str:
    """A fresh, empty bucket on the server."""
    name = f"kvdi-{uuid.uuid4().hex[:16]}"
    raw_client(endpoint_url).create_bucket(Bucket=name)
    return name


def object_names(endpoint_url: str, bucket: str) -> list[str]:
    """Every object name in ``bucket``."""
    reply = raw_client(endpoint_url).list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in reply.get("Contents", [])]
