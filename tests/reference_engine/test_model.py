"""The reference model: deterministic weights, continuation from cached state equals recomputation."""

from __future__ import annotations

import pytest
import torch

from nexuskv.descriptor import DType
from nexuskv.errors import ConfigError
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, TinyModel, Variant, descriptor_for

SPECS = {"gqa": ReferenceModelSpec.gqa(), "mla": ReferenceModelSpec.mla(), "hybrid": ReferenceModelSpec.hybrid()}


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", SPECS)
def test_weights_come_from_the_seed(name):
    spec = SPECS[name]
    toks = _prompt(9)
    a = TinyModel(spec)(toks, 0, {}, {}).logits
    b = TinyModel(spec)(toks, 0, {}, {}).logits
    c = TinyModel(ReferenceModelSpec(variant=spec.variant, seed=1))(toks, 0, {}, {}).logits
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert spec.revision != ReferenceModelSpec(variant=spec.variant, seed=1).revision
    assert spec.revision == spec.with_state(block_size=8, kv_dtype=DType.BFLOAT16).revision


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16])
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("split", [1, 8, 16, 19])
def test_continuing_from_cached_state_computes_what_a_full_prefill_computes(name, dtype, split):
    spec = SPECS[name].with_state(kv_dtype=dtype)
    model = TinyModel(spec)
    toks = _prompt(20, seed=2)
    boundaries = range(spec.checkpoint_interval, 21, spec.checkpoint_interval) if spec.has_checkpoints else ()
    full = model(toks, 0, {}, {}, boundaries)
    head = model(toks[:split], 0, {}, {}, boundaries)
    if spec.has_checkpoints and split not in head.checkpoints:
        with pytest.raises(ValueError, match="recurrent state after"):
            model(toks[split:], split, head.rows, {}, boundaries)
        return
    tail = model(toks[split:], split, head.rows, head.checkpoints.get(split, {}), boundaries)
    assert (tail.logits - full.logits).abs().max() <= 1e-5
    for layer, rows in tail.rows.items():  # the state the continuation writes is the full run's
        assert rows.dtype == model.cache_dtype
        assert torch.allclose(rows.float(), full.rows[layer][split:].float(), atol=1e-5)


@pytest.mark.parametrize("name", SPECS)
def test_pages_and_checkpoints_have_the_descriptor_s_size(name):
    spec = SPECS[name]
    rt = ReferenceEngine(spec)
    d = rt.describe()
    assert rt.pages.page_nbytes == d.bytes_per_token[0] * spec.block_size
    if spec.variant is Variant.HYBRID:
        assert rt.checkpoints.page_nbytes == d.group(1).bytes_per_checkpoint
        assert d.group(0).layers == spec.attention_layers and d.group(1).layers == spec.recurrent_layers
    else:
        assert rt.checkpoints is None and d.group(0).layers == tuple(range(spec.n_layers))
    assert descriptor_for(spec) == d


@pytest.mark.parametrize("bad, field", [
    (dict(variant="gqa", n_kv_heads=3), "ReferenceModelSpec.n_kv_heads"),
    (dict(variant="hybrid", block_size=4, checkpoint_interval=6), "ReferenceModelSpec.checkpoint_interval"),
    (dict(variant="hybrid", n_layers=1), "ReferenceModelSpec.recurrent_every"),
    (dict(variant="gqa", d_model=0), "ReferenceModelSpec.d_model"),
    (dict(variant="gqa", kv_dtype="int8"), "ReferenceModelSpec.kv_dtype"),
])
def test_bad_specs_name_the_field(bad, field):
    with pytest.raises(ConfigError) as info:
        ReferenceModelSpec(**bad)
    assert info.value.field == field


def test_with_state_refuses_weight_changes():
    with pytest.raises(ConfigError, match="changes the weights"):
        ReferenceModelSpec.gqa().with_state(d_model=32)
