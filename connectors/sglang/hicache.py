"""``NexusKVHiCacheStorage``: an SGLang ``HiCacheStorage`` backed by NexusKV's data plane.

Plug it into SGLang (0.5.10 to 0.5.23, ``../shared/reference/engines.md`` §4.2) with::

    python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --page-size 64 \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"nexuskv",
          "module_path":"connectors.sglang.hicache","class_name":"NexusKVHiCacheStorage",
          "tier":"remote","tenant":"acme","model":"meta-llama/Llama-3.1-8B"}'

with ``NEXUSKV_BROKER`` (and ``NEXUSKV_REMOTE_TIER`` for the shared remote tier, ``NEXUSKV_DATA_DIR``
for the disk tier) in SGLang's environment. SGLang constructs the class as
``cls(storage_config, kwargs)`` and then calls ``register_mem_pool_host``; it uses the generic I/O
path (``batch_get`` into the pages it passes, ``batch_set`` of page tensors) and ``batch_exists``
for its prefetch check. The zero-copy ``interface_v1`` path is not implemented: asking for it is
refused at start.

The logic is :class:`~connectors.sglang.hicache_core.HiCacheCore` (tested on its own, SGLang
cannot be installed where NexusKV is tested); this module translates SGLang's objects and
wires the bus (:class:`~connectors.bus_thread.BackgroundBus`: the index replica that gates
``exists``, the cost model that gates ``batch_exists``, the producer of the backend's page facts).
Importing it does not import SGLang: the subclass is built when SGLang first asks for
``NexusKVHiCacheStorage``. Facts travel through the bus, so a page just written reads as absent
until the replica has applied its event (a miss, never a wrong hit).

Extra-config keys besides SGLang's ``backend_name``/``module_path``/``class_name`` (unknown keys
are refused by name): ``tier`` (``remote`` when ``NEXUSKV_REMOTE_TIER`` is set, else ``disk``;
also ``host``), ``worker`` (the backend's publisher name; default
``sglang-hicache/<host>/tp<rank>``), ``tenant``, ``model`` (default SGLang's model name),
``descriptor`` (a StateDescriptor JSON file), ``page_size`` (SGLang's ``--page-size``; required
unless the storage config carries ``logical_page_size``), ``profile`` (the hardware profile in the
cost model), and SGLang's own ``interface_v1`` (must be false).
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.descriptors import resolve_descriptor
from connectors.lazy import lazy_attribute
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import ConfigError

__all__ = ["HiCacheConfig", "build_core", "NexusKVHiCacheStorage"]

_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_KEYS = frozenset({"tier", "worker", "tenant", "model", "descriptor", "page_size", "profile"})
_TIERS = {"host": Tier.HOST, "disk": Tier.DISK, "remote": Tier.REMOTE}


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    worker: str
    descriptor: StateDescriptor
    tier: Tier
    profile: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, model_name: str | None, tp_rank: int = 0, tp_size: int = 1,
              page_size: int | None = None, remote_configured: bool = False,
              host: str | None = None) -> HiCacheConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS - _SGLANG_KEYS)
        if unknown:
            raise ConfigError(f"hicache_storage_backend_extra_config.{unknown[0]}",
                              f"unknown key (known: {', '.join(sorted(_KEYS))})")
        if extra.get("interface_v1"):
            raise ConfigError("hicache_storage_backend_extra_config.interface_v1",
                              "the zero-copy v1 interface is not implemented; leave it off (generic path)")
        tier_name = str(extra.get("tier", "remote" if remote_configured else "disk")).lower()
        if tier_name not in _TIERS:
            raise ConfigError("hicache_storage_backend_extra_config.tier", f"{tier_name!r} is not one of host, disk, "
                                                                           "remote")
        if _TIERS[tier_name] is Tier.REMOTE and not remote_configured:
            raise ConfigError("NEXUSKV_REMOTE_TIER", "tier 'remote' needs the remote tier's address")
        size = extra.get("page_size", page_size)
        if not isinstance(size, int) or size < 1:
            raise ConfigError("hicache_storage_backend_extra_config.page_size", "SGLang's --page-size, a positive int")
        descriptor = resolve_descriptor(model=extra.get("model", model_name), descriptor_path=extra.get("descriptor"),
                                        tenant=str(extra.get("tenant", "default")), block_size=size,
                                        engine_family="sglang")
        if tp_size > 1 and descriptor.parallel.tp_size != tp_size:
            raise ConfigError("hicache_storage_backend_extra_config.descriptor",
                              f"SGLang runs TP={tp_size}; give a descriptor of rank {tp_rank} of {tp_size}")
        if descriptor.block_size != size:
            raise ConfigError("hicache_storage_backend_extra_config.descriptor",
                              f"block size {descriptor.block_size} is not the page size {size}")
        worker = extra.get("worker") or f"sglang-hicache/{host or socket.gethostname()}/tp{tp_rank}"
        return cls(worker=str(worker), descriptor=descriptor, tier=_TIERS[tier_name], profile=extra.get("profile"))


def build_core(config: HiCacheConfig, settings: Any, *, layout: Any = None) -> tuple[Any, Any]:
    """The backend's core and the bus it runs on (started); stop the bus when done."""
    from connectors.bus_thread import BackgroundBus
    from connectors.sglang.hicache_core import HiCacheCore
    from nexuskv.dataplane.catalog import BackendCatalog
    from nexuskv.dataplane.disk import DiskBackend
    from nexuskv.dataplane.memory import HostMemoryBackend
    from nexuskv.dataplane.remote import RemoteBackend
    from nexuskv.policy import ExecutionPolicy
    from streams.policy_file import PolicyFile

    if settings.broker_url is None:
        raise ConfigError("NEXUSKV_BROKER", "the NexusKV HiCache backend needs the deployment's bus")
    if config.tier is Tier.HOST:
        backend: Any = HostMemoryBackend(settings.tier_host_bytes)
    elif config.tier is Tier.DISK:
        backend = DiskBackend(Path(settings.data_dir) / "tiers" / config.worker / "disk", settings.tier_disk_bytes)
    else:
        backend = RemoteBackend(settings.remote_tier)
    bus = BackgroundBus(settings.broker_url, client_id=f"nexuskv-hicache-{config.worker}",
                        secret=settings.identity_secret_bytes, max_memberships=settings.index_max_memberships,
                        checkpoint_dir=Path(settings.data_dir) / "index" / "nexuskv-index").start(
                            settings.broker_start_timeout_s)
    policy = PolicyFile(settings.policy_file).current if settings.policy_file else ExecutionPolicy(version="builtin")
    try:
        core = HiCacheCore(config.descriptor, worker=config.worker, catalog=BackendCatalog(config.worker, [backend]),
                           tier=config.tier, index=bus, publish=bus.publish, model=lambda: bus.model,
                           execution=lambda: policy, profile=config.profile, secret=settings.identity_secret_bytes,
                           layout=layout)
    except Exception:
        bus.stop()
        raise
    return core, bus


def _build_storage_class() -> type:
    try:
        storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError as exc:
        raise ImportError(f"NexusKVHiCacheStorage needs SGLang (0.5.10-0.5.23) installed: {exc}") from None
    HiCacheStorage = storage.HiCacheStorage

    class NexusKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc, valid-type]
        """NexusKV as SGLang's HiCache L3 storage (see :mod:`connectors.sglang.hicache`)."""

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            from nexuskv.config import Settings

            settings = Settings.from_env()
            self._config = HiCacheConfig.parse(
                getattr(storage_config, "extra_config", None), model_name=getattr(storage_config, "model_name", None),
                tp_rank=getattr(storage_config, "tp_rank", 0) or 0, tp_size=getattr(storage_config, "tp_size", 1) or 1,
                page_size=getattr(storage_config, "logical_page_size", None),
                remote_configured=bool(settings.remote_tier))
            self._settings = settings
            self._core, self._bus = build_core(self._config, settings)

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            parent = getattr(super(), "register_mem_pool_host", None)
            if parent is not None:
                parent(mem_pool_host)
            dummy = getattr(mem_pool_host, "get_dummy_flat_data_page", None)
            if dummy is not None:  # a page's dtype and shape, for get() without a target
                page = dummy()
                self._core.use_layout(page.dtype, page.shape)

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            return self._core.get(key, target_location if hasattr(target_location, "view") else None)

        def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
            targets = target_locations if target_locations is not None else [None] * len(keys)
            return [self.get(k, t) for k, t in zip(keys, targets)]

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            return value is not None and self._core.set(key, value)

        def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            if values is None:
                return False
            return all([self._core.set(k, v) for k, v in zip(keys, values)])

        def exists(self, key: str) -> bool:
            return self._core.exists(key)

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            return self._core.batch_exists(keys)

        def clear(self) -> None:
            self._core.clear()

        def close(self) -> None:
            self._bus.stop()

    NexusKVHiCacheStorage.__module__ = __name__
    return NexusKVHiCacheStorage


__getattr__ = lazy_attribute(globals(), "NexusKVHiCacheStorage", _build_storage_class)
