"""``check()`` for the ``s3`` store: prove, with one small probe object, every call kvdi makes on the bucket.

The probe (``<key_prefix>kvdi-check-<random>``, never a block name: block names are hex only) is
created with ``If-None-Match: *``, created again (which must be refused with ``412``: an endpoint
that ignores the condition lets a second writer replace a published block, a warning), read back
with a ranged ``GetObject``, deleted, and looked up once more (it must be gone). Any failure is an
OSError naming the step and the right the credentials lack.

:func:`lifecycle_warning` is ``kvdi check``'s one-line warning when no enabled lifecycle rule of
the bucket expires kvdi's prefix: kvdi keeps no accounting of its own (docs/s3.md), so without
such a rule the bucket only grows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdi.connectors.s3.client import Outcome, describe, make_client, outcome

if TYPE_CHECKING:
    from kvdi.connectors.s3.settings import S3Settings

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


def expiry_rules(client: Any, bucket: str, prefix: str) -> list[dict[str, Any]] | None:
    """The bucket's enabled lifecycle rules that expire objects under ``prefix`` (id, prefix, days).

    No configuration is an empty list, no right to read it None; other failures raise as boto3 does.
    """
    try:
        reply = client.get_bucket_lifecycle_configuration(Bucket=bucket)
    except Exception as exc:
        kind = outcome(exc)
        if kind in (Outcome.ABSENT, Outcome.REFUSED):
            return [] if kind is Outcome.ABSENT else None
        raise
    rules = []
    for rule in reply.get("Rules", []):
        rule_prefix = str((rule.get("Filter") or {}).get("Prefix", rule.get("Prefix", "")))
        days = (rule.get("Expiration") or {}).get("Days")
        if rule.get("Status") == "Enabled" and days and prefix.startswith(rule_prefix):
            rules.append({"id": rule.get("ID", ""), "prefix": rule_prefix, "days": days})
    return rules


def lifecycle_warning(options: S3Settings, client: Any = None) -> str | None:
    """One line when no enabled lifecycle rule expires ``options.key_prefix`` (or none can be read), else None."""
    own = client is None
    client = make_client(options) if own else client
    where = f"s3 bucket {options.bucket!r}"
    try:
        rules = expiry_rules(client, options.bucket, options.key_prefix)
    except Exception as exc:
        rules, why = None, describe(exc)
    else:
        why = "no right to read them: s3:GetLifecycleConfiguration"
    finally:
        if own:
            client.close()
    if rules:
        return None
    if rules is None:
        return f"{where}: lifecycle rules unknown ({why}); check that one expires {options.key_prefix!r} (docs/s3.md)"
    return (
        f"{where} has no enabled lifecycle rule expiring {options.key_prefix!r}: kvdi never deletes blocks on its "
        "own, so the bucket grows without bound; add an expiration rule for the prefix (docs/s3.md)"
    )
