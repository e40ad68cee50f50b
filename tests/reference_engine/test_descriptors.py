"""State of one variant, dtype, block size, layer scope or checkpoint interval never loads into another."""

from __future__ import annotations

import pytest

from nexuskv.dataplane import DescriptorRegistry, HostMemoryBackend, PayloadHeader, PayloadKey, loadable
from nexuskv.descriptor import DType, SemanticType, StateDescriptor
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, descriptor_for

PROMPT = [(7 * i + 3) % 256 for i in range(21)]


def test_the_three_variants_describe_their_state():
    gqa, mla, hybrid = (descriptor_for(s) for s in (ReferenceModelSpec.gqa(), ReferenceModelSpec.mla(), ReferenceModelSpec.hybrid()))
    assert len({gqa.descriptor_id, mla.descriptor_id, hybrid.descriptor_id}) == 3
    assert (gqa.semantic_type, mla.semantic_type, hybrid.semantic_type) == (
        SemanticType.GQA, SemanticType.MLA, SemanticType.HYBRID)
    assert [t.role.value for t in mla.group(0).tensors] == ["latent", "rope_key"]
    assert mla.layout.position == "rope_deferred" and gqa.layout.position == "rope_applied"
    assert [t.role.value for t in hybrid.group(1).tensors] == ["recurrent_state", "conv_state"]
    assert hybrid.group(1).granularity.kind.value == "checkpoint" and hybrid.group(1).granularity.tokens == 8
    assert all(d.engine_family == "nexuskv-reference" for d in (gqa, mla, hybrid))


def _layer_scope_variant(d: StateDescriptor) -> StateDescriptor:
    """The same descriptor covering fewer layers (as a pipeline stage would)."""
    data = d.model_dump()
    data["descriptor_id"] = ""
    data["layer_groups"][0]["layers"] = (0, 1)
    return StateDescriptor.model_validate(data)


CASES = {
    "variant": (ReferenceModelSpec.gqa(), ReferenceModelSpec.mla(), "layer_groups[0].semantic_type"),
    "dtype": (ReferenceModelSpec.gqa(), ReferenceModelSpec.gqa(kv_dtype=DType.BFLOAT16), "dtype"),
    "block size": (ReferenceModelSpec.gqa(), ReferenceModelSpec.gqa(block_size=8), "granularity.tokens"),
    "checkpoint interval": (ReferenceModelSpec.hybrid(), ReferenceModelSpec.hybrid(checkpoint_interval=16),
                            "layer_groups[1].granularity.tokens"),
    "weights": (ReferenceModelSpec.gqa(), ReferenceModelSpec.gqa(seed=1), "model_revision"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_runtime_refuses_payloads_of_another_descriptor_with_the_reason(case):
    spec_a, spec_b, field = CASES[case]
    registry = DescriptorRegistry()
    a = ReferenceEngine(spec_a, registry=registry)
    b = ReferenceEngine(spec_b, registry=registry)
    assert a.describe().descriptor_id != b.describe().descriptor_id
    tier = HostMemoryBackend(1 << 20)
    a.prefill(PROMPT)
    saved = a.save(PROMPT, tier)
    assert saved.blocks == 5
    verdict = loadable(a.describe().descriptor_id, b.describe(), registry)
    assert not verdict and field in verdict.field and "differs" in verdict.reason
    outcome = b.load(PROMPT, tier, payloads=[h.key for h in saved.handles])
    assert outcome.blocks == 0 and outcome.reason.startswith("refused payloads of descriptor")
    assert field in outcome.reason
    # b's own lookup never even finds them: canonical keys are scoped by descriptor
    assert b.lookup(PROMPT, tier).tokens == 0 and b.load(PROMPT, tier).blocks == 0
    assert b.cached_blocks() == 0 and b.prefill(PROMPT).reused_tokens == 0


def test_layer_scope_and_unknown_descriptors_are_refused():
    registry = DescriptorRegistry()
    rt = ReferenceEngine(ReferenceModelSpec.gqa(), registry=registry)
    stage = _layer_scope_variant(rt.describe())
    registry.register(stage)
    key = rt.block_keys(PROMPT)[0]
    outcome = rt.load(PROMPT, HostMemoryBackend(1 << 20), payloads=[PayloadKey(stage.descriptor_id, key)])
    assert "layer_groups[0].layers" in outcome.reason
    unknown = rt.load(PROMPT, HostMemoryBackend(1 << 20), payloads=[PayloadKey("sd1-" + "0" * 32, key)])
    assert "unknown here" in unknown.reason and "fails closed" in unknown.reason


def test_payloads_of_another_prompt_are_refused():
    rt = ReferenceEngine(ReferenceModelSpec.gqa())
    other = [1] * 21
    outcome = rt.load(PROMPT, HostMemoryBackend(1 << 20), payloads=[rt.payload_key(rt.block_keys(other)[0])])
    assert "is not part of this prompt's state" in outcome.reason


def test_relabelled_bytes_do_not_load():
    """A payload copied under another descriptor's address fails its checksum: the header binds it."""
    registry = DescriptorRegistry()
    a = ReferenceEngine(ReferenceModelSpec.gqa(), registry=registry)
    b = ReferenceEngine(ReferenceModelSpec.gqa(seed=1), registry=registry)  # same shapes, other weights
    a.prefill(PROMPT)
    tier = HostMemoryBackend(1 << 20)
    for handle in a.save(PROMPT, tier).handles:
        header, data = tier.get(handle.key)
        forged = PayloadHeader(key=PayloadKey(b.describe().descriptor_id, b.block_keys(PROMPT)[0]),
                               nbytes=header.nbytes, checksum=header.checksum)
        tier.put(forged, data)  # a tier stores what it is handed; loading is where it is checked
        break
    outcome = b.load(PROMPT, tier)
    assert outcome.blocks == 0 and "checksum" in outcome.reason
    assert b.prefill(PROMPT).reused_tokens == 0
