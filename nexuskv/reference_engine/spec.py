"""The reference model's specification: variant, sizes, seed, and how its state is kept.

Three variants, all tiny (tests run them in milliseconds on a CPU) and all built from random
weights drawn from ``seed`` — nothing is downloaded:

* ``gqa`` — Llama-like: grouped-query attention with RoPE; state per token is K and V per KV head.
* ``mla`` — DeepSeek-V2-like Multi-head Latent Attention: state per token is the compressed
  latent ``c_kv`` and the decoupled RoPE key (kept un-rotated; RoPE is applied at attention time).
* ``hybrid`` — attention layers (GQA) interleaved with recurrent layers (a gated linear attention
  with a short causal convolution, KDA/Mamba-like) whose state after a prefix is one terminal
  checkpoint (recurrent state and convolution state), kept every ``checkpoint_interval`` tokens.

``block_size``, ``kv_dtype`` and ``checkpoint_interval`` decide how state is *kept* (the State
Descriptor); every other field decides the weights, and its digest is the model revision.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from typing import Any

from nexuskv.descriptor import DType
from nexuskv.errors import ConfigError

__all__ = ["Variant", "LayerKind", "ReferenceModelSpec"]


class Variant(StrEnum):
    GQA = "gqa"
    MLA = "mla"
    HYBRID = "hybrid"


class LayerKind(StrEnum):
    ATTENTION = "attention"  # GQA in gqa and hybrid models, MLA in mla models
    RECURRENT = "recurrent"


_STATE_FIELDS = ("block_size", "kv_dtype", "checkpoint_interval")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceModelSpec:
    """Sizes of the reference model. Build with :meth:`gqa`, :meth:`mla` or :meth:`hybrid`."""

    variant: Variant
    seed: int = 0
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 3
    mlp_hidden: int = 128
    n_heads: int = 4
    rope_theta: float = 10000.0
    # GQA attention (gqa, hybrid)
    n_kv_heads: int = 2
    head_dim: int = 16
    # MLA attention (mla)
    kv_lora_rank: int = 32
    qk_nope_dim: int = 16
    qk_rope_dim: int = 8
    v_head_dim: int = 16
    # recurrent layers (hybrid)
    recurrent_every: int = 2  # layer i is recurrent when i % recurrent_every == recurrent_every - 1
    rec_heads: int = 2
    rec_key_dim: int = 16
    rec_value_dim: int = 16
    conv_kernel: int = 4
    # how state is kept (the descriptor, not the weights)
    block_size: int = 4
    kv_dtype: DType = DType.FLOAT32
    checkpoint_interval: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", Variant(self.variant))
        object.__setattr__(self, "kv_dtype", DType(self.kv_dtype))
        positive = [f.name for f in fields(self) if isinstance(getattr(self, f.name), int)
                    and f.name != "seed" and getattr(self, f.name) < 1]
        if positive:
            raise ConfigError(f"ReferenceModelSpec.{positive[0]}", "must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("ReferenceModelSpec.n_kv_heads", f"must divide n_heads ({self.n_heads})")
        if self.kv_dtype not in (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16):
            raise ConfigError("ReferenceModelSpec.kv_dtype", f"{self.kv_dtype.value} is not a floating dtype torch keeps")
        if self.head_dim % 2 or self.qk_rope_dim % 2:
            raise ConfigError("ReferenceModelSpec.head_dim", "RoPE needs even head_dim and qk_rope_dim")
        if self.variant is Variant.HYBRID:
            if self.checkpoint_interval % self.block_size:
                raise ConfigError("ReferenceModelSpec.checkpoint_interval",
                                  f"must be a multiple of block_size ({self.block_size}): checkpoints sit on block "
                                  f"boundaries")
            if LayerKind.ATTENTION not in self.layer_kinds or LayerKind.RECURRENT not in self.layer_kinds:
                raise ConfigError("ReferenceModelSpec.recurrent_every", "a hybrid needs both attention and recurrent layers")

    # -- builders -----------------------------------------------------------------------------

    @classmethod
    def gqa(cls, **overrides: Any) -> ReferenceModelSpec:
        return cls(variant=Variant.GQA, **overrides)

    @classmethod
    def mla(cls, **overrides: Any) -> ReferenceModelSpec:
        return cls(variant=Variant.MLA, **overrides)

    @classmethod
    def hybrid(cls, **overrides: Any) -> ReferenceModelSpec:
        return cls(variant=Variant.HYBRID, **overrides)

    def with_state(self, **changes: Any) -> ReferenceModelSpec:
        """The same weights with another way of keeping state (block size, dtype, interval)."""
        bad = set(changes) - set(_STATE_FIELDS)
        if bad:
            raise ConfigError(f"ReferenceModelSpec.{sorted(bad)[0]}", "changes the weights, not how state is kept")
        return replace(self, **changes)

    # -- derived --------------------------------------------------------------------------------

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        if self.variant is not Variant.HYBRID:
            return (LayerKind.ATTENTION,) * self.n_layers
        k = self.recurrent_every
        return tuple(LayerKind.RECURRENT if i % k == k - 1 else LayerKind.ATTENTION for i in range(self.n_layers))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.ATTENTION)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.RECURRENT)

    @property
    def has_checkpoints(self) -> bool:
        return bool(self.recurrent_layers)

    @property
    def model_name(self) -> str:
        return f"nexuskv-reference/{self.variant.value}"

    @property
    def revision(self) -> str:
        """Digest of every field that decides the weights (not block size, dtype, interval)."""
        weights = {k: v for k, v in asdict(self).items() if k not in _STATE_FIELDS}
        canonical = json.dumps(weights, sort_keys=True, default=str, separators=(",", ":"))
        return "w-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def attention_width(self) -> int:
        """Values per token per attention layer in a page: K|V (GQA), or latent|rope key (MLA)."""
        if self.variant is Variant.MLA:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.n_kv_heads * self.head_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.rec_heads, self.rec_key_dim, self.rec_value_dim)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.d_model)

    @property
    def checkpoint_width(self) -> int:
        """Values per recurrent layer in a checkpoint: recurrent state then convolution state."""
        (h, k, v), (c0, c1) = self.recurrent_state_shape, self.conv_state_shape
        return h * k * v + c0 * c1
