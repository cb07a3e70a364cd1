"""The settings sections (``KVDI_<SECTION>__*``): one frozen pydantic model per concern, every number bounded.

Bounds a caller may rely on once a section validated:

- every duration is finite, > 0 and at most :data:`MAX_DURATION_S` (one day), which socket
  timeouts, ``threading`` waits and Redis accept;
- ``redis.ttl_s`` (default :data:`DEFAULT_REDIS_TTL_S`, one day; 0 never expires) is at most
  :data:`MAX_REDIS_TTL_S` (2**31-1 s, ~68 years): Redis refuses an
  ``EX`` whose milliseconds, added to the current time, overflow a signed 64-bit integer;
- in-memory byte budgets (``cpu_offload.max_bytes``, ``p2p.max_held_bytes``) are at most the
  machine's physical memory (:func:`physical_memory_bytes`), read when the value is validated;
- ``shared_storage.path`` holds no NUL, is not an existing non-directory and is not under a
  kernel file system (``/proc``, ``/sys``, ``/dev``);
- every other count has a documented ``le`` bound (see each field).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
LoadFailurePolicy = Literal["recompute", "fail"]
Dtype = Literal["float32", "float16", "bfloat16"]

MAX_DURATION_S = 86_400.0
MAX_REDIS_TTL_S = 2**31 - 1
DEFAULT_REDIS_TTL_S = 86_400  # one day: see RedisSettings.ttl_s
MAX_STORE_BYTES = 2**63 - 1  # the largest off_t
MAX_BLOCKS = 2**31 - 1  # block ids are int32 in the engine's tables
MAX_LOAD_THREADS = 16  # background loads at once; more only adds GIL contention with the engine
KERNEL_FILE_SYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def default_cache_dir() -> Path:
    """Where the embedded default stores KV: ``$XDG_CACHE_HOME/kvdi/kv`` (or ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvdi" / "kv"


def physical_memory_bytes() -> int:
    """Physical memory of this machine in bytes (``SC_PHYS_PAGES * SC_PAGE_SIZE``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def within_physical_memory(value: int) -> int:
    """``value`` when it is at most :func:`physical_memory_bytes`; else ValueError (use in a field validator)."""
    if value > (limit := physical_memory_bytes()):
        raise ValueError(f"must be at most this machine's physical memory ({limit} B)")
    return value


def duration_field(default: float, most: float = MAX_DURATION_S) -> float:
    """A pydantic ``Field`` for a duration in seconds: finite, > 0, at most ``most`` (:data:`MAX_DURATION_S`)."""
    return Field(default, gt=0, le=most, allow_inf_nan=False)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class AllocatorSettings(_Section):
    """Where and how large the paged KV cache is (``KVDI_ALLOCATOR__*``).

    ``num_blocks`` is bounded here by :data:`MAX_BLOCKS`; whether that many blocks fit the
    device is the allocation plan's question (``kvdi check`` asks it).
    """

    device: str = "auto"
    dtype: Dtype = "float32"
    block_size: int = Field(16, gt=0, le=4096)
    num_blocks: int | None = Field(None, gt=0, le=MAX_BLOCKS)
    memory_fraction: float | None = Field(None, gt=0.0, le=1.0)
    pin_memory: bool = True
    max_staging_bytes: int = Field(64 << 20, gt=0)
    """The most staging one transfer of kvdi holds outside the KV cache: a p2p fetch's receive staging
    (pinned host memory for a CUDA cache over gloo, device memory over NCCL; fetches are split to fit) and
    the vLLM adapter's layout-bridge scratch (the cache's device; a larger step moves in rounds)."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("max_staging_bytes")
    @classmethod
    def _staging_memory(cls, value: int) -> int:
        return within_physical_memory(value)

    @model_validator(mode="after")
    def _one_budget(self) -> AllocatorSettings:
        if self.num_blocks is not None and self.memory_fraction is not None:
            raise ValueError("set num_blocks or memory_fraction, not both")
        return self


class ModelSettings(_Section):
    """Shape of the reference engine's model (``KVDI_MODEL__*``)."""

    model_id: str = Field("kvdi-tiny", min_length=1, max_length=256)
    num_layers: int = Field(4, gt=0, le=1024)
    hidden_size: int = Field(256, gt=0, le=1 << 16)
    num_heads: int = Field(8, gt=0, le=1024)
    num_kv_heads: int = Field(4, gt=0, le=1024)
    head_dim: int = Field(32, gt=0, le=1024)
    intermediate_size: int = Field(512, gt=0, le=1 << 18)
    vocab_size: int = Field(1024, gt=1, le=1 << 22)
    max_model_len: int = Field(4096, gt=0, le=1 << 24)
    seed: int = Field(0, ge=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _gqa(self) -> ModelSettings:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class SchedulerSettings(_Section):
    """Scheduler limits of the reference engine and how a store connector's scheduler half looks up hits
    (``KVDI_SCHEDULER__*``).

    ``lookup``: how the scheduler half asks the store which blocks it holds. ``sync`` asks inside
    the scheduler's step (one round trip per waiting request, as before); ``async`` (with a host
    that asks again, vLLM) answers "ask again" and looks up in the background, the requests of a
    step in one batched round trip; ``auto`` picks ``async`` for a store that says it is remote or
    whose lookup round trip measures 1 ms or more, ``sync`` otherwise. ``lookup_timeout_s``: a
    background lookup still unanswered after this long is a counted miss (the request computes).
    ``load_deadline``: a lookup, a hit and a prefetch pass a cost model's rule (loading must be expected
    to beat recomputing, ``load_deadline_margin`` x recompute time; :mod:`kvdi.connectors.store.deadline`).
    """

    max_num_batched_tokens: int = Field(2048, gt=0, le=1 << 24)
    max_num_seqs: int = Field(16, gt=0, le=1 << 16)
    lookup: Literal["auto", "sync", "async"] = "auto"
    lookup_timeout_s: float = duration_field(2.0, most=600)
    load_deadline: bool = False
    load_deadline_margin: float = Field(1.0, ge=0.1, le=10.0)

    @field_validator("lookup", mode="before")
    @classmethod
    def _lookup(cls, value: Any) -> Any:
        if value not in ("auto", "sync", "async"):
            raise ValueError(f"scheduler.lookup must be auto, sync or async, got {value!r}")
        return value


class SharedStorageSettings(_Section):
    """Local directory of framed KV objects (``KVDI_SHARED_STORAGE__*``)."""

    path: Path = Field(default_factory=default_cache_dir)
    max_bytes: int | None = Field(None, gt=0, le=MAX_STORE_BYTES)
    mode: int = 0o600
    """Mode of object files (octal, e.g. "0640" for a group-shared store); folders get x where r is set."""
    format: Literal["per_rank", "canonical"] = "per_rank"
    """``canonical``: sections any TP/PP shape shares, replicated KV once (docs/stored-format.md)."""
    section_layers: int = Field(0, ge=0, le=1024)
    """Layers per canonical section (0: all); must divide the model's layers and every PP stage's."""
    section_heads: int = Field(1, gt=0, le=1024)
    """KV heads per canonical section; must divide every TP rank's heads (1 fits all; fewer objects when larger)."""

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> int:
        text = str(value).strip().lower()
        try:
            mode = int(text.removeprefix("0o"), 8) if isinstance(value, str) else int(value)
        except ValueError:
            raise ValueError(f"mode must be octal file permissions such as 0600 or 0640, got {text!r}") from None
        if isinstance(value, bool) or mode & ~0o666 or mode & 0o600 != 0o600:
            raise ValueError(
                "mode must be read/write permission bits only (no x, setuid, sticky), with the owner able to "
                "read and write, e.g. 0600 (private) or 0640 (group can read)"
            )
        return mode

    @field_validator("path")
    @classmethod
    def _path(cls, value: Path) -> Path:
        text = str(value)
        if "\x00" in text:
            raise ValueError("path must not contain a NUL character")
        resolved = value.expanduser().resolve(strict=False)
        for kernel in KERNEL_FILE_SYSTEMS:
            if resolved == kernel or kernel in resolved.parents:
                raise ValueError(f"path is under {kernel}, a kernel file system; point it at a directory on disk")
        if resolved.exists() and not resolved.is_dir():
            raise ValueError("path exists and is not a directory")
        return value


class CpuOffloadSettings(_Section):
    """Host memory pool (``KVDI_CPU_OFFLOAD__*``); ``max_bytes`` at most the physical memory."""

    max_bytes: int = Field(1 << 30, gt=0)
    format: Literal["per_rank"] = "per_rank"
    """Always ``per_rank``: one worker process's pool, which no other rank or shape reads (docs/stored-format.md)."""

    @field_validator("max_bytes")
    @classmethod
    def _memory(cls, value: int) -> int:
        return within_physical_memory(value)

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value != "per_rank":
            raise ValueError(
                f"format={value!r}: cpu_offload's pool lives in one worker process that no other rank or shape "
                "reads, so it keeps per-rank frames (a canonical shared tier behind it in multi shares them); "
                "allowed: per_rank"
            )
        return value


class RedisSettings(_Section):
    """Redis server (``KVDI_REDIS__*``); the URL may carry a password and is masked when shown."""

    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    key_prefix: str = Field("kvdi:", max_length=1024)
    ttl_s: int | None = Field(DEFAULT_REDIS_TTL_S, ge=0, le=MAX_REDIS_TTL_S)
    """Seconds each stored block lives (``SET ... EX``); 0 or null: never expires.

    The default, one day, bounds what a retired model, deployment or demo leaves behind while
    a hot prefix is recomputed and stored again at most once a day (Redis does not renew a TTL on
    reads). Pair it with ``maxmemory`` and ``maxmemory-policy volatile-lru`` (docs/sizing.md).
    """
    connect_timeout_s: float = duration_field(1.0)
    op_timeout_s: float = duration_field(2.0)
    breaker_failures: int = Field(3, gt=0, le=1_000_000)
    breaker_reset_s: float = duration_field(5.0)
    cluster: bool = False
    """``url`` names any startup node of a Redis Cluster (keys spread over its hash slots)."""
    read_from_replicas: bool = False
    """On a cluster, read from replicas too (writes always go to masters)."""
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

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value()
        if not raw.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("url must start with redis://, rediss:// or unix://")
        return value


class MultiSettings(_Section):
    """Tiers tried in order for loads, all written on saves (``KVDI_MULTI__*``)."""

    tiers: tuple[str, ...] = Field(("cpu_offload", "shared_storage"), max_length=16)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("tiers must name at least one connector")
        if "multi" in value:
            raise ValueError("multi cannot be one of its own tiers")
        return value


class P2pSettings(_Section):
    """Peer-to-peer transfer over torch.distributed (``KVDI_P2P__*``)."""

    kv_ip: str = Field("127.0.0.1", min_length=1, max_length=253)
    kv_port: int = Field(14579, gt=0, lt=65536)
    kv_rank: int = Field(0, ge=0, lt=1 << 16)
    kv_parallel_size: int = Field(2, gt=1, le=1 << 16)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = duration_field(30.0, most=3600)
    connect_timeout_s: float = duration_field(60.0, most=3600)
    hold_s: float = duration_field(60.0, most=3600)
    max_held_bytes: int = Field(1 << 30, gt=0)
    auth_token: SecretStr | None = None
    """Shared by both peers (16+ characters); proven with an HMAC challenge in the handshake."""

    @field_validator("max_held_bytes")
    @classmethod
    def _memory(cls, value: int) -> int:
        return within_physical_memory(value)


class TransferSettings(_Section):
    """Background I/O of the store connectors (``KVDI_TRANSFER__*``).

    ``io_thread``: overlap store calls with checksums on a second thread in synchronous
    transfers (auto: when 4+ CPUs are usable). ``async_save``: ``wait_for_save`` queues the
    step's saves and returns; a finished request's blocks stay held until written.
    ``async_load``: load in the background while other requests run (auto: in vLLM, prefetch at
    lookup for a store that says it is remote or whose lookup takes 1 ms or more; else in the
    background for such a store or a hit of 16 MiB or more, synchronously otherwise). ``max_inflight_bytes`` bounds the
    bytes of queued saves; past it ``wait_for_save`` waits for the medium.
    ``idle_load_wait_ms``: on an engine step that schedules nothing while asynchronous loads
    are in flight, the worker waits up to this long (GIL released) for one to finish before
    answering, instead of letting empty steps spin against the loader; 0 turns it off.
    ``async_load=prefetch`` (vLLM): a lookup's hit is fetched into host staging first (the
    request waits, holding no KV block), then loaded synchronously from there (a copy);
    ``prefetch_max_bytes`` bounds that staging (past it, hits take the ``auto`` path);
    ``prefetch_timeout_s`` is each prefetch's deadline: past it the request is told "a miss",
    its staging is released and it is recomputed (a store that hangs cannot wedge a request).
    ``load_threads``: asynchronous loads that run at once (one request each): while one waits for
    the medium another checks and places its blocks.
    """

    io_thread: Literal["auto", "on", "off"] = "off"
    async_save: bool = True
    async_load: Literal["auto", "on", "off", "prefetch"] = "auto"
    max_inflight_bytes: int = Field(256 << 20, gt=0)
    idle_load_wait_ms: float = Field(10.0, ge=0, le=1000)
    prefetch_max_bytes: int = Field(256 << 20, gt=0)
    prefetch_timeout_s: float = duration_field(10.0, most=600)
    load_threads: int = Field(2, ge=1, le=MAX_LOAD_THREADS)

    @field_validator("max_inflight_bytes", "prefetch_max_bytes")
    @classmethod
    def _memory(cls, value: int) -> int:
        return within_physical_memory(value)


__all__ = [
    "DEFAULT_REDIS_TTL_S",
    "KERNEL_FILE_SYSTEMS",
    "MAX_BLOCKS",
    "MAX_DURATION_S",
    "MAX_LOAD_THREADS",
    "MAX_REDIS_TTL_S",
    "MAX_STORE_BYTES",
    "AllocatorSettings",
    "CpuOffloadSettings",
    "Dtype",
    "KVRole",
    "LoadFailurePolicy",
    "ModelSettings",
    "MultiSettings",
    "P2pSettings",
    "RedisSettings",
    "SchedulerSettings",
    "SharedStorageSettings",
    "TransferSettings",
    "default_cache_dir",
    "duration_field",
    "physical_memory_bytes",
    "within_physical_memory",
]
