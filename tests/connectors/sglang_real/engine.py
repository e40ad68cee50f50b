"""SGLang 0.5.23's own objects on CPU, for the tests of this folder.

Everything here is SGLang's code: its device KV pools and allocator, its host pools (built with
``pin_memory=False``: there is no CUDA to pin for, the only change from how SGLang builds them),
``HostPoolGroup``/``build_pool_entry`` as its assembler builds them, its ``HybridCacheController``
(the controller of 0.5.18+'s unified radix cache) and ``HiCacheController`` (the batching
controller of the older HiRadixCache and of 0.5.23's decode offload), its
``StorageBackendFactory`` (which the controllers call), and the "scheduler" steps a test plays
itself: allocating host memory for a storage hit and handing the operation to SGLang's I/O
thread, exactly as ``UnifiedRadixCache`` does between ``prefetch_hit_queue`` and
``prefetch_buffer``. SGLang is imported inside the functions: the conftest fails these tests with
the install command when it is missing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PUBLISHER_VERSIONS = ("0.5.10.post1", "0.5.15", "0.5.18", "0.5.20", "0.5.22")


@contextlib.contextmanager
def rank(tp_rank: int = 0, tp_size: int = 1) -> Iterator[None]:
    """SGLang's parallel context of one TP rank (what its launcher publishes), for building a controller."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        yield


@dataclass
class Pools:
    device: Any
    allocator: Any
    host: Any
    extra: dict[str, Any] = field(default_factory=dict)  # pool name -> (host pool, device pool)

    @property
    def page_size(self) -> int:
        return self.host.page_size


def mha_pools(*, layers: int, heads: int, head_dim: int, page: int, tokens: int, dtype=torch.bfloat16,
              layout: str = "layer_first", host_ratio: float = 2.0) -> Pools:
    """An MHA/GQA device pool, its paged allocator and SGLang's host pool for it."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    device = MHATokenToKVPool(size=tokens, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim,
                              layer_num=layers, device="cpu", enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=tokens, page_size=page, dtype=dtype, device="cpu", kvcache=device,
                                            need_sort=False)
    cls, info, kwargs = _mha_host_inputs(device)
    host = cls(info, host_ratio, 0, page, layout, pin_memory=False, device="cpu", **kwargs)
    return Pools(device, allocator, host)


def mla_pools(*, layers: int, kv_lora_rank: int, rope_dim: int, page: int, tokens: int, dtype=torch.bfloat16,
              layout: str = "layer_first", host_ratio: float = 2.0) -> Pools:
    """An MLA device pool, its allocator and SGLang's MLA host pool."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(size=tokens, page_size=page, dtype=dtype, kv_lora_rank=kv_lora_rank,
                              qk_rope_head_dim=rope_dim, layer_num=layers, device="cpu", enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=tokens, page_size=page, dtype=dtype, device="cpu", kvcache=device,
                                            need_sort=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MLATokenToKVPoolHost(info, host_ratio, 0, page, layout, pin_memory=False, device="cpu",
                                override_kv_cache_dim=device.kv_cache_dim, device_capacity_tokens=device.size,
                                start_layer=device.start_layer, end_layer=device.end_layer,
                                target_layer_num=device.layer_num)
    return Pools(device, allocator, host)


def add_swa_pool(pools: Pools, *, layers: int) -> None:
    """A sliding-window pool beside the KV pool: another MHA host pool, as SGLang's hybrid SWA stack builds one."""
    side = mha_pools(layers=layers, heads=pools.device.head_num, head_dim=pools.device.head_dim,
                     page=pools.page_size, tokens=pools.device.size, dtype=pools.device.dtype)
    pools.extra["swa"] = (side.host, side.device)


def group_of(pools: Pools) -> Any:
    """SGLang's HostPoolGroup of the pools: the KV anchor, then any side pools."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.pool_host import HostPoolGroup

    layers = pools.device.layer_num
    entries = [build_pool_entry(name=PoolName.KV, host_pool=pools.host, device_pool=pools.device,
                                layer_mapping={i: i for i in range(layers)}, transfer_layer_id_max=layers,
                                is_anchor=True)]
    for name, (host, device) in pools.extra.items():
        entries.append(build_pool_entry(name=PoolName(name), host_pool=host, device_pool=device,
                                        layer_mapping={i: i for i in range(device.layer_num)},
                                        transfer_layer_id_max=layers))
    return HostPoolGroup(entries)


def hybrid_controller(pools: Pools, extra_config: dict[str, Any], *, model_name: str | None = None,
                      backend: str = "dynamic", tp_rank: int = 0, tp_size: int = 1) -> Any:
    """SGLang's HybridCacheController with a storage backend from its factory (as UnifiedRadixCache builds it)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    with rank(tp_rank, tp_size):
        return HybridCacheController(pools.allocator, group_of(pools), pools.page_size, None, threading.Event(),
                                     io_backend="direct", storage_backend=backend,
                                     storage_backend_extra_config=dict(extra_config), model_name=model_name)


def batching_controller(pools: Pools, extra_config: dict[str, Any], *, model_name: str | None = None,
                        tp_rank: int = 0, tp_size: int = 1) -> Any:
    """SGLang's HiCacheController: asks the backend in batches of STORAGE_BATCH_SIZE pages."""
    from sglang.srt.managers.cache_controller import HiCacheController

    with rank(tp_rank, tp_size):
        return HiCacheController(pools.allocator, pools.host, pools.page_size, None, threading.Event(),
                                 io_backend="direct", storage_backend="dynamic",
                                 storage_backend_extra_config=dict(extra_config), model_name=model_name)


def readme_extra_config(readme_json: str, *, file_storage_path: str | None = None) -> dict[str, Any]:
    """The extra config SGLang's server hands the backend for ``--hicache-storage-backend-extra-config``.

    SGLang's own parser pops its prefetch keys; ``--file-storage-path`` is then added the way
    ``UnifiedRadixCache.init_hicache`` adds it (``setdefault``).
    """
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(readme_json)
    if file_storage_path is not None:
        extra = dict(extra)
        extra.setdefault("file_storage_path", file_storage_path)
    return extra


def page_hashes(tokens: Sequence[int], page: int, prior: str | None = None) -> list[str]:
    """SGLang's storage page keys of a token chain (its own hash function)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(list(tokens), prior, page_size=page))


def fill_host(pool: Any, n_pages: int, *, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate ``n_pages`` in a host pool and fill them with random pages; (host indices, the pages)."""
    indices = pool.alloc(n_pages * pool.page_size)
    assert indices is not None, "host pool too small for the test"
    g = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(n_pages):
        dummy = pool.get_dummy_flat_data_page()
        page = torch.randn(dummy.shape, generator=g).to(dummy.dtype)
        pool.set_from_flat_data_page(int(indices[i * pool.page_size]), page)
        pages.append(page)
    return indices, pages


def host_page(pool: Any, indices: torch.Tensor, i: int) -> torch.Tensor:
    return pool.get_data_page(int(indices[i * pool.page_size]), flat=True).clone()


def backup(controller: Any, indices: torch.Tensor, tokens: Sequence[int], hashes: list[str], *,
           extra_pools: list[Any] | None = None, timeout: float = 60.0) -> Any:
    """SGLang's write-through to storage: ``write_storage`` and its backup thread's acknowledgement."""
    kwargs = {"extra_pools": extra_pools} if extra_pools is not None else {}
    controller.write_storage(indices, list(tokens), hash_value=hashes, **kwargs)
    return controller.ack_backup_queue.get(timeout=timeout)


def prefetch(controller: Any, tokens: Sequence[int], *, rid: str, last_hash: str | None = None,
             prefix_keys: list[str] | None = None, pool_transfers: list[Any] | None = None,
             load: bool = True, timeout: float = 60.0) -> tuple[Any, torch.Tensor | None]:
    """One storage prefetch the way SGLang's scheduler drives it.

    SGLang's prefetch thread asks the backend (``batch_exists``/``batch_exists_v2``); the test then
    plays the tree cache: allocate host memory for the hit and give the operation to SGLang's
    I/O thread, which reads the pages (``batch_get``, ``batch_get_v1`` or ``batch_get_v2``); its
    acknowledgements are drained until the request completes. Returns the operation (its
    ``storage_hit_count``, ``completed_tokens``) and the host indices the pages were read into.
    """
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    if isinstance(controller, HybridCacheController):
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        controller.prefetch(CacheRequestHandle(rid, 0), list(tokens), last_hash, prefix_keys,
                            extra_pools=pool_transfers)
    else:
        assert isinstance(controller, HiCacheController)
        controller.prefetch(rid, list(tokens), last_hash, prefix_keys)
    op = controller.prefetch_hit_queue.get(timeout=timeout)
    if not load or op.storage_hit_count == 0:
        return op, None
    host = controller.storage_host_pool
    op.host_indices = host.alloc(op.storage_hit_count)
    assert op.host_indices is not None
    for transfer in getattr(op, "pool_transfers", None) or []:
        if transfer.indices_from_pool is None and transfer.keys:
            side = controller.mem_pool_host.entry_map[transfer.name].host_pool
            transfer.host_indices = side.alloc(len(transfer.keys) * side.page_size)
    controller.prefetch_buffer.put(op)
    completed = None
    deadline = time.monotonic() + timeout
    while True:
        ack = controller.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.completed_req:
            break
    op.completed_tokens = completed if completed is not None else op.completed_tokens
    return op, op.host_indices


def stop(controller: Any) -> None:
    """Detach the storage backend the way SGLang's shutdown does (the backend's ``close``)."""
    controller.detach_storage_backend()
