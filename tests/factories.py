"""Small factories for test inputs (descriptors, scopes, batches)."""

from __future__ import annotations

from typing import Any

from nexuskv.contracts.kv_events import BlockRemoved, BlockStored, KvEventBatch, PublisherIdentity
from nexuskv.descriptor import StateDescriptor
from nexuskv.identity import IdentityScope
from nexuskv.models import gqa_descriptor, mla_descriptor


def descriptor(**overrides: Any) -> StateDescriptor:
    base = dict(model="test/llama-tiny", num_layers=4, num_kv_heads=2, head_dim=8, block_size=4)
    base.update(overrides)
    return gqa_descriptor(**base)


def mla(**overrides: Any) -> StateDescriptor:
    base = dict(model="test/mla-tiny", num_layers=2, kv_lora_rank=16, rope_head_dim=4, block_size=4)
    base.update(overrides)
    return mla_descriptor(**base)


def scope(tenant: str = "tenant-a", **overrides: Any) -> IdentityScope:
    d = descriptor()
    fields = dict(tenant_namespace=tenant, model=d.model, model_revision=d.model_revision,
                  tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id)
    fields.update(overrides)
    return IdentityScope(**fields)


def publisher_identity(d: StateDescriptor | None = None) -> PublisherIdentity:
    d = d or descriptor()
    return PublisherIdentity(tenant_namespace=d.tenant_namespace, model=d.model, model_revision=d.model_revision,
                             tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id)


def kv_batch(seq: int = 0, *, publisher: str = "vllm/pod-a/dp0", incarnation: int = 1) -> KvEventBatch:
    return KvEventBatch(
        publisher=publisher, incarnation=incarnation, seq=seq, ts=1_700_000_000.5,
        identity=publisher_identity(),
        events=(
            BlockStored(engine_hashes=(11, 12), parent=None, token_ids=tuple(range(8)), block_size=4),
            BlockStored(engine_hashes=(12,), block_size=4, tier="host"),
            BlockRemoved(engine_hashes=(11,)),
        ),
    )
