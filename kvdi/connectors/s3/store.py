""":class:`S3BlockStore`: one S3 object per framed block, published once, read with a bound.

Each block is the object ``<key_prefix><hex block key>`` in one bucket, written by a single
``PutObject`` with ``If-None-Match: *``: S3 publishes an object whole or not at all, and the
conditional create means the first complete copy of a block is the only one (a ``412`` says another
writer published it first, which is a success: a block key names its content). The worker half
discards an object whose frame fails its checks, after which a writer may publish it again. Reads
are one ranged ``GetObject`` of at most one frame plus one byte per object: an object whose size
(``Content-Range`` / ``Content-Length``) exceeds one frame is a counted miss whose body is never
read. With ``compression`` set (:mod:`kvdi.connectors.store.codec`) a block is compressed before it
is published: a smaller object, read whole by the same ranged read. Lookups are ``HeadObject``
calls. Every batch runs on a small thread pool over boto3's pooled connections (:mod:`.client`).

A dead or slow endpoint costs a miss, not a stall: every call is bounded by the timeouts and
``max_attempts``, and after ``breaker_failures`` consecutive failures the store stops calling
it for ``breaker_reset_s`` (reads miss, writes raise :class:`ConnectionError` at once). Every
odd reply or exception is counted in :attr:`S3BlockStore.misses` by kind.
"""

from __future__ import annotations

import collections
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvdi.connectors.breaker import BreakerOpenError, BreakerState, CircuitBreaker
from kvdi.connectors.logging_once import log_once
from kvdi.connectors.s3.client import Outcome, describe, make_client, outcome
from kvdi.connectors.store.blockio import scatter
from kvdi.connectors.store.framing import Buffer
from kvdi.masking import mask_url

if TYPE_CHECKING:
    from kvdi.connectors.s3.settings import S3Settings
    from kvdi.connectors.store.codec import Compressor

logger = logging.getLogger(__name__)
T = TypeVar("T")
PREFETCH_OBJECTS_PER_WORKER = 4  # reads kept ahead of the loads, per worker (each at most one frame)
SAVE_BATCH_PER_WORKER = 4  # blocks per put_many the worker half is asked to send, per worker (writes.py)
UNSIZED_READ_BYTES = 1 << 30  # the bound of a read whose frame size the store was not told
_TOTAL = re.compile(r"^bytes \d+-\d+/(\d+)$")


def _as_range(got: Buffer | tuple[int | None, bytes | None] | None, offset: int, want: int) -> tuple[int | None, Any]:
    """What a read ahead answers for a range: a range's (size, bytes), or a whole object's size and slice."""
    if got is None or isinstance(got, tuple):
        return got or (None, None)
    view = memoryview(got).cast("B")
    return view.nbytes, view[offset : offset + want] if offset + want <= view.nbytes else None


def range_header(offset: int, want: int) -> str:
    """The ``Range`` of ``want`` bytes from ``offset`` (of one byte when ``want`` is 0: an empty one is no range)."""
    return f"bytes={offset}-{offset + max(want, 1) - 1}"


class S3BlockStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over one bucket; safe to share across threads."""

    prefers_async_load = True
    """Every read is a network round trip to an object store: load beside the compute (``auto`` prefetches)."""
    compressor: Compressor | None = None
    """Re-frames blocks compressed before they are written (``KVDI_S3__COMPRESSION``, set by ``open_store``)."""

    def __init__(self, options: S3Settings, max_object_bytes: int | None = None, client: Any = None) -> None:
        self.bucket = options.bucket
        self.key_prefix = options.key_prefix
        self.endpoint = mask_url(options.endpoint_url) if options.endpoint_url else f"aws:{options.region}"
        self.label = f"s3://{self.bucket}@{self.endpoint}"
        self.max_object_bytes = max_object_bytes
        self.client = client if client is not None else make_client(options)
        self.breaker = CircuitBreaker(options.breaker_failures, options.breaker_reset_s)
        self.misses: collections.Counter[str] = collections.Counter()
        """Odd replies and failed calls by kind (``oversize``, ``empty``, ``refused``, ``failed``, ``breaker``)."""
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._pool = ThreadPoolExecutor(options.workers, thread_name_prefix="kvdi-s3")
        self._workers = options.workers
        self._ahead: OrderedDict[bytes, Future[Buffer | None]] = OrderedDict()
        self._ahead_cap = PREFETCH_OBJECTS_PER_WORKER * options.workers
        self._ranges: OrderedDict[tuple[bytes, int, int], Future[tuple[int | None, bytes | None]]] = OrderedDict()
        self.save_batch_blocks = SAVE_BATCH_PER_WORKER * options.workers
        """Blocks per ``put_many`` that keep every connection busy (one object per request): saves come so batched."""

    def __repr__(self) -> str:
        return f"S3BlockStore({self.label!r}, key_prefix={self.key_prefix!r}, breaker={self.breaker.state.value})"

    # BlockStore protocol

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, hold an object of at most one frame (parallel ``HeadObject``)."""
        count = 0
        for start in range(0, len(keys), self._workers):
            chunk = keys[start : start + self._workers]
            present = self._map(self._head, chunk, miss=False)
            for found in present:
                if not found:
                    return count
                count += 1
        return count

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each key's object (never more than one frame is read) or None: absent, oversize, or any odd reply.

        Objects read ahead by :meth:`prefetch` are taken from there (each read once), the rest in parallel.
        """
        with self._lock:
            ahead = [self._ahead.pop(k, None) for k in keys]
        rest = [k for k, f in zip(keys, ahead, strict=True) if f is None]
        fetched = iter(self._map(self._get, rest, miss=None))
        return [next(fetched) if f is None else f.result() for f in ahead]

    def get_range_into_many(self, items: Sequence[tuple[bytes, int, Sequence[memoryview]]]) -> list[int | None]:
        """Bytes from an offset into pieces (a pack's sections), one ranged ``GetObject`` each, in parallel: each
        object's size (``Content-Range``), the pieces filled when it holds the range; None when absent, refused
        (a ``416``: the offset past its end), answered short or failed (never raises). Ranges read ahead by
        :meth:`prefetch_ranges` (or whole objects by :meth:`prefetch`) are taken from there, each once."""
        if not items:
            return []
        wants = [(key, offset, sum(p.nbytes for p in pieces)) for key, offset, pieces in items]
        with self._lock:
            ahead = [self._ranges.pop(w, None) or self._ahead.pop(w[0], None) for w in wants]
        rest = [w for w, f in zip(wants, ahead, strict=True) if f is None]
        if rest and not self.breaker.allow():
            self._count("breaker", len(rest))
            fetched: Iterator[tuple[int | None, bytes | None]] = iter([(None, None)] * len(rest))
        else:
            fetched = iter([self._fetch_range(rest[0])] if len(rest) == 1 else self._pool.map(self._fetch_range, rest))
        out: list[int | None] = []
        for (_, offset, want), (_, _, pieces), f in zip(wants, items, ahead, strict=True):
            size, data = next(fetched) if f is None else _as_range(f.result(), offset, want)
            if data is not None:
                scatter(data, pieces)
            out.append(size)
        return out

    def prefetch_ranges(self, items: Sequence[tuple[bytes, int, int]]) -> bool:
        """Start reading ``(key, offset, want)`` ranges on the pool for :meth:`get_range_into_many` (a canonical
        reader's sections of its packs; at most ``4 x workers`` ahead, the oldest dropped first)."""
        return self._read_ahead(self._ranges, items, self._fetch_range)

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        """:class:`~kvdi.connectors.store.PrefetchStore`: start reading ``keys`` on the pool (at most
        ``4 x workers`` objects ahead; the oldest unclaimed reads are dropped first). True: reading ahead pays."""
        return self._read_ahead(self._ahead, keys, self._get)

    def _read_ahead(
        self, table: OrderedDict[Any, Future[Any]], items: Sequence[Any], fetch: Callable[[Any], Any]
    ) -> bool:
        """Submit ``fetch(item)`` on the pool for each item not yet in ``table``; the oldest dropped past the cap."""
        if not self.breaker.allow():
            return False
        with self._lock:
            for item in items:
                if item not in table:
                    table[item] = self._pool.submit(fetch, item)
            while len(table) > self._ahead_cap:
                table.popitem(last=False)[1].cancel()
        return True

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """Publish each object once (``If-None-Match: *``); returns how many are there now (ours or another's).

        Raises ConnectionError while the breaker is open, OSError when none could be published.
        """
        if not items:
            return 0
        if not self.breaker.allow():
            raise self._refusal("put_many")
        errors: list[BaseException] = []
        done = list(self._pool.map(lambda item: self._put(item, errors), items))
        count = sum(done)
        if count == 0:
            raise OSError(f"{self.label}: put_many published nothing ({describe(errors[0]) if errors else 'no reply'})")
        return count

    def discard(self, key: bytes) -> None:
        """``DeleteObject`` (absent keys are fine); raises ConnectionError while the breaker is open."""
        with self._lock:
            dropped = self._ahead.pop(key, None)
        if dropped is not None:
            dropped.cancel()
        if not self.breaker.allow():
            raise self._refusal("discard")
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.name(key))
        except Exception as exc:
            kind = self._failed("discard", exc)
            if kind is not Outcome.ABSENT:
                raise OSError(f"{self.label}: discard failed ({describe(exc)})") from None
            return
        self._succeeded()

    def health(self) -> dict[str, bool]:
        """:class:`~kvdi.connectors.store.HealthStore`: the endpoint, False while its circuit breaker is open."""
        return {self.label: self.breaker.state is not BreakerState.OPEN}

    def check(self) -> str:
        """Probe the bucket: a conditional create, a second one refused, a bounded read and a delete; a summary.

        Raises OSError when the bucket cannot serve (unreachable, no rights to write, read or delete).
        """
        from kvdi.connectors.s3.probe import probe_bucket

        return probe_bucket(self.client, self.bucket, self.key_prefix, self.label, secrets.token_hex(8))

    def close(self) -> None:
        """Stop the thread pool and close the pooled connections; the store must not be used afterwards."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead.clear()
        self._ranges.clear()
        self.client.close()

    # the calls

    def name(self, key: bytes) -> str:
        """The object name of a block key."""
        return self.key_prefix + key.hex()

    @property
    def read_bound(self) -> int:
        """The most bytes a read returns: one frame and one byte (more is an oversize object)."""
        return (self.max_object_bytes if self.max_object_bytes is not None else UNSIZED_READ_BYTES) + 1

    def _map(self, call: Callable[[bytes], T], keys: Sequence[bytes], miss: T) -> list[T]:
        if not keys:
            return []
        if not self.breaker.allow():
            self._count("breaker", len(keys))
            return [miss] * len(keys)
        if len(keys) == 1:
            return [call(keys[0])]
        return list(self._pool.map(call, keys))

    def _head(self, key: bytes) -> bool:
        try:
            reply = self.client.head_object(Bucket=self.bucket, Key=self.name(key))
        except Exception as exc:
            self._failed("count_prefix", exc)
            return False
        self._succeeded()
        size = reply.get("ContentLength")
        return self._sized(size) is not None

    def _get(self, key: bytes) -> Buffer | None:
        bound = self.read_bound
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.name(key), Range=f"bytes=0-{bound - 1}")
        except Exception as exc:
            self._failed("get_many", exc)
            return None
        body = reply.get("Body")
        try:
            match = _TOTAL.match(str(reply.get("ContentRange") or ""))
            size = int(match.group(1)) if match else reply.get("ContentLength")  # a server that ignored the range
            if self._sized(size) is None or body is None:
                return None
            data = body.read(bound)
            if not isinstance(data, bytes) or len(data) != size:
                self._count("truncated" if isinstance(data, bytes) and len(data) < bound else "oversize")
                return None
        except Exception as exc:  # the connection died mid-body
            self._failed("get_many", exc)
            return None
        finally:
            if body is not None:
                body.close()
        self._succeeded()
        return data

    def _fetch_range(self, item: tuple[bytes, int, int]) -> tuple[int | None, bytes | None]:
        """One ranged ``GetObject``: the object's size, and the range's bytes when the object holds them."""
        key, offset, want = item
        if offset < 0:
            return None, None
        body = None
        try:  # an empty range cannot be asked for: its first byte then, which every object of offset + 1 B has
            reply = self.client.get_object(Bucket=self.bucket, Key=self.name(key), Range=range_header(offset, want))
            body = reply.get("Body")
            match = _TOTAL.match(str(reply.get("ContentRange") or ""))
            size = self._sized(int(match.group(1)) if match else None)  # no Content-Range: the range was ignored
            if size is None or body is None or offset + want > size or not want:
                return size, b"" if size is not None and not want and offset <= size else None
            data = body.read(want + 1)
            if not isinstance(data, bytes) or len(data) != want:
                self._count("truncated" if isinstance(data, bytes) and len(data) < want else "oversize")
                return None, None
        except Exception as exc:  # 404, 416 (the offset past the end), a connection that died mid-body
            self._failed("get_range_into_many", exc)
            return None, None
        finally:
            if body is not None:
                body.close()
        self._succeeded()
        return size, data

    def _put(self, item: tuple[bytes, Sequence[Buffer]], errors: list[BaseException]) -> bool:
        key, pieces = item
        body = b"".join(pieces if self.compressor is None else self.compressor.frame(key, pieces))
        started = time.perf_counter()
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.name(key), Body=body, IfNoneMatch="*")
        except Exception as exc:
            if self._failed("put_many", exc) is Outcome.EXISTS:
                return True  # published by another writer first: whole, and named by the same content
            errors.append(exc)
            return False
        self._succeeded()
        if self.compressor is not None:  # compression=auto weighs the codec against this link's measured speed
            self.compressor.link_sample(len(body), time.perf_counter() - started)
        return True

    # accounting

    def _sized(self, size: object) -> int | None:
        """``size`` when it is a plausible object size, else None (an odd size is a counted miss)."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            self._count("empty" if size == 0 else "odd_reply")
            return None
        if size >= self.read_bound:
            self._count("oversize")
            return None
        return size

    def _count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.misses[kind] += n
        log_once(
            logger, self._logged, kind, "%s: %s object or reply, counted as a miss (logged once)", self.label, kind
        )

    def _succeeded(self) -> None:
        if self.breaker.record_success():
            logger.info("%s answers again: circuit breaker closed", self.label)

    def _failed(self, op: str, exc: BaseException) -> Outcome:
        kind = outcome(exc)
        if kind is Outcome.FAILED:
            self._count("failed")
            if self.breaker.record_failure():
                logger.warning("%s: %s failed (%s); circuit breaker open for %ss: loads miss, saves fail fast",
                               self.label, op, describe(exc), self.breaker.reset_s)  # fmt: skip
            return kind
        self._succeeded()  # the server answered
        if kind is Outcome.REFUSED:
            self._count("refused")
            log_once(logger, self._logged, f"refused-{op}", "%s: %s refused: %s (logged once)", self.label, op,
                     describe(exc))  # fmt: skip
        return kind

    def _refusal(self, op: str) -> BreakerOpenError:
        self._count("breaker")
        return BreakerOpenError(
            f"{self.label}: {op} refused, circuit breaker open after {self.breaker.threshold} consecutive failures "
            f"(retrying after {self.breaker.reset_s}s)"
        )
