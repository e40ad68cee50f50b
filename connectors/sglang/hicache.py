"""``NexusKVHiCacheStorage``: an SGLang ``HiCacheStorage`` backed by NexusKV's data plane.

Plug it into SGLang (0.5.10 to 0.5.23, ``../shared/reference/engines.md`` §4.2) with::

    python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --page-size 64 \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"nexuskv",
          "module_path":"connectors.sglang.hicache","class_name":"NexusKVHiCacheStorage",
          "tier":"remote","tenant":"acme","model":"meta-llama/Llama-3.1-8B",
          "hicache_storage_pass_prefix_keys":true}'

with ``NEXUSKV_BROKER`` (and ``NEXUSKV_REMOTE_TIER`` for the shared remote tier, ``NEXUSKV_DATA_DIR``
for the disk tier) in SGLang's environment. SGLang constructs the class as
``cls(storage_config, kwargs)`` on every TP rank, with the same extra config, and then calls
``register_mem_pool_host`` with the rank's host pool: that is when the backend learns the page
size, dtype and layout of SGLang's pages, resolves the rank's descriptor and starts. It serves
SGLang's generic path (``batch_get`` into the pages it passes, ``batch_set`` of page tensors),
the ``interface_v1`` path (``batch_get_v1``/``batch_set_v1`` on host-pool indices) and the
hybrid models' ``*_v2`` calls (sliding-window, Mamba and indexer pools beside the KV pages), and
answers ``batch_exists`` for SGLang's prefetch check (gated by the planner,
:mod:`connectors.sglang.hicache_core`).

The logic is :class:`~connectors.sglang.hicache_core.HiCacheCore`; this module translates
SGLang's objects and wires the bus (:class:`~connectors.bus_thread.BackgroundBus`: the cost
model that gates ``batch_exists``, the producer of the backend's page facts) and the index: the
backend holds none, it asks the node's index sidecar (:class:`~connectors.index_client.IndexClient`,
within ``NEXUSKV_INDEX_ASK_BUDGET_MS``; no answer is a miss). Importing it does not import SGLang:
the subclass is built when SGLang first asks for ``NexusKVHiCacheStorage``. Facts travel through
the bus, so a page just written reads as absent until the sidecar's replica has applied its event
(a miss, never a wrong hit).

**Ranks.** Each TP rank is its own publisher, ``<worker>/tp<rank>`` (``dp<d>-`` and ``pp<p>-`` in
front under data-parallel attention and pipeline parallelism). A model whose KV is sharded over
TP ranks (MHA/GQA) gets one descriptor per rank (``tp_rank`` of ``tp_size``, the rank's KV heads),
so no rank reads another's shard, on any tier. An MLA model's KV is the same on every rank and
SGLang writes it from one (``is_storage_writer``): every rank keys it alike and reads the
writer's pages (the shared remote tier, or the writer's disk folder on the same host; the host
tier cannot be shared between processes and is refused). Context parallelism (``attn_cp_size``
or ``dcp_size`` > 1) splits every page over ranks and is refused.

**Pages.** A stored page is SGLang's flat host page, in the byte order of its host memory layout
(``--hicache-mem-layout``), so the descriptor's layout is set to ``sglang-<layout>`` and, for a
known model, its dtype to the host pool's; the page's bytes must match the descriptor (dtype,
heads per rank, head size, layers), or the backend refuses to start, naming the field.

Extra-config keys (unknown keys are refused by name): ``tier`` (``remote`` when
``NEXUSKV_REMOTE_TIER`` is set, else ``disk``; also ``host``), ``worker`` (the name of this SGLang
server; default ``sglang-hicache/<host>``), ``tenant``, ``model`` (default SGLang's model name),
``descriptor`` (a StateDescriptor JSON file of the model; its ``tp_size`` SGLang's, or 1 for MLA),
``page_size`` (optional: checked against SGLang's page size), ``profile`` (the hardware profile
in the cost model). Keys SGLang itself reads or adds are accepted and left to it:
``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ``file_storage_path``
(``--file-storage-path``), ``prefetch_threshold``, ``prefetch_timeout_base``,
``prefetch_timeout_per_ki_token``, ``hicache_storage_pass_prefix_keys`` (set it: SGLang then
passes the keys of the pages before a prefetch, which the gate prices as their context),
``tp_lcm_size``.
"""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from connectors.descriptors import resolve_descriptor
from connectors.lazy import lazy_attribute
from nexuskv.descriptor import DType, SemanticType, StateDescriptor, Tier
from nexuskv.errors import ConfigError
from nexuskv.models import known_model

__all__ = ["EngineShard", "HostPages", "HiCacheConfig", "check_extra_config", "build_core", "component_key",
           "NexusKVHiCacheStorage"]

_FIELD = "hicache_storage_backend_extra_config"
#: Keys SGLang reads or adds itself (0.5.10-0.5.23); accepted, never interpreted here.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
                         "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys", "tp_lcm_size"})
KEYS = frozenset({"tier", "worker", "tenant", "model", "descriptor", "page_size", "profile"})
_TIERS = {"host": Tier.HOST, "disk": Tier.DISK, "remote": Tier.REMOTE}
_DTYPES = {"float32": DType.FLOAT32, "bfloat16": DType.BFLOAT16, "float16": DType.FLOAT16,
           "float8_e4m3fn": DType.FLOAT8_E4M3, "float8_e4m3fnuz": DType.FLOAT8_E4M3,
           "float8_e5m2": DType.FLOAT8_E5M2, "float8_e5m2fnuz": DType.FLOAT8_E5M2, "int8": DType.INT8,
           "uint8": DType.UINT8}
_SHARDED_UNDER_REPLICATED = frozenset({"mamba"})  # pools SGLang keeps per TP rank even for an MLA model


@dataclass(frozen=True, slots=True)
class EngineShard:
    """Which rank of an SGLang server a backend instance serves (SGLang's ``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    replicated: bool = False  # SGLang's is_mla_model: the KV is the same on every TP rank
    writer_rank: int = 0  # the TP rank that stores replicated KV
    cp_size: int = 1  # attention context parallelism (attn_cp_size, dcp_size): pages split over ranks
    model_name: str | None = None

    @classmethod
    def of(cls, storage_config: Any) -> EngineShard:
        """The shard of an SGLang ``HiCacheStorageConfig`` (fields of every version 0.5.10-0.5.23)."""
        def field(name: str, default: Any) -> Any:
            value = getattr(storage_config, name, default)
            return default if value is None else value

        dcp_size, dcp_rank = int(field("dcp_size", 1)), int(field("dcp_rank", 0))
        return cls(tp_rank=int(field("tp_rank", 0)), tp_size=int(field("tp_size", 1)),
                   pp_rank=int(field("pp_rank", 0)), pp_size=int(field("pp_size", 1)),
                   dp_rank=int(field("dp_rank", 0)), replicated=bool(field("is_mla_model", False)),
                   writer_rank=dcp_rank if dcp_size > 1 else 0,
                   cp_size=max(int(field("attn_cp_size", 1)), dcp_size), model_name=field("model_name", None))

    @property
    def writer(self) -> bool:
        return not self.replicated or self.tp_rank == self.writer_rank

    def rank_name(self, tp_rank: int | None = None) -> str:
        """``tp<r>``, with ``pp<p>-`` and ``dp<d>-`` in front where there is more than one."""
        name = f"tp{self.tp_rank if tp_rank is None else tp_rank}"
        if self.pp_size > 1:
            name = f"pp{self.pp_rank}-{name}"
        if self.dp_rank:
            name = f"dp{self.dp_rank}-{name}"
        return name


@dataclass(frozen=True, slots=True)
class HostPages:
    """The pages of SGLang's host pool (its anchor KV pool): what a stored page holds."""

    page_size: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    page_bytes: int
    layout: str  # --hicache-mem-layout: layer_first, page_first, page_first_direct, page_head, ...
    pages: int  # pages the host pool holds

    @classmethod
    def of(cls, host_pool: Any) -> HostPages:
        dummy = host_pool.get_dummy_flat_data_page()
        return cls(page_size=int(host_pool.page_size), dtype=str(dummy.dtype).removeprefix("torch."),
                   page_bytes=dummy.numel() * dummy.element_size(), layout=str(getattr(host_pool, "layout", "")),
                   pages=int(host_pool.size) // int(host_pool.page_size))


def check_extra_config(extra: Mapping[str, Any] | None, *, remote_configured: bool = False) -> Tier:
    """Validate the keys SGLang passes before it has a host pool; the backend's tier."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - KEYS - SGLANG_KEYS)
    if unknown:
        raise ConfigError(f"{_FIELD}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(KEYS))}; and SGLang's "
                                                    f"{', '.join(sorted(SGLANG_KEYS))})")
    tier_name = str(extra.get("tier", "remote" if remote_configured else "disk")).lower()
    if tier_name not in _TIERS:
        raise ConfigError(f"{_FIELD}.tier", f"{tier_name!r} is not one of host, disk, remote")
    if _TIERS[tier_name] is Tier.REMOTE and not remote_configured:
        raise ConfigError("NEXUSKV_REMOTE_TIER", "tier 'remote' needs the remote tier's address")
    size = extra.get("page_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"{_FIELD}.page_size", "SGLang's --page-size, a positive int (or leave it out)")
    return _TIERS[tier_name]


def _revise(d: StateDescriptor, *, dtype: DType | None = None, layout: str | None = None,
            tp_rank: int | None = None, pp_stage: int | None = None) -> StateDescriptor:
    data = d.model_dump()
    data["descriptor_id"] = ""
    if dtype is not None:
        for group in data["layer_groups"]:
            for tensor in group["tensors"]:
                tensor["dtype"] = dtype
    if layout is not None:
        data["layout"]["layout"] = layout
    if tp_rank is not None:
        data["parallel"]["tp_rank"] = tp_rank
    if pp_stage is not None:
        data["parallel"]["pp_stage"] = pp_stage
    return StateDescriptor.model_validate(data)


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    worker: str  # this rank's publisher
    descriptor: StateDescriptor
    tier: Tier
    owner: str  # whose pages of replicated state this rank reads (itself unless MLA and not the writer)
    shard: EngineShard = EngineShard()
    profile: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, pages: HostPages, shard: EngineShard = EngineShard(),
              model_name: str | None = None, remote_configured: bool = False,
              host: str | None = None) -> HiCacheConfig:
        tier = check_extra_config(extra, remote_configured=remote_configured)
        extra = dict(extra or {})
        if shard.cp_size > 1:
            raise ConfigError(f"{_FIELD}.backend_name", "context parallelism splits every page over ranks; the "
                                                        "NexusKV backend does not store split pages")
        size = pages.page_size
        if extra.get("page_size") is not None and extra["page_size"] != size:
            raise ConfigError(f"{_FIELD}.page_size", f"{extra['page_size']} is not SGLang's page size {size}")
        if shard.replicated and shard.tp_size > 1 and tier is Tier.HOST:
            raise ConfigError(f"{_FIELD}.tier", "an MLA model's pages are written by one TP rank and read by all; "
                                                "the host tier is one process's memory: use disk or remote")
        tenant = str(extra.get("tenant", "default"))
        descriptor = cls._descriptor(extra, shard, size, model_name or shard.model_name, tenant, pages)
        base = str(extra.get("worker") or f"sglang-hicache/{host or socket.gethostname()}")
        worker = f"{base}/{shard.rank_name()}"
        owner = f"{base}/{shard.rank_name(shard.writer_rank)}" if shard.replicated else worker
        return cls(worker=worker, descriptor=descriptor, tier=tier, owner=owner, shard=shard,
                   profile=extra.get("profile"))

    @staticmethod
    def _descriptor(extra: dict[str, Any], shard: EngineShard, size: int, model_name: str | None, tenant: str,
                    pages: HostPages) -> StateDescriptor:
        path = extra.get("descriptor")
        dtype = _DTYPES.get(pages.dtype)
        if path:
            where = f"{_FIELD}.descriptor"
            d = resolve_descriptor(descriptor_path=path, tenant=tenant)
            if d.block_size != size:
                raise ConfigError(where, f"block size {d.block_size} is not SGLang's page size {size}")
            want_tp = 1 if shard.replicated else shard.tp_size
            if d.parallel.tp_size != want_tp:
                raise ConfigError(where, f"tp_size {d.parallel.tp_size}: SGLang runs TP={shard.tp_size}"
                                         + (" with replicated MLA state (give tp_size 1)" if shard.replicated
                                            else f"; give the descriptor of one rank of {shard.tp_size}"))
            if d.parallel.pp_size != shard.pp_size:
                raise ConfigError(where, f"pp_size {d.parallel.pp_size}: SGLang runs PP={shard.pp_size}")
            d = _revise(d, tp_rank=0 if shard.replicated else shard.tp_rank, pp_stage=shard.pp_rank)
        else:
            where = f"{_FIELD}.model"
            model = extra.get("model", model_name)
            d = resolve_descriptor(model=model, tenant=tenant, block_size=size, engine_family="sglang")
            is_mla = d.semantic_type is SemanticType.MLA
            if is_mla != shard.replicated:
                raise ConfigError(where, f"{model} is {'an MLA' if is_mla else 'a key/value attention'} model, "
                                         f"but SGLang's pool is {'MLA' if shard.replicated else 'key/value'}")
            if shard.pp_size > 1:
                raise ConfigError(where, "pipeline parallelism needs a descriptor file of the stage's layers")
            if shard.tp_size > 1 and not is_mla:
                d = known_model(model, tenant_namespace=tenant, engine_family="sglang", block_size=size,
                                tp_rank=shard.tp_rank, tp_size=shard.tp_size)
            if dtype is not None:
                d = _revise(d, dtype=dtype)
        d = _revise(d, layout=f"sglang-{pages.layout or 'host'}")
        expected = d.layer_groups[0].bytes_per_token * size
        if expected != pages.page_bytes:
            raise ConfigError(where, f"SGLang's host pages hold {pages.page_bytes} bytes ({pages.dtype}, {size} tokens), "
                                     f"the descriptor {expected} (dtype, KV heads per rank, head size, layers)")
        return d


def component_key(key: str, pool: str, shard: EngineShard) -> str:
    """The storage key of a page of SGLang's host pool ``pool`` (the KV pool's is the page key)."""
    if pool == "kv":
        return key
    if pool in _SHARDED_UNDER_REPLICATED and shard.replicated and shard.tp_size > 1:
        return f"{key}.{pool}.tp{shard.tp_rank}"
    return f"{key}.{pool}"


def build_core(config: HiCacheConfig, settings: Any, *, layout: Any = None) -> tuple[Any, Any]:
    """The backend's core and the bus it runs on (started); stop the bus when done."""
    from connectors.bus_thread import BackgroundBus
    from connectors.index_client import client_from_settings
    from connectors.sglang.hicache_core import FolderSource, HiCacheCore, folder_of
    from nexuskv.dataplane.catalog import BackendCatalog
    from nexuskv.dataplane.disk import DiskBackend
    from nexuskv.dataplane.memory import HostMemoryBackend
    from nexuskv.dataplane.remote import RemoteBackend
    from nexuskv.policy import ExecutionPolicy
    from streams.bus.policy_file import PolicyFile

    if settings.broker_url is None:
        raise ConfigError("NEXUSKV_BROKER", "the NexusKV HiCache backend needs the deployment's bus")
    owner_source = None
    if config.tier is Tier.HOST:
        backend: Any = HostMemoryBackend(settings.tier_host_bytes)
    elif config.tier is Tier.DISK:
        backend = DiskBackend(folder_of(settings.data_dir, config.worker), settings.tier_disk_bytes)
        if config.owner != config.worker:
            owner_source = FolderSource(folder_of(settings.data_dir, config.owner))
    else:
        backend = RemoteBackend(settings.remote_tier)
    index = client_from_settings(settings, name=f"nexuskv-hicache-{config.worker}")
    bus = BackgroundBus(settings.broker_url, client_id=f"nexuskv-hicache-{config.worker}", index=index).start(
        settings.broker_start_timeout_s)
    policy = PolicyFile(settings.policy_file).current if settings.policy_file else ExecutionPolicy(version="builtin")
    try:
        core = HiCacheCore(config.descriptor, worker=config.worker, catalog=BackendCatalog(config.worker, [backend]),
                           tier=config.tier, index=index, publish=bus.publish, model=lambda: bus.model,
                           execution=lambda: policy, profile=config.profile, secret=settings.identity_secret_bytes,
                           layout=layout, owner=config.owner, owner_source=owner_source)
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
    PoolTransferResult = getattr(storage, "PoolTransferResult", None)
    from connectors.sglang import hicache_core

    hicache_core.STORAGE_BATCH_SIZE = getattr(storage, "STORAGE_BATCH_SIZE", hicache_core.STORAGE_BATCH_SIZE)

    class NexusKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc, valid-type]
        """NexusKV as SGLang's HiCache L3 storage (see :mod:`connectors.sglang.hicache`)."""

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            from nexuskv.config import Settings

            self._settings = Settings.from_env()
            self._extra = dict(getattr(storage_config, "extra_config", None) or {})
            check_extra_config(self._extra, remote_configured=bool(self._settings.remote_tier))
            self._shard = EngineShard.of(storage_config)
            self._core: Any = None
            self._bus: Any = None
            self._v2 = False  # SGLang's hybrid controller registers its pools: it asks for whole spans
            self._staging = threading.local()

        # -- registration ---------------------------------------------------------------------

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            if self._core is not None:
                return
            pages = HostPages.of(mem_pool_host)
            self.config = HiCacheConfig.parse(self._extra, pages=pages, shard=self._shard,
                                              remote_configured=bool(self._settings.remote_tier))
            dummy = mem_pool_host.get_dummy_flat_data_page()
            self._core, self._bus = build_core(self.config, self._settings, layout=(dummy.dtype, tuple(dummy.shape)))
            self._core.use_host_pool(pages.pages // 2)  # SGLang lets one prefetch hold half its host pool

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            self._v2 = True

        @property
        def core(self) -> Any:
            if self._core is None:
                raise ConfigError(_FIELD, "SGLang has not registered its host pool with the backend yet")
            return self._core

        # -- generic path ---------------------------------------------------------------------

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            return self.core.get(key, target_location if hasattr(target_location, "view") else None)

        def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
            targets = target_locations if target_locations is not None else [None] * len(keys)
            return self.core.get_many(keys, [t if hasattr(t, "view") else None for t in targets])

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            return value is not None and self.core.set(key, value)

        def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            if values is None:
                return False
            return all(self.core.set_many(list(zip(keys, values))))

        def exists(self, key: str) -> bool:
            return self.core.exists(key)

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
            return self.core.batch_exists(keys, prefix=prefix, batched=not self._v2)

        # -- interface_v1: host-pool indices ----------------------------------------------------

        def _staging_page(self, pool: Any) -> Any:
            page = getattr(self._staging, "page", None)
            if page is None or getattr(self._staging, "pool", None) is not pool:
                page = self._staging.page = pool.get_dummy_flat_data_page()
                self._staging.pool = pool
            return page

        def _read_page(self, pool: Any, key: str, located: tuple[int, Any], index: int) -> bool:
            """Read ``key`` (where :meth:`HiCacheCore.locate` found it) into ``pool``'s page at ``index``:
            straight in when that page is contiguous."""
            view = pool.get_data_page(index, flat=False)
            if view.is_contiguous():
                return self.core.read(key, *located, view) is not None
            staging = self._staging_page(pool)
            if self.core.read(key, *located, staging) is None:
                return False
            pool.set_from_flat_data_page(index, staging)
            return True

        def _read_pages(self, pool: Any, keys: list[str], host_indices: Any) -> list[bool]:
            """Pages into ``pool`` up to the first miss (SGLang recomputes from there): promised pages
            from their promise, the rest located with one ask."""
            size = getattr(pool, "page_size", 1) or 1
            out: list[bool] = []
            for i, (key, located) in enumerate(zip(keys, self.core.locate(keys))):
                if not self._read_page(pool, key, located, int(host_indices[i * size])):
                    return out + [False] * (len(keys) - i)
                out.append(True)
            return out

        def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            return self._read_pages(self.mem_pool_host, keys, host_indices)

        def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            pool, size = self.mem_pool_host, self.mem_pool_host.page_size
            return self.core.set_many([(key, pool.get_data_page(int(host_indices[i * size]), flat=True))
                                       for i, key in enumerate(keys)])

        # -- hybrid models: the v2 pool calls ---------------------------------------------------

        def _pool(self, name: Any) -> Any:
            pools = getattr(self, "registered_pools", {})
            return pools.get(name, pools.get(str(name)))

        def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
            core = self.core
            prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
            transfers = list(pool_transfers or [])
            # One ask for the KV pages and every pool's pages of them.
            sides = [[component_key(k, str(t.name), self._shard) for k in keys] for t in transfers]
            canonicals, holders, _ = core.readable_run([*keys, *(k for side in sides for k in side)])
            n = len(keys)
            kv = next((i for i, h in enumerate(holders[:n]) if h is None), n)
            side_holders = [holders[n * (j + 1):n * (j + 2)] for j in range(len(transfers))]
            hits: dict[Any, int] = {"kv": kv} if kv else {}
            restorable = set(range(1, kv + 1))
            for j, transfer in enumerate(transfers):
                if not restorable:
                    break
                policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
                present = [h is not None for h in side_holders[j][:kv]]
                if policy == "all_pages":
                    boundary = next((i for i, ok in enumerate(present) if not ok), kv)
                    pool_ok = set(range(1, boundary + 1))
                elif policy == "trailing_pages":
                    trailing = max(1, len(transfer.keys or ()))
                    pool_ok = {p for p in range(1, kv + 1) if all(present[max(0, p - trailing):p])}
                    boundary = max(pool_ok, default=0)
                elif policy == "block_groups":  # a second form of the KV pages: a verdict of its own, no gate
                    group = max(1, int(getattr(transfer, "group_pages", 0) or 1))
                    whole = 0
                    while (whole + 1) * group <= kv and all(present[whole * group:(whole + 1) * group]):
                        whole += 1
                    if whole:
                        hits[transfer.name] = whole * group
                    continue
                else:
                    raise ConfigError(f"{_FIELD}.backend_name", f"SGLang asked for pool hit policy {policy!r}, "
                                                                "which this backend does not know")
                if boundary:
                    hits[transfer.name] = boundary
                restorable &= pool_ok
            final = max(restorable, default=0)
            if final and core.gate(canonicals[:final], holders[:final],
                                   context=[core.canonical(k) for k in prefix or ()]) < final:
                final, hits, restorable = 0, {}, set()
            if final:  # SGLang reads these from this answer: the KV pages and their pools' pages
                core.promise(canonicals[:final], holders[:final])
                for j in range(len(transfers)):
                    side = slice(n * (j + 1), n * (j + 1) + max(final, hits.get(transfers[j].name, 0)))
                    core.promise(canonicals[side], holders[side])
            return PoolTransferResult(final, hits, sorted(p for p in restorable if p <= final))

        def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
            out: dict[Any, list[bool]] = {}
            for transfer in transfers:
                keys = list(transfer.keys or [])
                pool = self._pool(transfer.name)
                size = getattr(pool, "page_size", 1) or 1
                indices = transfer.host_indices
                if pool is None or indices is None or indices.numel() != len(keys) * size:
                    out[transfer.name] = [False] * len(keys)
                    continue
                out[transfer.name] = self._read_pages(
                    pool, [component_key(key, str(transfer.name), self._shard) for key in keys], indices)
            return out

        def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
            out: dict[Any, list[bool]] = {}
            for transfer in transfers:
                keys = list(transfer.keys or [])
                pool = self._pool(transfer.name)
                size = getattr(pool, "page_size", 1) or 1
                indices = transfer.host_indices
                if pool is None or indices is None or indices.numel() != len(keys) * size:
                    out[transfer.name] = [False] * len(keys)
                    continue
                out[transfer.name] = self.core.set_many(
                    [(component_key(key, str(transfer.name), self._shard),
                      pool.get_data_page(int(indices[i * size]), flat=True)) for i, key in enumerate(keys)])
            return out

        # -- lifecycle ------------------------------------------------------------------------

        def clear(self) -> None:
            self.core.clear()

        def close(self) -> None:
            if self._core is not None:  # its tier manager, and with it the tier folder's lock
                self._core.close()
            if self._bus is not None:
                self._bus.stop()

    NexusKVHiCacheStorage.__module__ = __name__
    return NexusKVHiCacheStorage


__getattr__ = lazy_attribute(globals(), "NexusKVHiCacheStorage", _build_storage_class)
