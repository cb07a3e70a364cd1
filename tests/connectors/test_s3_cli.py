"""``kvdi check`` on the ``s3`` connector: the probe proves write (conditional), read and delete, or names the fault."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.s3 import CREDENTIALS, new_bucket, object_names, s3_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3_server() as url:
        yield url


def kvdi_check(**env: str) -> subprocess.CompletedProcess[str]:
    """The real ``kvdi check`` with only the given KVDI_* variables and the test credentials."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith(("KVDI_", "AWS_"))}
    full = {**base, **CREDENTIALS, "PYTHONPATH": str(ROOT), "KVDI_KV_CONNECTOR": "s3", **env}
    return subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "check"], env=full, capture_output=True, text=True, timeout=120
    )


def test_check_proves_conditional_write_read_and_delete_and_leaves_nothing(endpoint: str) -> None:
    """Exit 0 with a line saying the conditional create was honoured; the probe object is gone afterwards."""
    bucket = new_bucket(endpoint)
    r = kvdi_check(KVDI_S3__BUCKET=bucket, KVDI_S3__ENDPOINT_URL=endpoint)
    assert r.returncode == 0, r.stderr
    assert "write, read, delete ok; conditional create honoured" in r.stdout
    assert object_names(endpoint, bucket) == []


def test_check_on_a_missing_bucket_is_one_line_naming_it_exit_2(endpoint: str) -> None:
    """A bucket that does not exist: exit 2, one line naming the bucket and the failed step, no traceback."""
    r = kvdi_check(KVDI_S3__BUCKET="kvdi-no-such-bucket", KVDI_S3__ENDPOINT_URL=endpoint)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "kvdi-no-such-bucket" in r.stderr and "HeadBucket failed" in r.stderr
    assert "Traceback" not in r.stderr and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in r.stderr + r.stdout


def test_a_bad_bucket_name_is_blamed_on_its_variable(endpoint: str) -> None:
    """KVDI_S3__BUCKET=Bad_Name: exit 2, the variable, the value and the allowed pattern on one line."""
    r = kvdi_check(KVDI_S3__BUCKET="Bad_Name", KVDI_S3__ENDPOINT_URL=endpoint)
    assert r.returncode == 2 and "KVDI_S3__BUCKET='Bad_Name'" in r.stderr and "pattern" in r.stderr


def test_check_warns_in_one_line_when_no_lifecycle_rule_expires_the_prefix(endpoint: str) -> None:
    """No rule: exit 0 and one warning naming the bucket and the prefix; a rule on kvdi's prefix: no warning."""
    from tests.helpers.s3 import raw_client

    bucket = new_bucket(endpoint)
    r = kvdi_check(KVDI_S3__BUCKET=bucket, KVDI_S3__ENDPOINT_URL=endpoint)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no enabled lifecycle rule expiring 'kvdi/'" in warnings[0] and bucket in warnings[0]
    other = {"ID": "logs", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 1}}
    rule = {"ID": "kvdi", "Filter": {"Prefix": "kvdi/"}, "Status": "Enabled", "Expiration": {"Days": 3}}
    client = raw_client(endpoint)
    client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [other]})
    assert "lifecycle" in kvdi_check(KVDI_S3__BUCKET=bucket, KVDI_S3__ENDPOINT_URL=endpoint).stdout
    client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [other, rule]})
    r = kvdi_check(KVDI_S3__BUCKET=bucket, KVDI_S3__ENDPOINT_URL=endpoint)
    assert r.returncode == 0 and "warning:" not in r.stdout, r.stdout


def test_lifecycle_rules_the_credentials_cannot_read_are_unknown_not_absent() -> None:
    """A 403 on GetBucketLifecycleConfiguration: the warning says the rules are unknown and names the right."""
    import botocore.exceptions

    from kvdi.connectors.s3 import S3Settings
    from kvdi.connectors.s3.probe import lifecycle_warning

    class Refusing:
        def get_bucket_lifecycle_configuration(self, Bucket: str) -> None:
            reply: dict[str, object] = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
            raise botocore.exceptions.ClientError(reply, "GetBucketLifecycleConfiguration")  # type: ignore[arg-type]

    warning = lifecycle_warning(S3Settings(bucket="kv-cache"), client=Refusing())
    assert warning is not None and "lifecycle rules unknown" in warning and "s3:GetLifecycleConfiguration" in warning
