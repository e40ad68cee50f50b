import json
import subprocess
import sys

import pytest

from nexuskv.descriptor import (
    COMPATIBILITY_FIELDS,
    DType,
    Granularity,
    LayerGroup,
    SemanticType,
    StateDescriptor,
    TensorSpec,
    compatibility_view,
)
from nexuskv.errors import ContractError
from nexuskv.models import KNOWN_MODELS, known_model

from tests.factories import descriptor, mla


def _invalid(data: dict) -> ContractError:
    with pytest.raises(ContractError) as info:
        StateDescriptor.model_validate(data)
    return info.value


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(model_revision=""), "model_revision"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.update(semantic_type="mamba2"), "semantic_type"),
        (lambda d: d.update(parallel={"tp_rank": 2, "tp_size": 2}), "tp_rank"),
        (lambda d: d.update(parallel={"pp_stage": 1, "pp_size": 1}), "pp_stage"),
        (lambda d: d["layer_groups"][0].update(granularity={"kind": "block", "tokens": 0}), "granularity"),
        (lambda d: d["layer_groups"][0]["tensors"][0].update(dtype="float64"), "dtype"),
        (lambda d: d["layer_groups"][0]["tensors"][0].update(shape=[2, 0]), "shape"),
        (lambda d: d["layer_groups"][0].update(layers=[3, 1]), "layers"),
        (lambda d: d["layer_groups"][0].update(tensors=[d["layer_groups"][0]["tensors"][0]]), "tensors"),
        (lambda d: d.update(quantization={"scheme": "per_token"}), "scale_dtype"),
        (lambda d: d.update(layout={"layout": "paged_nhd", "position": "rope_applied"}), "rope_theta"),
        (lambda d: d.update(descriptor_id="sd1-" + "0" * 32), "descriptor_id"),
        (lambda d: d.update(descriptor_id="chosen-by-me"), "descriptor_id"),
        (lambda d: d.update(frobnicate=1), "frobnicate"),
        (lambda d: d.update(semantic_type="hybrid"), "semantic_type"),
        (lambda d: d["layer_groups"][0].update(semantic_type="hybrid"), "semantic_type"),
    ],
)
def test_validation_rejects_bad_values_naming_the_field(mutate, field):
    data = json.loads(descriptor().model_dump_json())
    mutate(data)
    err = _invalid(data)
    assert field in str(err), str(err)


def test_known_models_bytes_per_token_match_published_figures():
    # anchors.md §3: 128 KiB, 320 KiB, 256 KiB, ~69 KiB per token in BF16
    assert known_model("meta-llama/Llama-3.1-8B").bytes_per_token == {0: 128 * 1024}
    assert known_model("meta-llama/Llama-3.1-70B").bytes_per_token == {0: 320 * 1024}
    assert known_model("Qwen/Qwen3-32B").bytes_per_token == {0: 256 * 1024}
    assert known_model("deepseek-ai/DeepSeek-V3").bytes_per_token == {0: 61 * 576 * 2}
    assert set(KNOWN_MODELS) == {"meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-32B",
                                 "deepseek-ai/DeepSeek-V3"}


def test_tensor_parallel_shard_halves_bytes():
    full = known_model("meta-llama/Llama-3.1-70B")
    shard = known_model("meta-llama/Llama-3.1-70B", tp_size=2, tp_rank=1)
    assert shard.bytes_per_token[0] * 2 == full.bytes_per_token[0]
    assert shard.descriptor_id != full.descriptor_id


def _hybrid() -> StateDescriptor:
    base = json.loads(descriptor().model_dump_json())
    attention = base["layer_groups"][0]
    attention["layers"] = [0, 2]
    recurrent = {
        "kv_group": 1, "semantic_type": "recurrent", "layers": [1, 3],
        "granularity": {"kind": "checkpoint", "tokens": 64},
        "tensors": [{"role": "recurrent_state", "shape": [4, 8, 8], "dtype": "float32"},
                    {"role": "conv_state", "shape": [3, 32], "dtype": "float32"}],
    }
    base.update(semantic_type="hybrid", layer_groups=[attention, recurrent], descriptor_id="")
    return StateDescriptor.model_validate(base)


def test_hybrid_bytes_per_group_and_state_bytes():
    d = _hybrid()
    assert d.semantic_type is SemanticType.HYBRID
    per_token = 2 * (2 * 8 * 2 + 2 * 8 * 2)  # 2 layers x (K + V) x 2 heads x 8 dims x bf16
    assert d.bytes_per_token == {0: per_token, 1: 0}
    checkpoint = 2 * (4 * 8 * 8 * 4 + 3 * 32 * 4)
    assert d.group(1).bytes_per_checkpoint == checkpoint
    assert d.state_bytes(100) == 100 * per_token + checkpoint
    assert d.state_bytes(0) == 0


def test_sliding_window_state_is_bounded_by_the_window():
    g = LayerGroup(kv_group=0, semantic_type="sliding_window", layers=(0,), sliding_window=8,
                   granularity=Granularity(kind="block", tokens=4),
                   tensors=(TensorSpec(role="key", shape=(1, 4), dtype="float16"),
                            TensorSpec(role="value", shape=(1, 4), dtype="float16")))
    assert g.state_bytes(100) == 8 * g.bytes_per_token


def test_descriptor_id_covers_only_compatibility_relevant_fields():
    d = descriptor()
    assert d.with_tenant("someone-else").descriptor_id == d.descriptor_id
    other = StateDescriptor.model_validate({**d.model_dump(), "descriptor_id": "",
                                            "transfer_paths": [{"source": "disk", "destination": "gpu", "backend": "x"}],
                                            "restore_cost": {"fixed_s": 0.001, "source": "measured"},
                                            "materialization": {"layerwise": True}})
    assert other.descriptor_id == d.descriptor_id
    assert set(k.split(".")[0].split("[")[0] for k in compatibility_view(d)) == set(COMPATIBILITY_FIELDS)


def test_descriptor_id_is_stable_across_processes():
    code = ("from tests.factories import descriptor, mla; print(descriptor().descriptor_id, mla().descriptor_id)")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip() for seed in ("1", "2")}
    assert outs == {f"{descriptor().descriptor_id} {mla().descriptor_id}"}


def test_round_trip_keeps_the_id_and_checks_it():
    d = mla()
    again = StateDescriptor.model_validate_json(d.model_dump_json())
    assert again == d and again.descriptor_id == d.descriptor_id
    assert DType("bfloat16").itemsize == 2
