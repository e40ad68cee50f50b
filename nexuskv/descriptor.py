"""The State Descriptor (whitepaper §8.5): what a piece of reusable model state *is*.

A descriptor says which computation produced a state (model, revision, tokenizer, engine family),
what the state is (semantic type per layer group, tensor roles and shapes, dtype, quantization),
how it is laid out (layout, position convention, granularity), which shard it covers (layers,
tensor- and pipeline-parallel scope, KV group), and how it may be materialized, moved and
restored.

Two fields are *derived*, never trusted from input:

* ``descriptor_id`` is a stable digest of the compatibility-relevant fields only
  (:data:`COMPATIBILITY_FIELDS`). Equal ids mean identical compatibility-relevant content, in any
  process, on any machine. Tenant, transfer paths, cost profile, materialization capabilities
  and conversion rules are deliberately outside the digest: they describe how state may be
  used, not what it is. Tenancy is part of the identity scope (:mod:`nexuskv.identity`).
* ``bytes_per_token`` per layer group is computed from tensor shapes and dtypes.

A descriptor received with a ``descriptor_id`` that does not match its content is rejected.
"""

from __future__ import annotations

import hashlib
import json
import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from nexuskv.contract import Contract

__all__ = [
    "SCHEMA_VERSION",
    "COMPATIBILITY_FIELDS",
    "SemanticType",
    "TensorRole",
    "DType",
    "GranularityKind",
    "Tier",
    "Granularity",
    "TensorSpec",
    "LayerGroup",
    "ParallelScope",
    "Quantization",
    "LayoutConvention",
    "MaterializationCapabilities",
    "CompatibilityRules",
    "TransferPath",
    "RestoreCostProfile",
    "StateDescriptor",
    "compatibility_view",
]

SCHEMA_VERSION = 1

Name = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]


class SemanticType(StrEnum):
    """What kind of state a layer group keeps (whitepaper §8.1-8.4)."""

    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"  # compressed latent KV plus decoupled RoPE key (DeepSeek-V2/V3)
    DSA = "dsa"  # sparse attention: KV/latent regions plus selector (indexer) state
    RECURRENT = "recurrent"  # KDA / Mamba / linear attention: a terminal checkpoint
    SLIDING_WINDOW = "sliding_window"
    HYBRID = "hybrid"  # only valid for a whole descriptor whose groups differ


class TensorRole(StrEnum):
    KEY = "key"
    VALUE = "value"
    LATENT = "latent"  # MLA c_kv
    ROPE_KEY = "rope_key"  # MLA decoupled positional key
    INDEX_KEY = "index_key"  # DSA lightning-indexer keys
    RECURRENT_STATE = "recurrent_state"
    CONV_STATE = "conv_state"


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT8_E5M2 = "float8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FLOAT32: 4,
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.FLOAT8_E4M3: 1,
    DType.FLOAT8_E5M2: 1,
    DType.INT8: 1,
    DType.UINT8: 1,
}


class GranularityKind(StrEnum):
    BLOCK = "block"  # token-granular pages of ``tokens`` tokens
    CHECKPOINT = "checkpoint"  # recurrent state valid only every ``tokens`` tokens


class Tier(StrEnum):
    """Where a copy of state lives (whitepaper §2.3)."""

    GPU = "gpu"  # device memory (HBM)
    HOST = "host"  # host DRAM, pinned when the data plane can
    DISK = "disk"  # local SSD / files
    REMOTE = "remote"  # another process or node's memory or store
    OBJECT = "object"  # object store


class Granularity(Contract):
    kind: GranularityKind
    tokens: PosInt


class TensorSpec(Contract):
    """One tensor role of a layer group, per token (block groups) or per checkpoint."""

    role: TensorRole
    shape: tuple[PosInt, ...] = Field(min_length=1, max_length=8)
    dtype: DType

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class LayerGroup(Contract):
    """Layers that share one state kind, granularity and KV group."""

    kv_group: NonNegInt
    semantic_type: SemanticType
    layers: tuple[NonNegInt, ...] = Field(min_length=1, max_length=4096)
    granularity: Granularity
    tensors: tuple[TensorSpec, ...] = Field(min_length=1, max_length=16)
    sliding_window: PosInt | None = None

    @model_validator(mode="after")
    def _consistent(self) -> LayerGroup:
        if self.semantic_type is SemanticType.HYBRID:
            raise ValueError("semantic_type: a layer group cannot be hybrid; hybrid is a descriptor made of groups")
        if len(set(self.layers)) != len(self.layers) or list(self.layers) != sorted(self.layers):
            raise ValueError("layers: must be strictly increasing layer indices")
        recurrent = self.semantic_type is SemanticType.RECURRENT
        if recurrent != (self.granularity.kind is GranularityKind.CHECKPOINT):
            raise ValueError("granularity.kind: recurrent groups use checkpoints, attention groups use blocks")
        if (self.semantic_type is SemanticType.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("sliding_window: required for, and only for, sliding_window groups")
        roles = [t.role for t in self.tensors]
        if len(set(roles)) != len(roles):
            raise ValueError("tensors: each role may appear once")
        need = _REQUIRED_ROLES[self.semantic_type]
        if not need <= set(roles):
            missing = ", ".join(sorted(r.value for r in need - set(roles)))
            raise ValueError(f"tensors: {self.semantic_type.value} state needs roles {missing}")
        return self

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token adds to this group's state (0 for recurrent groups)."""
        if self.granularity.kind is GranularityKind.CHECKPOINT:
            return 0
        return len(self.layers) * sum(t.nbytes for t in self.tensors)

    @property
    def bytes_per_checkpoint(self) -> int:
        """Bytes of one recurrent checkpoint of this group (0 for token-granular groups)."""
        if self.granularity.kind is not GranularityKind.CHECKPOINT:
            return 0
        return len(self.layers) * sum(t.nbytes for t in self.tensors)

    def state_bytes(self, num_tokens: int) -> int:
        """Bytes needed to hold this group's state after ``num_tokens`` tokens."""
        if self.granularity.kind is GranularityKind.CHECKPOINT:
            return self.bytes_per_checkpoint if num_tokens > 0 else 0
        kept = min(num_tokens, self.sliding_window) if self.sliding_window else num_tokens
        return kept * self.bytes_per_token


_REQUIRED_ROLES: dict[SemanticType, frozenset[TensorRole]] = {
    SemanticType.MHA: frozenset({TensorRole.KEY, TensorRole.VALUE}),
    SemanticType.GQA: frozenset({TensorRole.KEY, TensorRole.VALUE}),
    SemanticType.MQA: frozenset({TensorRole.KEY, TensorRole.VALUE}),
    SemanticType.SLIDING_WINDOW: frozenset({TensorRole.KEY, TensorRole.VALUE}),
    SemanticType.MLA: frozenset({TensorRole.LATENT, TensorRole.ROPE_KEY}),
    SemanticType.DSA: frozenset({TensorRole.LATENT, TensorRole.INDEX_KEY}),
    SemanticType.RECURRENT: frozenset({TensorRole.RECURRENT_STATE}),
    SemanticType.HYBRID: frozenset(),
}


class ParallelScope(Contract):
    """Which shard of the model's state this is."""

    tp_rank: NonNegInt = 0
    tp_size: PosInt = 1
    pp_stage: NonNegInt = 0
    pp_size: PosInt = 1

    @model_validator(mode="after")
    def _ranks(self) -> ParallelScope:
        if self.tp_rank >= self.tp_size:
            raise ValueError("tp_rank: must be smaller than tp_size")
        if self.pp_stage >= self.pp_size:
            raise ValueError("pp_stage: must be smaller than pp_size")
        return self


class Quantization(Contract):
    """How stored values relate to the model's compute dtype."""

    scheme: Literal["none", "per_tensor", "per_token", "per_channel", "per_group"] = "none"
    scale_dtype: DType | None = None
    group_size: PosInt | None = None

    @model_validator(mode="after")
    def _scheme(self) -> Quantization:
        if self.scheme == "none" and (self.scale_dtype is not None or self.group_size is not None):
            raise ValueError("scale_dtype: only quantized schemes carry scales")
        if self.scheme != "none" and self.scale_dtype is None:
            raise ValueError("scale_dtype: required for a quantized scheme")
        if (self.scheme == "per_group") != (self.group_size is not None):
            raise ValueError("group_size: required for, and only for, per_group quantization")
        return self


class LayoutConvention(Contract):
    """Physical layout and positional convention of stored tensors."""

    layout: Name  # e.g. "paged_nhd", "paged_hnd", "layer_first", "page_first"
    position: Literal["rope_applied", "rope_deferred", "none"]
    rope_theta: Annotated[float, Field(gt=0)] | None = None
    rope_scaling: Name | None = None

    @model_validator(mode="after")
    def _rope(self) -> LayoutConvention:
        if self.position != "none" and self.rope_theta is None:
            raise ValueError("rope_theta: required when positions are encoded with RoPE")
        return self


class MaterializationCapabilities(Contract):
    """What the consuming runtime can do with this state."""

    partial_prefix: bool = True  # a block prefix of the state may be restored alone
    layerwise: bool = False  # layers may be restored while earlier layers compute
    zero_copy: bool = False


class CompatibilityRules(Contract):
    """Conversions this state may undergo. Exact equality is the default; none ship yet."""

    conversions: tuple[Name, ...] = ()


class TransferPath(Contract):
    source: Tier
    destination: Tier
    backend: Name


class RestoreCostProfile(Contract):
    """Restore (materialization) cost on the consumer, excluding transfer. Seconds."""

    fixed_s: Annotated[float, Field(ge=0)] = 0.0
    per_token_s: Annotated[float, Field(ge=0)] = 0.0
    source: Name = "unmeasured"


class StateDescriptor(Contract):
    """The versioned State Descriptor. Build with keyword arguments; it validates itself."""

    schema_version: Literal[1] = SCHEMA_VERSION
    descriptor_id: str = ""
    tenant_namespace: Name
    model: Name
    model_revision: Name
    tokenizer_revision: Name
    engine_family: Name  # "vllm", "sglang", "nexuskv-reference", ...
    #: Derived from the groups (their common type, or ``hybrid``); checked when given.
    semantic_type: SemanticType | None = None
    parallel: ParallelScope = ParallelScope()
    layer_groups: tuple[LayerGroup, ...] = Field(min_length=1, max_length=64)
    quantization: Quantization = Quantization()
    layout: LayoutConvention
    materialization: MaterializationCapabilities = MaterializationCapabilities()
    compatibility: CompatibilityRules = CompatibilityRules()
    transfer_paths: tuple[TransferPath, ...] = ()
    restore_cost: RestoreCostProfile = RestoreCostProfile()

    @field_validator("descriptor_id")
    @classmethod
    def _id_shape(cls, value: str) -> str:
        if value and not (value.startswith("sd1-") and len(value) == 36):
            raise ValueError("descriptor_id: must be empty or an 'sd1-' digest; it is derived, not chosen")
        return value

    @model_validator(mode="after")
    def _derive(self) -> StateDescriptor:
        groups = [g.kv_group for g in self.layer_groups]
        if len(set(groups)) != len(groups):
            raise ValueError("layer_groups: kv_group ids must be unique")
        layers = [layer for g in self.layer_groups for layer in g.layers]
        if len(set(layers)) != len(layers):
            raise ValueError("layer_groups: a layer may belong to one group only")
        kinds = {g.semantic_type for g in self.layer_groups}
        expected = SemanticType.HYBRID if len(kinds) > 1 else next(iter(kinds))
        if self.semantic_type is not None and self.semantic_type is not expected:
            raise ValueError(
                f"semantic_type: groups make this {expected.value!r}, not {self.semantic_type.value!r}"
            )
        self.__dict__["semantic_type"] = expected
        digest = _digest(compatibility_view(self))
        if self.descriptor_id and self.descriptor_id != digest:
            raise ValueError("descriptor_id: does not match the descriptor's compatibility-relevant fields")
        self.__dict__["descriptor_id"] = digest
        return self

    # -- derived values -------------------------------------------------------------------

    def group(self, kv_group: int) -> LayerGroup | None:
        for g in self.layer_groups:
            if g.kv_group == kv_group:
                return g
        return None

    @property
    def bytes_per_token(self) -> dict[int, int]:
        """Bytes per token of each KV group (0 for recurrent groups)."""
        return {g.kv_group: g.bytes_per_token for g in self.layer_groups}

    def state_bytes(self, num_tokens: int) -> int:
        """Bytes of the whole state after ``num_tokens`` tokens, all groups together."""
        return sum(g.state_bytes(num_tokens) for g in self.layer_groups)

    @property
    def block_size(self) -> int:
        """Tokens per block of the token-granular groups (they must agree), else the checkpoint interval."""
        sizes = {g.granularity.tokens for g in self.layer_groups if g.granularity.kind is GranularityKind.BLOCK}
        if not sizes:
            return self.layer_groups[0].granularity.tokens
        return min(sizes)

    def with_tenant(self, tenant_namespace: str) -> StateDescriptor:
        """The same state description for another tenant (same descriptor_id)."""
        return StateDescriptor.model_validate({**self.model_dump(), "tenant_namespace": tenant_namespace})


#: Top-level fields of StateDescriptor that decide whether two states are interchangeable.
#: Everything else (tenant, capabilities, conversions, transfer paths, restore cost) is about
#: how the state may be used. Nested fields of these are all relevant. The top-level
#: ``semantic_type`` is a function of the groups' types, which are compared instead.
COMPATIBILITY_FIELDS: tuple[str, ...] = (
    "schema_version",
    "model",
    "model_revision",
    "tokenizer_revision",
    "engine_family",
    "parallel",
    "layer_groups",
    "quantization",
    "layout",
)


def compatibility_view(descriptor: StateDescriptor) -> dict[str, Any]:
    """The compatibility-relevant fields flattened to ``{dotted.path: scalar}``.

    Paths look like ``layer_groups[0].tensors[1].dtype``. Two descriptors are exactly
    compatible iff these views are equal; the compatibility predicate reports the first path
    that differs.
    """
    data = descriptor.model_dump(mode="json", include=set(COMPATIBILITY_FIELDS))
    flat: dict[str, Any] = {}
    _flatten(data, "", flat)
    return flat


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            _flatten(value[k], f"{prefix}.{k}" if prefix else k, out)
        if not value:
            out[prefix] = {}
    elif isinstance(value, list):
        out[f"{prefix}.__len__"] = len(value)
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def _digest(view: dict[str, Any]) -> str:
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sd1-" + hashlib.sha256(canonical.encode("ascii")).hexdigest()[:32]
