"""``check()`` for the ``s3`` store: prove, with one small probe object, every call kvdi makes on the bucket.

The probe (``<key_prefix>kvdi-check-<random>``, never a block name: block names are hex only) is
created with ``If-None-Match: *``, created again (which must be refused with ``412``: an endpoint
that ignores the condition lets a second writer replace a published block, a warning), read back
with a ranged ``GetObject``, deleted, and looked up once more (it must be gone). Any failure is an
OSError naming the step and the right the credentials lack.
"""

from __future__ import annotations

from typing import Any

from kvdi.connectors.s3.client import Outcome, describe, outcome

PROBE = b"kvdi-check"


def probe_bucket(client: Any, bucket: str, prefix: str, label: str, token: str) -> str:
    """Run the probe; a one-line summary, or OSError naming the step that failed."""
    name = f"{prefix}kvdi-check-{token}"
    step = "HeadBucket"
    try:
        client.head_bucket(Bucket=bucket)
        step = "PutObject (If-None-Match: *)"
        client.put_object(Bucket=bucket, Key=name, Body=PROBE, IfNoneMatch="*")
        conditional = _second_put_refused(client, bucket, name)
        step = "GetObject (ranged)"
        got = client.get_object(Bucket=bucket, Key=name, Range=f"bytes=0-{len(PROBE)}")["Body"].read(len(PROBE) + 1)
        if got != PROBE:
            raise OSError(f"{label}: the probe read back {len(got)} B unlike the {len(PROBE)} B written")
        step = "DeleteObject"
        client.delete_object(Bucket=bucket, Key=name)
        step = "HeadObject after delete"
        try:
            client.head_object(Bucket=bucket, Key=name)
        except Exception as exc:
            if outcome(exc) is not Outcome.ABSENT:
                raise
        else:
            raise OSError(f"{label}: the probe object is still there after DeleteObject")
    except OSError:
        raise
    except Exception as exc:
        raise OSError(f"{label}: {step} failed ({describe(exc)}): check the endpoint, bucket and rights") from None
    note = "conditional create honoured" if conditional else "WARNING: the endpoint ignores If-None-Match"
    return f"{label} prefix {prefix!r}: write, read, delete ok; {note}"


def _second_put_refused(client: Any, bucket: str, name: str) -> bool:
    try:
        client.put_object(Bucket=bucket, Key=name, Body=PROBE, IfNoneMatch="*")
    except Exception as exc:
        if outcome(exc) is Outcome.EXISTS:
            return True
        raise
    return False
