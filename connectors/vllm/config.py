"""The connector's settings: ``kv_connector_extra_config`` plus what vLLM's own config says.

Parsed from plain values (the shell in :mod:`connectors.vllm.shell` reads them off vLLM's
``VllmConfig``), so this module imports no vLLM. Unknown keys are refused by name, like every
bad value (``ConfigError`` naming the field, at engine start).

**The descriptor** is the model's own: :func:`nexuskv.hf_config.descriptor_from_hf_config` of the
Hugging Face config vLLM loaded, with vLLM's block size, KV cache dtype, tensor-parallel size and
the block layout of its attention backend — the same function ``nexuskv descriptor`` runs on the
model folder's ``config.json`` for the event bridge, so both key blocks in one scope. It is then
checked against the KV cache vLLM really allocated (layers, KV heads, head size, dtype). A
``descriptor`` file overrides the derivation (for a state the function does not describe).

Keys of ``kv_connector_extra_config``:

* ``worker`` — this engine's name in NexusKV. Default: from the KV-events topic ``kv@<pod>@<model>``,
  ``vllm/<pod>/dp<rank>`` (what the bridge names the engine); its tiers publish as
  ``<worker>/disk`` and ``<worker>/remote``;
* ``tenant`` (``default``); ``model`` — the model's name in the identity scope (default: vLLM's
  ``--model``, as the bridge's ``nexuskv descriptor --model`` must then say); ``descriptor`` — a
  StateDescriptor JSON file instead of the derivation;
* ``save_tier`` — ``disk`` (default), ``remote`` or ``none``; ``load_async`` (false);
* ``profile`` — this worker's hardware profile in the cost model (default: the policy's default
  profile on a GPU, ``vllm-cpu`` on vLLM's CPU platform);
* ``decide_wait_ms`` — how long a request may wait for a lagging index before the planner
  decides with what it has (50);
* ``save_queue_mib`` — host memory for blocks copied out of the paged KV and not yet written by
  the worker's writer thread (256); a save that does not fit is dropped and counted, never waited for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from connectors.descriptors import resolve_descriptor
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.errors import ConfigError
from nexuskv.hf_config import descriptor_from_hf_config, model_spec_from_hf_config
from nexuskv.profiles import ModelSpec

__all__ = ["CPU_PROFILE", "KvCacheShape", "ConnectorConfig"]

CPU_PROFILE = "vllm-cpu"
_KEYS = frozenset({"worker", "tenant", "model", "descriptor", "save_tier", "load_async", "profile", "decide_wait_ms",
                   "save_queue_mib"})
_SAVE_TIERS = {"disk": Tier.DISK, "remote": Tier.REMOTE, "none": None}


@dataclass(frozen=True, slots=True)
class KvCacheShape:
    """What vLLM allocated for the (single) attention group: the descriptor must say the same."""

    layers: int
    kv_heads: int
    head_size: int
    dtype: str  # e.g. "bfloat16"
    block_size: int


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config`` and vLLM's own config."""

    worker: str
    descriptor: StateDescriptor
    model_spec: ModelSpec | None = None  # the model's FLOP shape, for the cold-start cost prior
    save_tier: Tier | None = Tier.DISK
    load_async: bool = False
    profile: str | None = None
    decide_wait_s: float = 0.05
    prefill_chunk_tokens: int = 2048
    save_queue_bytes: int = 256 << 20

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, model: str, block_size: int,
              hf_config: Mapping[str, Any] | None = None, kv_cache: KvCacheShape | None = None,
              kv_dtype: str | None = None, layout: str = "paged_nhd", model_revision: str | None = None,
              tokenizer_revision: str | None = None, tp_size: int = 1, kv_events_topic: str = "",
              data_parallel_rank: int = 0, default_profile: str | None = None,
              prefill_chunk_tokens: int = 2048) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}",
                              f"unknown key (known: {', '.join(sorted(_KEYS))})")
        worker = extra.get("worker") or _worker_from_topic(kv_events_topic, data_parallel_rank)
        if not worker:
            raise ConfigError("kv_connector_extra_config.worker", "give this engine's name, or a KV-events "
                                                                  "topic kv@<pod>@<model> to derive it from")
        tier_name = str(extra.get("save_tier", "disk")).lower()
        if tier_name not in _SAVE_TIERS:
            raise ConfigError("kv_connector_extra_config.save_tier", f"{tier_name!r} is not one of disk, remote, none")
        tenant = str(extra.get("tenant", "default"))
        name = str(extra.get("model") or model)
        if extra.get("descriptor"):
            descriptor = resolve_descriptor(descriptor_path=extra["descriptor"], tenant=tenant)
        elif hf_config is not None:
            descriptor = descriptor_from_hf_config(hf_config, model=name, block_size=block_size,
                                                   model_revision=model_revision, tokenizer_revision=tokenizer_revision,
                                                   tenant=tenant, engine_family="vllm", kv_dtype=kv_dtype,
                                                   layout=layout, tp_size=tp_size)
        else:
            descriptor = resolve_descriptor(model=name, tenant=tenant, block_size=block_size, engine_family="vllm")
        if descriptor.block_size != block_size:
            raise ConfigError("kv_connector_extra_config.descriptor",
                              f"block size {descriptor.block_size} is not vLLM's --block-size {block_size}")
        if kv_cache is not None:
            _check_against_cache(descriptor, kv_cache)
        wait_ms = extra.get("decide_wait_ms", 50)
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or wait_ms < 0:
            raise ConfigError("kv_connector_extra_config.decide_wait_ms", "a number of milliseconds >= 0")
        load_async = extra.get("load_async", False)
        if not isinstance(load_async, bool):
            raise ConfigError("kv_connector_extra_config.load_async", "true or false")
        profile = extra.get("profile", default_profile)
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise ConfigError("kv_connector_extra_config.profile", "a hardware profile name")
        queue_mib = extra.get("save_queue_mib", 256)
        if isinstance(queue_mib, bool) or not isinstance(queue_mib, (int, float)) or queue_mib <= 0:
            raise ConfigError("kv_connector_extra_config.save_queue_mib", "a number of MiB > 0")
        spec = model_spec_from_hf_config(hf_config, model=descriptor.model) if hf_config is not None else None
        return cls(worker=str(worker), descriptor=descriptor, model_spec=spec, save_tier=_SAVE_TIERS[tier_name],
                   load_async=load_async, profile=profile, decide_wait_s=float(wait_ms) / 1000.0,
                   prefill_chunk_tokens=prefill_chunk_tokens, save_queue_bytes=int(queue_mib * (1 << 20)))


def _worker_from_topic(topic: str, dp_rank: int) -> str | None:
    if topic.startswith("kv@"):
        parts = topic.split("@", 2)
        if len(parts) == 3 and parts[1]:
            return f"vllm/{parts[1]}/dp{dp_rank}"
    return None


def _check_against_cache(d: StateDescriptor, kv: KvCacheShape) -> None:
    group = d.layer_groups[0]
    key = group.tensors[0]
    problems = []
    if len(d.layer_groups) != 1:
        problems.append(f"{len(d.layer_groups)} layer groups, vLLM one attention group")
    if len(group.layers) != kv.layers:
        problems.append(f"{len(group.layers)} layers, vLLM {kv.layers}")
    if len(key.shape) == 2 and tuple(key.shape) != (kv.kv_heads, kv.head_size):
        problems.append(f"KV heads x head size {tuple(key.shape)}, vLLM {(kv.kv_heads, kv.head_size)}")
    if key.dtype.value != kv.dtype:
        problems.append(f"dtype {key.dtype.value}, vLLM {kv.dtype}")
    if problems:
        raise ConfigError("kv_connector_extra_config.descriptor",
                          f"{d.descriptor_id} does not describe vLLM's KV cache: {'; '.join(problems)}")
