"""Descriptor builders for common attention shapes, and the models the cost profiles cover.

Shapes come from the models' published configs (``../shared/reference/anchors.md`` §3 derives
the same bytes per token): Llama-3.1-8B 128 KiB/token, Llama-3.1-70B 320 KiB, Qwen3-32B
256 KiB, DeepSeek-V3 (MLA) about 69 KiB, all in BF16.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from nexuskv.descriptor import (
    DType,
    Granularity,
    GranularityKind,
    LayerGroup,
    LayoutConvention,
    MaterializationCapabilities,
    ParallelScope,
    SemanticType,
    StateDescriptor,
    TensorRole,
    TensorSpec,
)

__all__ = ["gqa_descriptor", "mla_descriptor", "hybrid_descriptor", "KNOWN_MODELS", "known_model"]


def _kv_group(kv_group: int, semantic_type: SemanticType, layers: tuple[int, ...], block_size: int, heads: int,
              head_dim: int, dtype: DType) -> LayerGroup:
    """A key/value attention group: per token, K and V of ``heads`` heads of ``head_dim``."""
    return LayerGroup(
        kv_group=kv_group,
        semantic_type=semantic_type,
        layers=layers,
        granularity=Granularity(kind=GranularityKind.BLOCK, tokens=block_size),
        tensors=(
            TensorSpec(role=TensorRole.KEY, shape=(heads, head_dim), dtype=dtype),
            TensorSpec(role=TensorRole.VALUE, shape=(heads, head_dim), dtype=dtype),
        ),
    )


def gqa_descriptor(
    *,
    model: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tenant_namespace: str = "default",
    model_revision: str = "main",
    tokenizer_revision: str = "main",
    engine_family: str = "vllm",
    block_size: int = 16,
    dtype: DType = DType.BFLOAT16,
    rope_theta: float = 500000.0,
    tp_rank: int = 0,
    tp_size: int = 1,
    layout: str = "paged_nhd",
    semantic_type: SemanticType = SemanticType.GQA,
) -> StateDescriptor:
    """A key/value attention model (MHA, GQA or MQA by head count), sharded over TP ranks."""
    heads = max(1, num_kv_heads // tp_size)
    return StateDescriptor(
        tenant_namespace=tenant_namespace,
        model=model,
        model_revision=model_revision,
        tokenizer_revision=tokenizer_revision,
        engine_family=engine_family,
        semantic_type=semantic_type,
        parallel=ParallelScope(tp_rank=tp_rank, tp_size=tp_size),
        layer_groups=(_kv_group(0, semantic_type, tuple(range(num_layers)), block_size, heads, head_dim, dtype),),
        layout=LayoutConvention(layout=layout, position="rope_applied", rope_theta=rope_theta),
    )


def mla_descriptor(
    *,
    model: str,
    num_layers: int,
    kv_lora_rank: int,
    rope_head_dim: int,
    tenant_namespace: str = "default",
    model_revision: str = "main",
    tokenizer_revision: str = "main",
    engine_family: str = "vllm",
    block_size: int = 64,
    dtype: DType = DType.BFLOAT16,
    rope_theta: float = 10000.0,
    layout: str = "paged_latent",
) -> StateDescriptor:
    """A Multi-head Latent Attention model: per token a latent and a decoupled RoPE key."""
    return StateDescriptor(
        tenant_namespace=tenant_namespace,
        model=model,
        model_revision=model_revision,
        tokenizer_revision=tokenizer_revision,
        engine_family=engine_family,
        semantic_type=SemanticType.MLA,
        layer_groups=(
            LayerGroup(
                kv_group=0,
                semantic_type=SemanticType.MLA,
                layers=tuple(range(num_layers)),
                granularity=Granularity(kind=GranularityKind.BLOCK, tokens=block_size),
                tensors=(
                    TensorSpec(role=TensorRole.LATENT, shape=(kv_lora_rank,), dtype=dtype),
                    TensorSpec(role=TensorRole.ROPE_KEY, shape=(rope_head_dim,), dtype=dtype),
                ),
            ),
        ),
        layout=LayoutConvention(layout=layout, position="rope_deferred", rope_theta=rope_theta),
    )


def hybrid_descriptor(
    *,
    model: str,
    attention_layers: tuple[int, ...],
    recurrent_layers: tuple[int, ...],
    num_kv_heads: int,
    head_dim: int,
    recurrent_state_shape: tuple[int, ...],
    checkpoint_interval: int,
    conv_state_shape: tuple[int, ...] | None = None,
    tenant_namespace: str = "default",
    model_revision: str = "main",
    tokenizer_revision: str = "main",
    engine_family: str = "vllm",
    block_size: int = 16,
    dtype: DType = DType.BFLOAT16,
    rope_theta: float = 10000.0,
    layout: str = "paged_nhd",
) -> StateDescriptor:
    """A hybrid of GQA attention layers (KV group 0, pages of ``block_size`` tokens) and
    recurrent layers (KV group 1) whose state is a terminal checkpoint every
    ``checkpoint_interval`` tokens (recurrent state, plus the short-convolution state if any)."""
    recurrent = [TensorSpec(role=TensorRole.RECURRENT_STATE, shape=recurrent_state_shape, dtype=dtype)]
    if conv_state_shape is not None:
        recurrent.append(TensorSpec(role=TensorRole.CONV_STATE, shape=conv_state_shape, dtype=dtype))
    return StateDescriptor(
        tenant_namespace=tenant_namespace,
        model=model,
        model_revision=model_revision,
        tokenizer_revision=tokenizer_revision,
        engine_family=engine_family,
        semantic_type=SemanticType.HYBRID,
        layer_groups=(
            _kv_group(0, SemanticType.GQA, attention_layers, block_size, num_kv_heads, head_dim, dtype),
            LayerGroup(
                kv_group=1,
                semantic_type=SemanticType.RECURRENT,
                layers=recurrent_layers,
                granularity=Granularity(kind=GranularityKind.CHECKPOINT, tokens=checkpoint_interval),
                tensors=tuple(recurrent),
            ),
        ),
        # partial prefixes are legal only at checkpoint boundaries; the runtime enforces that
        materialization=MaterializationCapabilities(partial_prefix=True),
        layout=LayoutConvention(layout=layout, position="rope_applied", rope_theta=rope_theta),
    )


KNOWN_MODELS = {
    "meta-llama/Llama-3.1-8B": dict(kind="gqa", num_layers=32, num_kv_heads=8, head_dim=128),
    "meta-llama/Llama-3.1-70B": dict(kind="gqa", num_layers=80, num_kv_heads=8, head_dim=128),
    "Qwen/Qwen3-32B": dict(kind="gqa", num_layers=64, num_kv_heads=8, head_dim=128, rope_theta=1000000.0),
    "deepseek-ai/DeepSeek-V3": dict(kind="mla", num_layers=61, kv_lora_rank=512, rope_head_dim=64),
}


def known_model(name: str, **overrides: object) -> StateDescriptor:
    """Descriptor of one of :data:`KNOWN_MODELS` (keyword overrides: tenant, block size, ...)."""
    spec = dict(KNOWN_MODELS[name])
    kind = spec.pop("kind")
    spec.update(overrides)
    if kind == "mla":
        return mla_descriptor(model=name, **spec)  # type: ignore[arg-type]
    return gqa_descriptor(model=name, **spec)  # type: ignore[arg-type]


class DescriptorRegistry:
    """Descriptors a process can resolve by id: the known models, and any a request or a record carried
    (the most recent ``capacity`` of them). One registry for the planner, the tier manager and the
    router."""

    def __init__(self, descriptors: Iterable[StateDescriptor] = (), *, capacity: int = 4096) -> None:
        self._known: OrderedDict[str, StateDescriptor] = OrderedDict()
        self.capacity = capacity
        for d in descriptors:
            self.add(d)

    @classmethod
    def with_known_models(cls) -> DescriptorRegistry:
        return cls(known_model(name) for name in KNOWN_MODELS)

    def add(self, descriptor: StateDescriptor) -> None:
        self._known[descriptor.descriptor_id] = descriptor
        self._known.move_to_end(descriptor.descriptor_id)
        while len(self._known) > self.capacity:
            self._known.popitem(last=False)

    def get(self, descriptor_id: str) -> StateDescriptor | None:
        """The descriptor of ``descriptor_id``, or None when this registry does not know it."""
        return self._known.get(descriptor_id)

    def resolve(self, descriptor_id: str, carried: StateDescriptor | None = None) -> StateDescriptor | None:
        """``carried`` (remembered for later) when a record carries its descriptor, else the known one."""
        if carried is not None:
            self.add(carried)
            return carried
        return self._known.get(descriptor_id)

    def __len__(self) -> int:
        return len(self._known)
