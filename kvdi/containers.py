"""dependency-injector containers that select connectors, gate V1 and inject by role.

- :class:`KVTransferContainer`: settings -> registry -> V1 gate -> resolved connector (and
  its ``tiers``, resolved through the same registry) -> ``scheduler_connector`` /
  ``worker_connector`` (and the ``backend`` both halves share). The worker half also gets
  ``staging``: where it takes host/device staging buffers from.
- :class:`AllocatorContainer`: the allocation ``plan`` (no memory) and the ``allocator``
  (a Resource: allocated on first use, freed by ``shutdown_resources()``).
- :class:`EngineContainer`: composes both; the scheduler gets the scheduler half and the
  plan, the worker gets the worker half and the allocator, the engine gets both; the worker
  half's staging comes from the allocator, so one object accounts for device and pinned memory.

Build them with :func:`build_kv_container` / :func:`build_engine_container`, which validate
everything (settings, connector name, V1 gate, role classes) before returning. A container
composed into an application (``providers.Container(EngineContainer, settings=...)``) is
checked the same way, up front, by :func:`validate_container` (on it or on the whole app).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, TypeAlias, Union

from dependency_injector import containers, providers
from pydantic import BaseModel, ValidationError

from kvdi.allocator import GpuBufferAllocator, Staging, StagingBuffers, allocated
from kvdi.connectors.base import ConnectorContext, KVConnectorRole, SchedulerConnector, WorkerConnector, require_role
from kvdi.errors import ConfigError, V1EngineRequiredError
from kvdi.layout import KVCacheSpec
from kvdi.registry import ConnectorRegistry, LazyTarget, ResolvedConnector, Tier, import_target
from kvdi.settings import KvdiSettings, describe_validation_error, load_settings
from kvdi.settings.loading import errors_as_written, option_blamer


def check_v1_gate(settings: KvdiSettings) -> None:
    """Raise V1EngineRequiredError when ``use_v1`` is off, naming which env var turned it off."""
    if settings.use_v1:
        return
    for var in ("KVDI_USE_V1", "VLLM_USE_V1"):
        if os.environ.get(var, "").strip():
            raise V1EngineRequiredError(f"{var}={os.environ[var]}")
    raise V1EngineRequiredError("use_v1=False")


def resolve_connector(registry: ConnectorRegistry, settings: KvdiSettings) -> ResolvedConnector:
    """The V1 gate, then the registry lookup and class checks for ``settings.kv_connector``."""
    check_v1_gate(settings)
    return registry.resolve(settings.kv_connector, settings.kv_connector_module_path)


def connector_options(resolved: ResolvedConnector, settings: KvdiSettings) -> Any:
    """The connector's typed options: a KvdiSettings section (built-ins), or its own model (a plugin).

    A plugin's model (``ConnectorSpec.settings``: a pydantic model or ``"pkg.mod:Model"``, imported
    here) validates its ``<name>`` section (``KVDI_<NAME>__<FIELD>``, ``kvdi.<name>.<field>`` extra
    config, init kwargs, ``.env``, the settings file, with the usual precedence) over the plain
    (non-``kvdi``) keys of ``kv_connector_extra_config``. A bad value is a ConfigError naming the variable.
    """
    model = options_model(resolved)
    if model is None:
        return None
    if isinstance(model, str):
        return getattr(settings, model)
    return plugin_options(resolved.spec.name, model, settings)


def plugin_options(name: str, model: type[BaseModel], settings: KvdiSettings) -> Any:
    """Connector ``name``'s options validated by its own ``model`` (see :func:`connector_options`); ConfigError."""
    plain = {k: v for k, v in settings.kv_connector_extra_config.items() if k != "kvdi" and not k.startswith("kvdi.")}
    section = settings.plugin_options if settings.kv_connector.lower() == name.lower() else {}
    try:
        return model.model_validate({**plain, **section})
    except ValidationError as exc:
        blame = option_blamer()
        text = describe_validation_error(exc, lambda loc: blame((name.lower(), *loc)), model=model)
        raise ConfigError(f"options of connector {name!r}: {text}") from None


def options_model(resolved: ResolvedConnector) -> type[BaseModel] | str | None:
    """What ``ConnectorSpec.settings`` names: a KvdiSettings field (a built-in's section), a model, or None."""
    target = resolved.spec.settings
    if isinstance(target, str) and ":" in target:
        target = import_target(target, resolved.spec)
    if target is None or isinstance(target, str):
        return target
    if isinstance(target, type) and issubclass(target, BaseModel):
        return target
    raise TypeError(
        f"ConnectorSpec.settings of {resolved.spec.name!r} must be a field name, a pydantic model or 'pkg.mod:Model'"
    )


def resolve_tiers(
    registry: ConnectorRegistry, resolved: ResolvedConnector, options: Any, settings: KvdiSettings
) -> tuple[Tier, ...]:
    """The store connectors named by the connector's ``tiers`` field, each with its own options.

    Raises ConfigError (naming the setting, with did-you-mean) for a name that is not a
    registered store connector. Empty for a connector without tiers.
    """
    field = resolved.spec.tiers
    if field is None:
        return ()
    section = resolved.spec.settings
    plugin = not isinstance(section, str) or ":" in section
    setting = f"KVDI_{resolved.spec.name if plugin else section}__{field}".upper()
    tiers = []
    for name in getattr(options, field):
        tier = registry.resolve_store(name, setting)
        tiers.append(Tier(name, tier, connector_options(tier, settings)))
    return tuple(tiers)


def open_backend(
    resolved: ResolvedConnector, options: Any, layout: KVCacheSpec, settings: KvdiSettings, tiers: tuple[Tier, ...]
) -> Iterator[Any]:
    """Resource: the object both halves share, closed on ``shutdown_resources()``."""
    if resolved.backend_factory is None:
        yield None
        return
    extra = {"tiers": tiers} if resolved.spec.tiers is not None else {}
    backend = resolved.backend_factory(options, layout, settings, **extra)
    try:
        yield backend
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()


def build_half(
    resolved: ResolvedConnector,
    role: KVConnectorRole,
    settings: KvdiSettings,
    layout: KVCacheSpec,
    options: Any,
    backend: Any,
    staging: Staging | None = None,
) -> SchedulerConnector | WorkerConnector:
    """Construct the ``role`` half of the resolved connector and check it really is that role."""
    context = ConnectorContext(resolved.spec.name, role, settings, layout, options, backend, staging)
    half = resolved.cls_for(role)(context)
    require_role(half, role, f"connector {resolved.spec.name!r}")
    return half


def running_engine(scheduler: Any, worker: Any) -> Iterator[Any]:
    """Resource: the LLMEngine, whose connector halves are shut down by ``shutdown_resources()``."""
    engine = LazyTarget("kvdi.engine.engine:LLMEngine")(scheduler=scheduler, worker=worker)
    try:
        yield engine
    finally:
        engine.shutdown()


class KVTransferContainer(containers.DeclarativeContainer):
    """Selects the connector named by settings and builds its scheduler and worker halves."""

    settings = providers.Dependency(instance_of=KvdiSettings)
    registry = providers.Singleton(ConnectorRegistry)
    layout = providers.Singleton(KVCacheSpec.from_settings, settings)
    connector = providers.Singleton(resolve_connector, registry, settings)
    options = providers.Singleton(connector_options, connector, settings)
    tiers = providers.Singleton(resolve_tiers, registry, connector, options, settings)
    backend = providers.Resource(open_backend, connector, options, layout, settings, tiers)
    staging = providers.Singleton(StagingBuffers, settings.provided.allocator.pin_memory)
    """Staging for the worker half; an EngineContainer replaces it with its allocator's."""
    scheduler_connector = providers.Factory(
        build_half, connector, KVConnectorRole.SCHEDULER, settings, layout, options, backend
    )
    worker_connector = providers.Factory(
        build_half, connector, KVConnectorRole.WORKER, settings, layout, options, backend, staging
    )


class AllocatorContainer(containers.DeclarativeContainer):
    """The KV cache plan (no memory touched) and the allocator that realises it."""

    settings = providers.Dependency(instance_of=KvdiSettings)
    layout = providers.Singleton(KVCacheSpec.from_settings, settings)
    planner = providers.Singleton(GpuBufferAllocator, layout, settings.provided.allocator)
    plan = providers.Singleton(GpuBufferAllocator.plan, planner)
    allocator = providers.Resource(allocated, planner)
    staging = allocator.provided.staging


class EngineContainer(containers.DeclarativeContainer):
    """A whole engine: scheduler with the scheduler half, worker with the worker half and the allocator."""

    settings = providers.Dependency(instance_of=KvdiSettings)
    alloc = providers.Container(AllocatorContainer, settings=settings)
    kv = providers.Container(KVTransferContainer, settings=settings, staging=alloc.staging)

    model = providers.Singleton(
        LazyTarget("kvdi.engine.model:TransformerModel"), settings.provided.model, alloc.layout, alloc.plan
    )
    scheduler = providers.Singleton(
        LazyTarget("kvdi.engine.scheduler:Scheduler"),
        connector=kv.scheduler_connector,
        plan=alloc.plan,
        settings=settings,
    )
    worker = providers.Singleton(
        LazyTarget("kvdi.engine.worker:Worker"),
        connector=kv.worker_connector,
        allocator=alloc.allocator,
        model=model,
        settings=settings,
    )
    engine = providers.Resource(running_engine, scheduler=scheduler, worker=worker)


KvdiContainer: TypeAlias = Union[  # string members: dependency-injector's generics exist only in its stubs
    EngineContainer,
    KVTransferContainer,
    "providers.Container[EngineContainer]",
    "providers.Container[KVTransferContainer]",
]
"""A kvdi container instance, or the ``providers.Container`` that composes one into an app."""


def validate_container(container: Any) -> int:
    """Run the checks of :func:`build_engine_container` / :func:`build_kv_container` on composed containers now.

    ``container`` is a kvdi container, a ``providers.Container`` holding one, or any
    application container: every kvdi container among its providers (at any depth) is
    checked: settings resolve and validate, the connector name resolves (did-you-mean), the
    V1 gate, connector options and tiers, and for an engine the allocation plan. Nothing is
    allocated and no backend is opened. Returns how many kvdi containers were checked;
    raises the first :class:`~kvdi.errors.KvdiError` (TypeError when it holds none).
    """
    found = _validate(container, depth=0)
    if not found:
        raise TypeError(f"{type(container).__name__} holds no kvdi EngineContainer or KVTransferContainer")
    return found


def _validate(container: Any, depth: int) -> int:
    parent = getattr(getattr(container, "container", container), "declarative_parent", None)
    if isinstance(parent, type) and issubclass(parent, EngineContainer):
        _check_kv(container.kv)
        container.alloc.plan()  # an impossible budget fails here, before anything is allocated
        return 1
    if isinstance(parent, type) and issubclass(parent, KVTransferContainer):
        _check_kv(container)
        return 1
    holder = getattr(container, "container", container)
    items = getattr(holder, "providers", None)
    if depth > 16 or not isinstance(items, dict):
        return 0
    return sum(_validate(p, depth + 1) for p in items.values() if isinstance(p, providers.Container))


def _check_kv(kv: Any) -> None:
    kv.connector()
    kv.options()
    kv.tiers()


def build_kv_container(
    settings: KvdiSettings | None = None, *, registry: ConnectorRegistry | None = None, **overrides: Any
) -> KVTransferContainer:
    """A validated KVTransferContainer: settings, connector name, V1 gate and classes checked now."""
    container = KVTransferContainer(settings=settings if settings is not None else load_settings(**overrides))
    if registry is not None:
        container.registry.override(providers.Object(registry))
    with errors_as_written(overrides):  # errors name the keyword argument, not KVDI_*
        _check_kv(container)
    return container


def build_engine_container(
    settings: KvdiSettings | None = None, *, registry: ConnectorRegistry | None = None, **overrides: Any
) -> EngineContainer:
    """A validated EngineContainer: everything :func:`build_kv_container` checks, plus the allocation plan."""
    container = EngineContainer(settings=settings if settings is not None else load_settings(**overrides))
    if registry is not None:
        container.kv.registry.override(providers.Object(registry))
    with errors_as_written(overrides):  # errors name the keyword argument, not KVDI_*
        validate_container(container)
    return container


__all__ = [
    "AllocatorContainer",
    "EngineContainer",
    "KVTransferContainer",
    "KvdiContainer",
    "build_engine_container",
    "build_kv_container",
    "check_v1_gate",
    "validate_container",
]
