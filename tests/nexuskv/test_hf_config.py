"""A model's descriptor and FLOP shape from its own config.json: the shipped models come out as shipped."""

from __future__ import annotations

import pytest

from nexuskv.descriptor import DType, SemanticType
from nexuskv.errors import ConfigError
from nexuskv.hf_config import descriptor_from_hf_config, model_spec_from_hf_config
from nexuskv.models import known_model
from nexuskv.profiles import MODEL_SPECS

# The published configs' relevant keys (huggingface.co/<model>/blob/main/config.json).
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "torch_dtype": "bfloat16", "vocab_size": 128256}
DEEPSEEK_V3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "rope_theta": 10000, "torch_dtype": "bfloat16"}
QWEN2_LIKE = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
              "num_key_value_heads": 2, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
              "torch_dtype": "bfloat16"}


def test_a_known_models_config_gives_its_shipped_descriptor():
    d = descriptor_from_hf_config(LLAMA_31_8B, model="meta-llama/Llama-3.1-8B", block_size=16)
    assert d.descriptor_id == known_model("meta-llama/Llama-3.1-8B").descriptor_id
    mla = descriptor_from_hf_config(DEEPSEEK_V3, model="deepseek-ai/DeepSeek-V3", block_size=64)
    assert mla.semantic_type is SemanticType.MLA
    assert mla.descriptor_id == known_model("deepseek-ai/DeepSeek-V3").descriptor_id


def test_the_shape_follows_the_config_and_the_engine():
    tiny = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "dtype": "bfloat16", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "text_config": None}
    d = descriptor_from_hf_config(tiny, model="tiny", block_size=32, layout="paged_hn_kvd", tenant="acme")
    group = d.layer_groups[0]
    assert (d.block_size, d.layout.layout, d.layout.rope_theta, d.tenant_namespace) == (32, "paged_hn_kvd", 1e4, "acme")
    assert group.layers == (0, 1) and group.tensors[0].shape == (2, 32) and group.tensors[0].dtype is DType.BFLOAT16
    fp16 = descriptor_from_hf_config(tiny, model="tiny", block_size=32, kv_dtype="float16")
    assert fp16.layer_groups[0].tensors[0].dtype is DType.FLOAT16 and fp16.descriptor_id != d.descriptor_id
    sharded = descriptor_from_hf_config(tiny, model="tiny", block_size=32, tp_size=2, tp_rank=1)
    assert sharded.layer_groups[0].tensors[0].shape == (1, 32) and sharded.parallel.tp_rank == 1
    wrapped = descriptor_from_hf_config({"text_config": tiny, "vision_config": {}}, model="tiny", block_size=32,
                                        layout="paged_hn_kvd", tenant="acme")
    assert wrapped.descriptor_id == d.descriptor_id  # a multimodal config: its language model's state
    assert descriptor_from_hf_config(QWEN2_LIKE, model="q", block_size=16).semantic_type is SemanticType.GQA


@pytest.mark.parametrize("change, field", [
    ({"num_hidden_layers": 0}, "config.num_hidden_layers"),
    ({"num_attention_heads": None}, "config.num_attention_heads"),
    ({"torch_dtype": "int4"}, "dtype"),
    ({"torch_dtype": None}, "dtype"),
    ({"sliding_window": 4096}, "config.sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "config.layer_types"),
    ({"is_encoder_decoder": True}, "config.is_encoder_decoder"),
])
def test_what_it_cannot_describe_is_refused_by_its_key(change, field):
    with pytest.raises(ConfigError) as err:
        descriptor_from_hf_config({**LLAMA_31_8B, **change}, model="m", block_size=16)
    assert err.value.field == field


def test_bad_engine_settings_are_refused():
    with pytest.raises(ConfigError, match="layout"):
        descriptor_from_hf_config(LLAMA_31_8B, model="m", block_size=16, layout="scrambled")
    with pytest.raises(ConfigError, match="shard evenly"):
        descriptor_from_hf_config(LLAMA_31_8B, model="m", block_size=16, tp_size=3)
    with pytest.raises(ConfigError, match="block_size"):
        descriptor_from_hf_config(LLAMA_31_8B, model="m", block_size=0)


def test_flop_shape_counts_the_transformer_blocks():
    spec = model_spec_from_hf_config(LLAMA_31_8B, model="meta-llama/Llama-3.1-8B")
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert spec.active_params == 32 * per_layer  # 6.98e9: the shipped 8.03e9 less the two embedding matrices
    assert MODEL_SPECS["meta-llama/Llama-3.1-8B"].active_params - spec.active_params == pytest.approx(2 * 128256 * 4096,
                                                                                                    rel=0.01)
    assert (spec.layers, spec.hidden) == (32, 4096)
    moe = model_spec_from_hf_config(DEEPSEEK_V3, model="deepseek-ai/DeepSeek-V3")
    assert moe.active_params == pytest.approx(37e9, rel=0.1) and "MoE" in moe.label  # the published 37B active
