"""Connector registry: names to lazily imported scheduler and worker classes.

Nothing is imported until a name is resolved. Sources, in order: kvdi's built-ins, the
``kvdi.connectors`` entry-point group (the entry point's name is the connector name, its
object a :class:`ConnectorSpec`), then ``kv_connector_module_path`` (a module exposing a
``ConnectorSpec``, or a vLLM-style class named ``kv_connector`` that serves either role).
A registry is a plain object owned by a container; two containers may hold different ones.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvdi.connectors.base import KVConnectorRole, SchedulerConnector, WorkerConnector
from kvdi.errors import (
    ConfigError,
    ConnectorImportError,
    ConnectorTypeError,
    DuplicateConnectorError,
    KvdiError,
    UnknownConnectorError,
    did_you_mean,
)

ENTRY_POINT_GROUP = "kvdi.connectors"
Origin = Literal["builtin", "entry-point", "module-path"]


@dataclass(frozen=True)
class ConnectorSpec:
    """A connector's declaration: ``"pkg.mod:Class"`` targets, imported only when built.

    ``backend`` optionally names a callable ``f(context) -> object`` built once per
    container and shared by both halves (a store, pool or client). ``settings`` names the
    connector's options model: a field of :class:`~kvdi.settings.KvdiSettings` (the built-ins'
    sections), or a plugin's pydantic model (a class, or ``"pkg.mod:Model"`` imported when the
    connector is built) that validates the ``<name>`` section of every settings source
    (``KVDI_<NAME>__<FIELD>``, ``kvdi.<name>.<field>`` extra config, the settings file, init
    kwargs) over the plain keys of ``kv_connector_extra_config``. ``requires``
    lists import names of optional dependencies and ``install`` the pip requirement that
    provides them (default: the import names themselves); a connector whose requirement is
    missing fails to resolve with ``pip install '<install>'`` in its message. ``process_local``
    says the backend lives in this process only (e.g. ``cpu_offload``): what one process saves
    another cannot load.
    ``tiers`` names the field of the connector's options that lists other registered store
    connectors this one is built from (``multi``'s ``tiers``): the container resolves each
    through its registry before building anything and hands the backend factory ``tiers=``.
    ``scheduler_backend`` optionally names a factory with ``backend``'s signature (a plain or
    generator function) for a scheduler half whose worker half runs in another process (the
    vLLM adapter under a multiprocess executor); None: the usual ``backend``.
    """

    name: str
    scheduler: str
    worker: str
    backend: str | None = None
    settings: str | type[Any] | None = None
    requires: tuple[str, ...] = ()
    description: str = ""
    process_local: bool = False  # blocks live in the worker process's memory (the vLLM adapter indexes them)
    tiers: str | None = None
    scheduler_backend: str | None = None
    install: str = ""

    @property
    def install_hint(self) -> str:
        """`` (install it with: pip install '...')`` for a connector with requirements, else ``""``."""
        what = self.install or " ".join(self.requires)
        return f" (install it with: pip install '{what}')" if what else ""

    def targets(self) -> tuple[str, str, str | None]:
        return (self.scheduler, self.worker, self.backend)


@dataclass(frozen=True)
class Registered:
    """A spec with where it came from."""

    spec: ConnectorSpec
    origin: Origin

    @property
    def missing_requirements(self) -> tuple[str, ...]:
        """Optional dependencies that are not installed (checked without importing them)."""
        return tuple(r for r in self.spec.requires if importlib.util.find_spec(r) is None)


@dataclass(frozen=True)
class ResolvedConnector:
    """A spec whose classes are imported and checked against the role base classes."""

    spec: ConnectorSpec
    origin: Origin
    scheduler_cls: type[SchedulerConnector]
    worker_cls: type[WorkerConnector]
    backend_factory: Callable[..., Any] | None

    def cls_for(self, role: KVConnectorRole) -> type[SchedulerConnector] | type[WorkerConnector]:
        return self.scheduler_cls if role is KVConnectorRole.SCHEDULER else self.worker_cls

    @property
    def store_halves(self) -> bool:
        """Kvdi's store halves over a backend (a BlockStore): blocks move by key, so each rank of a
        parallel engine can store its own slice (unless the store is ``process_local``)."""
        from kvdi.connectors.store import StoreSchedulerConnector, StoreWorkerConnector

        return (
            self.backend_factory is not None
            and issubclass(self.scheduler_cls, StoreSchedulerConnector)
            and issubclass(self.worker_cls, StoreWorkerConnector)
        )

    @property
    def is_store(self) -> bool:
        """A plain store connector: the store halves over its own backend, no tiers (so it can be a tier)."""
        return self.spec.tiers is None and self.store_halves

    @property
    def stores_rank_slices(self) -> bool:
        """Each rank of a tensor/pipeline-parallel engine can store and load its own slice: the store halves
        over a store every process reaches (not ``process_local``)."""
        return self.store_halves and not self.spec.process_local


@dataclass(frozen=True)
class Tier:
    """One store connector another connector is built from, with its typed options."""

    name: str
    connector: ResolvedConnector
    options: Any


_C = "kvdi.connectors"
BUILTIN_SPECS: tuple[ConnectorSpec, ...] = (
    ConnectorSpec(
        "null",
        f"{_C}.null:NullSchedulerConnector",
        f"{_C}.null:NullWorkerConnector",
        description="does nothing; the baseline",
    ),
    ConnectorSpec(
        "shared_storage",
        f"{_C}.store:StoreSchedulerConnector",
        f"{_C}.store:StoreWorkerConnector",
        backend=f"{_C}.shared_storage:open_store",
        settings="shared_storage",
        description="framed objects in a local directory (the embedded default)",
    ),
    ConnectorSpec(
        "cpu_offload",
        f"{_C}.store:StoreSchedulerConnector",
        f"{_C}.store:StoreWorkerConnector",
        backend=f"{_C}.cpu_offload:open_store",
        settings="cpu_offload",
        description="host memory pool with LRU eviction",
        process_local=True,
    ),
    ConnectorSpec(
        "redis",
        f"{_C}.store:StoreSchedulerConnector",
        f"{_C}.store:StoreWorkerConnector",
        backend=f"{_C}.redis:open_store",
        settings="redis",
        requires=("redis",),
        install="kvdi[redis]",
        description="one Redis key per framed block",
    ),
    ConnectorSpec(
        "s3",
        f"{_C}.store:StoreSchedulerConnector",
        f"{_C}.store:StoreWorkerConnector",
        backend=f"{_C}.s3:open_store",
        settings=f"{_C}.s3.settings:S3Settings",  # its own model, as a plugin's (KVDI_S3__*)
        requires=("boto3",),
        install="kvdi[s3]",
        description="one S3 object per framed block, published once (any S3-compatible bucket)",
    ),
    ConnectorSpec(
        "multi",
        f"{_C}.store:StoreSchedulerConnector",
        f"{_C}.store:StoreWorkerConnector",
        backend=f"{_C}.multi:open_store",
        settings="multi",
        tiers="tiers",
        description="tiers in order, e.g. cpu_offload then shared_storage",
    ),
    ConnectorSpec(
        "p2p",
        f"{_C}.p2p.scheduler:P2pSchedulerConnector",
        f"{_C}.p2p.worker:P2pWorkerConnector",
        backend=f"{_C}.p2p.backend:open_channel",
        settings="p2p",
        scheduler_backend=f"{_C}.p2p.lookup:open_lookups",  # only the worker process pairs
        description="producer to consumer over torch.distributed",
    ),
)


def import_target(target: str, spec: ConnectorSpec | None = None) -> Any:
    """Import ``"pkg.mod:attr"``; raise ConnectorImportError naming module, attribute and cause.

    When the missing module is one of ``spec.requires``, the message carries the spec's install hint.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConnectorImportError(target, ValueError("target must look like 'pkg.module:Name'"))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or "").partition(".")[0]
        hint = spec.install_hint if spec is not None and missing in spec.requires else ""
        raise ConnectorImportError(target, exc, hint) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ConnectorImportError(target, exc) from exc


class LazyTarget:
    """A callable that imports ``"pkg.mod:attr"`` on first call and caches it."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._obj: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._obj is None:
            self._obj = import_target(self.target)
        return self._obj(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyTarget({self.target!r})"


@dataclass
class ConnectorRegistry:
    """Names to specs. ``entry_points=True`` discovers the ``kvdi.connectors`` group lazily."""

    specs: Iterable[ConnectorSpec] = BUILTIN_SPECS
    entry_points: bool = True
    _by_name: dict[str, Registered] = field(default_factory=dict, init=False)
    _entry_points: dict[str, importlib.metadata.EntryPoint] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        for spec in self.specs:
            self.register(spec, origin="builtin")
        if self.entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name not in self._by_name:
                    self._entry_points.setdefault(ep.name, ep)

    def register(self, spec: ConnectorSpec, origin: Origin = "builtin") -> None:
        """Add a spec; the same targets again are a no-op, other targets raise DuplicateConnectorError."""
        current = self._by_name.get(spec.name)
        if current is not None:
            if current.spec.targets() == spec.targets():
                return
            raise DuplicateConnectorError(
                f"connector {spec.name!r} is already registered ({current.origin}: "
                f"{current.spec.scheduler}, {current.spec.worker}); refusing {spec.scheduler}, {spec.worker}"
            )
        self._by_name[spec.name] = Registered(spec, origin)

    def names(self) -> list[str]:
        """All names: registered specs and not yet loaded entry points."""
        return sorted({*self._by_name, *self._entry_points})

    def get(self, name: str, module_path: str | None = None) -> Registered:
        """The registered spec for ``name``; loads entry points and ``module_path`` on demand."""
        if module_path:
            self._load_module_path(name, module_path)
        if name not in self._by_name and name in self._entry_points:
            self._load_entry_point(name)
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownConnectorError(name, self.names()) from None

    def all(self) -> list[Registered]:
        """Every spec, loading entry-point specs (their modules should be light)."""
        for name in list(self._entry_points):
            if name not in self._by_name:
                self._load_entry_point(name)
        return [self._by_name[n] for n in sorted(self._by_name)]

    def resolve(self, name: str, module_path: str | None = None) -> ResolvedConnector:
        """Import and check the classes of ``name``; raises TypeError for a class of the wrong role."""
        entry = self.get(name, module_path)
        spec = entry.spec
        scheduler_cls = _checked_class(spec, spec.scheduler, SchedulerConnector)
        worker_cls = _checked_class(spec, spec.worker, WorkerConnector)
        backend = import_target(spec.backend, spec) if spec.backend else None
        return ResolvedConnector(spec, entry.origin, scheduler_cls, worker_cls, backend)

    def resolve_store(self, name: str, setting: str) -> ResolvedConnector:
        """Resolve ``name`` as a tier: a registered store connector; ConfigError naming ``setting`` otherwise."""
        try:
            resolved = self.resolve(name)
        except UnknownConnectorError:
            stores = self.store_names()
            raise ConfigError(
                f"{setting} names {name!r}, which is not a registered connector; "
                f"store connectors: {', '.join(stores)}{did_you_mean(name, stores)}"
            ) from None
        if not resolved.is_store:
            raise ConfigError(
                f"{setting} names {name!r}, which is not a store connector (a tier needs the store halves over "
                f"a store backend); store connectors: {', '.join(self.store_names())}"
            )
        return resolved

    def store_names(self) -> list[str]:
        """Names of every registered connector that can be a tier (imports their classes)."""
        out = []
        for entry in self.all():
            try:
                if self.resolve(entry.spec.name).is_store:
                    out.append(entry.spec.name)
            except (KvdiError, ImportError, TypeError):
                continue
        return out

    def _load_entry_point(self, name: str) -> None:
        ep = self._entry_points.pop(name)
        try:
            obj = ep.load()
        except ImportError as exc:
            raise ConnectorImportError(ep.value, exc) from exc
        if not isinstance(obj, ConnectorSpec):
            raise ConnectorTypeError(
                f"entry point {name!r} ({ep.value}) must be a kvdi ConnectorSpec, got {type(obj).__name__}"
            )
        self.register(_renamed(obj, name), origin="entry-point")

    def _load_module_path(self, name: str, module_path: str) -> None:
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise ConnectorImportError(f"{module_path}:{name}", exc) from exc
        specs = [v for v in vars(module).values() if isinstance(v, ConnectorSpec)]
        if len(specs) > 1:
            specs = [s for s in specs if s.name == name] or specs
        if len(specs) == 1:
            self.register(_renamed(specs[0], name), origin="module-path")
            return
        if len(specs) > 1:
            raise ConnectorTypeError(
                f"module {module_path!r} exposes several ConnectorSpecs and none is named {name!r}"
            )
        if not hasattr(module, name):
            raise ConnectorImportError(
                f"{module_path}:{name}",
                AttributeError(f"module has no ConnectorSpec and no class named {name!r}"),
            )
        target = f"{module_path}:{name}"
        self.register(ConnectorSpec(name, target, target), origin="module-path")


def _renamed(spec: ConnectorSpec, name: str) -> ConnectorSpec:
    return spec if spec.name == name else replace(spec, name=name)


def _checked_class(spec: ConnectorSpec, target: str, base: type[Any]) -> Any:
    cls = import_target(target, spec)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConnectorTypeError(f"{target} must be a subclass of kvdi.connectors.base.{base.__name__}, got {cls!r}")
    return cls
