"""A model's State Descriptor and FLOP shape, from the model's own (Hugging Face) config.

Every engine adapter of a deployment must key blocks in the same identity scope, and that scope
includes the descriptor's id, a digest of the state's shape. Writing a descriptor by hand for
each model (the only way for a model outside :data:`nexuskv.models.KNOWN_MODELS`) invites
mismatches; deriving it from the ``config.json`` the engine itself loads does not. Both users
call the same function here: the vLLM connector with vLLM's parsed config of the model it serves,
``nexuskv descriptor`` with the model folder's ``config.json`` (for the event bridge and the
router), so equal inputs give equal descriptor ids.

:func:`descriptor_from_hf_config` reads the attention shape of decoder-only models in the
Llama/Mistral/Qwen/Gemma family (``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``rope_theta`` or ``rope_parameters.rope_theta``, ``dtype``
or ``torch_dtype``) and of DeepSeek-style MLA models (``kv_lora_rank``, ``qk_rope_head_dim``);
a multimodal config's ``text_config`` is read for its language model. Anything whose KV state
is not one group of full-attention layers of the same shape (sliding-window or chunked-local
layers, recurrent/hybrid layers, cross-attention) is refused with the reason: such a state needs a
descriptor written for it (``descriptor`` files stay accepted everywhere). The RoPE scaling
type is not recorded: model name and revision, which are in the scope, already fix it, and the
shipped descriptors of the known models carry none (so a known model's derived descriptor is the
shipped one).

:func:`model_spec_from_hf_config` counts what the FLOP form of the cost model needs
(:class:`~nexuskv.profiles.ModelSpec`): parameters active per token in the transformer blocks
(attention projections and the MLP, the routed experts' share for MoE), layers and hidden size.
Embeddings are not counted (a lookup, no FLOPs) and neither is the LM head (a prefill computes
logits for its last token only).

Pure: a mapping in, a frozen value out; reading the file is the caller's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv.descriptor import DType, SemanticType, StateDescriptor
from nexuskv.errors import ConfigError
from nexuskv.models import gqa_descriptor, mla_descriptor
from nexuskv.profiles import ModelSpec

__all__ = ["LAYOUTS", "descriptor_from_hf_config", "model_spec_from_hf_config", "text_config"]

#: Physical layouts of one block's bytes the adapters know (the descriptor's ``layout``):
#: ``paged_nhd`` — per layer, the block's keys then its values, each [tokens, heads, head_dim]
#: (vLLM's FlashAttention cache, (2, blocks, tokens, heads, dim)); ``paged_hnd`` — the same with
#: [heads, tokens, head_dim]; ``paged_hn_kvd`` — per layer [heads, tokens, key+value dims]
#: (vLLM's CPU attention cache, (blocks, heads, tokens, 2*dim)); ``paged_latent`` — MLA latents.
LAYOUTS = ("paged_nhd", "paged_hnd", "paged_hn_kvd", "paged_latent")

_DTYPES = {
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
    "float16": DType.FLOAT16, "fp16": DType.FLOAT16, "half": DType.FLOAT16,
    "float32": DType.FLOAT32, "fp32": DType.FLOAT32, "float": DType.FLOAT32,
    "float8_e4m3": DType.FLOAT8_E4M3, "fp8_e4m3": DType.FLOAT8_E4M3, "fp8": DType.FLOAT8_E4M3,
    "float8_e4m3fn": DType.FLOAT8_E4M3, "float8_e5m2": DType.FLOAT8_E5M2, "fp8_e5m2": DType.FLOAT8_E5M2,
}
_NOT_FULL_ATTENTION = {
    "sliding_window": "sliding-window attention",
    "attention_chunk_size": "chunked local attention",
    "layer_types": "per-layer attention types",
    "cross_attention_layers": "cross-attention layers",
    "ssm_cfg": "state-space (recurrent) layers",
    "mamba_d_state": "state-space (recurrent) layers",
    "linear_attn_config": "linear-attention (recurrent) layers",
}


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (``text_config`` of a multimodal one, else itself)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def _int(cfg: Mapping[str, Any], key: str, *, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.{key}", f"a positive integer is required, got {value!r}")
    return value


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    theta = cfg.get("rope_theta", theta)
    if theta is None:
        return 10000.0  # the transformers default for every family read here
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError("config.rope_theta", f"a positive number is required, got {theta!r}")
    return float(theta)


def _dtype(cfg: Mapping[str, Any], override: str | None) -> DType:
    name = override if override not in (None, "", "auto") else (cfg.get("dtype") or cfg.get("torch_dtype"))
    if name is None:
        raise ConfigError("dtype", "the config names no dtype; give the KV cache dtype the engine uses")
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ConfigError("dtype", f"{name!r} is not a KV cache dtype NexusKV describes ({', '.join(sorted(set(_DTYPES)))})")
    return _DTYPES[key]


def _refuse_mixed_attention(cfg: Mapping[str, Any]) -> None:
    for key, what in _NOT_FULL_ATTENTION.items():
        value = cfg.get(key)
        if key == "layer_types" and isinstance(value, (list, tuple)) and set(value) <= {"full_attention"}:
            continue
        if key == "sliding_window" and cfg.get("use_sliding_window") is False:
            continue  # Qwen2-style configs name a window they do not use
        if value not in (None, False, 0, [], ()):
            raise ConfigError(f"config.{key}", f"the model has {what}; its KV state is not one group of full-attention "
                                               "layers: describe it with a descriptor file instead")


def descriptor_from_hf_config(config: Mapping[str, Any], *, model: str, block_size: int,
                              model_revision: str | None = None, tokenizer_revision: str | None = None,
                              tenant: str = "default", engine_family: str = "vllm", kv_dtype: str | None = None,
                              layout: str = "paged_nhd", tp_rank: int = 0, tp_size: int = 1) -> StateDescriptor:
    """The State Descriptor of ``model``'s KV cache as an engine with these settings holds it.

    ``kv_dtype`` is the engine's KV cache dtype when it is not the model's (``auto``/None: the
    config's ``dtype``); ``layout`` one of :data:`LAYOUTS` (how the engine lays a block's bytes
    out); ``tp_size`` shards the KV heads. ConfigError names the config key that is missing or
    makes the state something this function does not describe.
    """
    cfg = text_config(config)
    if block_size < 1:
        raise ConfigError("block_size", f"must be positive, got {block_size}")
    if layout not in LAYOUTS:
        raise ConfigError("layout", f"{layout!r} is not one of {', '.join(LAYOUTS)}")
    _refuse_mixed_attention(cfg)
    if cfg.get("is_encoder_decoder"):
        raise ConfigError("config.is_encoder_decoder", "encoder-decoder models keep cross-attention state")
    layers = _int(cfg, "num_hidden_layers")
    dtype = _dtype(cfg, kv_dtype)
    common: dict[str, Any] = dict(model=model, num_layers=layers, tenant_namespace=tenant,
                                  model_revision=model_revision or "main",
                                  tokenizer_revision=tokenizer_revision or model_revision or "main",
                                  engine_family=engine_family, block_size=block_size, dtype=dtype,
                                  rope_theta=_rope_theta(cfg))
    if cfg.get("kv_lora_rank"):
        if tp_size != 1:
            raise ConfigError("tp_size", "MLA latents are replicated, not sharded: describe TP 1")
        return mla_descriptor(kv_lora_rank=_int(cfg, "kv_lora_rank"), rope_head_dim=_int(cfg, "qk_rope_head_dim"),
                              layout="paged_latent" if layout == "paged_nhd" else layout, **common)
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size") // heads
    if tp_size > 1 and kv_heads % tp_size:
        raise ConfigError("tp_size", f"{kv_heads} KV heads do not shard evenly over {tp_size} ranks")
    kind = SemanticType.MHA if kv_heads == heads else SemanticType.MQA if kv_heads == 1 else SemanticType.GQA
    return gqa_descriptor(num_kv_heads=kv_heads, head_dim=int(head_dim), tp_rank=tp_rank, tp_size=tp_size,
                          layout=layout, semantic_type=kind, **common)


def model_spec_from_hf_config(config: Mapping[str, Any], *, model: str) -> ModelSpec:
    """Active parameters per token of the transformer blocks, layers and hidden size (see the module docstring)."""
    cfg = text_config(config)
    layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if cfg.get("kv_lora_rank"):  # MLA: low-rank q, compressed kv, decompression, output
        q_rank = cfg.get("q_lora_rank") or 0
        nope, rope = int(cfg.get("qk_nope_head_dim") or head_dim), int(cfg.get("qk_rope_head_dim") or 0)
        v_dim = int(cfg.get("v_head_dim") or head_dim)
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        kv_rank = int(cfg["kv_lora_rank"])
        attention = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    else:
        attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if experts:
        per_token = int(cfg.get("num_experts_per_tok") or 1)
        expert_ffn = int(cfg.get("moe_intermediate_size") or _int(cfg, "intermediate_size"))
        shared = int(cfg.get("n_shared_experts") or 0) * 3 * hidden * expert_ffn
        mlp = per_token * 3 * hidden * expert_ffn + shared + hidden * int(experts)
        label = f"from config.json: {layers} layers, {per_token} of {experts} experts per token (MoE)"
    else:
        mlp = 3 * hidden * _int(cfg, "intermediate_size")
        label = f"from config.json: {layers} layers, hidden {hidden}, dense"
    return ModelSpec(model, float(layers * (attention + mlp)), layers, hidden, label)
