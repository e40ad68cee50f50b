"""vLLM's classes around the connector's logic: ``KVConnectorBase_V1`` and its metadata, at module level.

Imported only where vLLM is installed (vLLM's factory loads ``connectors.vllm.connector``, whose
``NexusKVConnector`` attribute is this module's class). Everything is defined at module level
because vLLM's multiprocess engine pickles the step metadata from the engine-core process to its
workers, and the worker metadata back: ``NexusKVConnectorMetadata`` and ``NexusKVWorkerMetadata``
unpickle in any process by their module path (a class built inside a function did not: vLLM died
on its first request with ``Can't pickle local object``).

This module only translates: vLLM's ``VllmConfig`` into :class:`~connectors.vllm.config.ConnectorConfig`
(the model's own Hugging Face config, vLLM's block size, KV cache dtype and shape, the block
layout of its platform), vLLM's ``Request`` and ``SchedulerOutput`` into the plain values of
:mod:`connectors.vllm.scheduler_side`, and the worker's calls into :mod:`connectors.vllm.worker_side`.
Written against vLLM 0.32's connector API (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.vllm.config import CPU_PROFILE, ConnectorConfig, KvCacheShape
from connectors.vllm.meta import ConnectorMeta, WorkerReport
from connectors.vllm.scheduler_side import Scheduled
from connectors.vllm.tracing import RequestTraces
from connectors.vllm.worker_side import block_dims
from nexuskv.descriptor import Tier
from nexuskv.errors import ConfigError

__all__ = ["NexusKVConnector", "NexusKVConnectorMetadata", "NexusKVWorkerMetadata", "config_of", "plain"]

log = logging.getLogger("nexuskv.vllm")

_HIT_SOURCE = {Tier.DISK: CacheHitSource.DISK, Tier.HOST: CacheHitSource.HOST}


class NexusKVConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`~connectors.vllm.meta.ConnectorMeta`, scheduler to worker."""

    def __init__(self, meta: ConnectorMeta) -> None:
        self.meta = meta


class NexusKVWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's :class:`~connectors.vllm.meta.WorkerReport`, worker to scheduler."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, NexusKVWorkerMetadata):
            return self
        return NexusKVWorkerMetadata(self.report.merged(other.report))


def plain(request: Any) -> bool:
    """A request whose blocks vLLM hashes without extra keys (no LoRA, multimodal input, salt or embeddings)."""
    return (getattr(request, "lora_request", None) is None and not getattr(request, "mm_features", None)
            and getattr(request, "cache_salt", None) is None and getattr(request, "prompt_embeds", None) is None)


def _kv_cache_shape(kv_cache_config: Any, block_size: int) -> KvCacheShape | None:
    if kv_cache_config is None:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) != 1:
        raise ConfigError("kv_cache_config", f"{len(groups)} KV cache groups (a hybrid model): the NexusKV connector "
                                             "moves one group of full-attention blocks")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        raise ConfigError("kv_cache_config", f"KV cache spec {type(spec).__name__}: the NexusKV connector moves "
                                             "full-attention blocks only")
    return KvCacheShape(layers=len(groups[0].layer_names), kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                        dtype=str(spec.dtype).removeprefix("torch."), block_size=spec.block_size or block_size)


def config_of(vllm_config: Any, kv_cache_config: Any = None) -> ConnectorConfig:
    """The connector's settings from vLLM's config (and the KV cache vLLM allocated)."""
    from vllm.platforms import current_platform

    transfer = vllm_config.kv_transfer_config
    events = vllm_config.kv_events_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    if parallel.tensor_parallel_size != 1:
        raise ConfigError("tensor_parallel_size", "the NexusKV connector supports TP=1 per engine")
    cpu = current_platform.is_cpu()
    shape = _kv_cache_shape(kv_cache_config, cache.block_size)
    kv_dtype = shape.dtype if shape is not None else (None if cache.cache_dtype == "auto" else cache.cache_dtype)
    return ConnectorConfig.parse(
        transfer.kv_connector_extra_config, model=model.model, block_size=cache.block_size,
        hf_config=model.hf_text_config.to_dict(), kv_cache=shape, kv_dtype=kv_dtype,
        layout="paged_hn_kvd" if cpu else "paged_nhd", model_revision=model.revision,
        tokenizer_revision=model.tokenizer_revision, tp_size=1,
        kv_events_topic=(events.topic if events is not None else "") or "",
        data_parallel_rank=parallel.data_parallel_rank or 0, default_profile=CPU_PROFILE if cpu else None,
        prefill_chunk_tokens=vllm_config.scheduler_config.max_num_batched_tokens)


class NexusKVConnector(KVConnectorBase_V1):
    """NexusKV as a vLLM KV connector (see :mod:`connectors.vllm.connector`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from connectors.vllm.wiring import build_scheduler_side, build_worker_side

        self._config = config_of(vllm_config, kv_cache_config)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._scheduler = self._worker = self._bus = self._producer = None
        self._live: dict[str, Any] = {}
        self._traces = RequestTraces()  # each request's trace (vLLM's trace_headers), for the connector's spans
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler, self._bus = build_scheduler_side(self._config, traces=self._traces)
        else:
            # vLLM 0.32 calls wait_for_layer_load before every attention layer of a step with
            # connector metadata (vllm/model_executor/layers/attention/kv_transfer_utils.py).
            self._worker, self._producer = build_worker_side(self._config, layerwise=True)
        log.info("NexusKV connector (%s) for %s as %s: descriptor %s, save tier %s", role.name,
                 self._config.descriptor.model, self._config.worker, self._config.descriptor.descriptor_id,
                 self._config.save_tier.value if self._config.save_tier else "none")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that does not happen is a later miss

    # -- scheduler side --------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if plain(request):
            self._live[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not plain(request):
            return 0, False
        self._live.setdefault(request.request_id, request)
        self._traces.track(request.request_id, getattr(request, "trace_headers", None))
        self._scheduler.track(request.request_id, request.all_token_ids, request.num_prompt_tokens)
        return self._scheduler.num_new_matched_tokens(request.request_id, request.all_token_ids, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not plain(request):
            return
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._scheduler.update_state_after_alloc(request.request_id, list(ids), num_external_tokens)
        if num_external_tokens > 0:
            tier = self._scheduler.source_tier(request.request_id)
            self._traces.load_started(request.request_id, tier=tier.value if tier is not None else None,
                                      tokens=num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        tier = self._scheduler.source_tier(request.request_id)
        return {_HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED): num_external_tokens}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        state = scheduler_output.kv_connector_block_state
        scheduled = []
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._live.get(request_id)
            if request is None:
                continue
            ids = state.get_block_ids(request_id) if state is not None else None
            scheduled.append(Scheduled(request_id, request.num_computed_tokens, n, ids[0] if ids else None))
        return NexusKVConnectorMetadata(self._scheduler.build_meta(scheduled))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._live.pop(request.request_id, None)
        self._traces.forget(request.request_id)
        return self._scheduler.request_finished(request.request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, NexusKVWorkerMetadata) else None
        self._scheduler.update_connector_output(report, tuple(connector_output.finished_recving or ()))
        if report is not None:
            for request_id in report.loads_failed:
                self._traces.load_finished(request_id, ok=False)
            for request_id in report.loads_done:
                self._traces.load_finished(request_id, ok=True)

    def take_events(self) -> tuple:
        return ()  # the tiers' facts are published by their own publisher, not in the engine's events

    def reset_cache(self) -> bool:
        log.info("reset_cache: NexusKV's tiers outlive the engine's prefix cache and are not cleared by one engine")
        return False

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches, block_dims(kv_caches, self._num_blocks))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, NexusKVConnectorMetadata):
            self._worker.bind(connector_metadata.meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load(self._get_connector_metadata().meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # blocks are copied out whole, in one gather per layer, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata().meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker.take_report() if self._worker is not None else None
        return NexusKVWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()  # drains the save queue (bounded), counts what it could not write
        for client in (self._producer, self._bus):
            if client is not None:
                client.stop()
