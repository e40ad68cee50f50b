"""Acceptance: restored state computes the same next-token logits as recomputation (fp32, 1e-5).

For each variant, a prompt's prefix is prefilled by one runtime, saved to a tier, loaded back by a
fresh runtime with the same weights, and the whole prompt is prefilled reusing it: full reuse
(every block of the prompt cached) and partial reuse at several block boundaries, through each
tier (device memory — CUDA or its host stand-in —, host DRAM, local disk, the remote tier process).
The hybrid reuses only at checkpoint boundaries (every 8 tokens) and says why elsewhere.
"""

from __future__ import annotations

import time

import pytest
import torch

from nexuskv.contracts.transfers import TransferCommand, TransferStatus
from nexuskv.dataplane import (
    BackendCatalog,
    DescriptorRegistry,
    DeviceMemoryBackend,
    DiskBackend,
    HostMemoryBackend,
    TransferExecutor,
)
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.reference_engine import CHECKPOINT_GROUP, ReferenceEngine, ReferenceModelSpec, TinyModel, Variant

TOL = 1e-5
SPECS = {"gqa": ReferenceModelSpec.gqa(), "mla": ReferenceModelSpec.mla(), "hybrid": ReferenceModelSpec.hybrid()}
MODELS = {name: TinyModel(spec) for name, spec in SPECS.items()}
PROMPT = torch.randint(0, 256, (22,), generator=torch.Generator().manual_seed(11)).tolist()
REFERENCE = {name: ReferenceEngine(SPECS[name], model=MODELS[name]).prefill(PROMPT, reuse=False).logits
             for name in SPECS}


def _expected_reuse(spec: ReferenceModelSpec, cached_tokens: int, n: int) -> int:
    usable = min(cached_tokens, n - 1)
    if spec.variant is Variant.HYBRID:
        return usable // spec.checkpoint_interval * spec.checkpoint_interval
    return usable


@pytest.fixture(params=["device", "host", "disk", "remote"])
def tier(request, tmp_path):
    if request.param == "device":
        return DeviceMemoryBackend(1 << 22)
    if request.param == "host":
        return HostMemoryBackend(1 << 22)
    if request.param == "disk":
        return DiskBackend(tmp_path / "disk", 1 << 22)
    return request.getfixturevalue("remote_backend")


@pytest.mark.parametrize("cached", [4, 8, 12, 16, 22], ids=lambda m: f"prefix{m}")
@pytest.mark.parametrize("name", SPECS)
def test_reuse_through_a_tier_equals_recomputation(name, cached, tier):
    spec = SPECS[name]
    registry = DescriptorRegistry()
    writer = ReferenceEngine(spec, model=MODELS[name], registry=registry)
    writer.prefill(PROMPT[:cached])
    saved = writer.save(PROMPT[:cached], tier)
    assert saved.blocks == cached // spec.block_size and saved.reason is None
    reader = ReferenceEngine(spec, model=MODELS[name], registry=registry)
    loaded = reader.load(PROMPT, tier)
    expected = _expected_reuse(spec, cached // spec.block_size * spec.block_size, len(PROMPT))
    assert loaded.reusable_tokens >= expected
    result = reader.prefill(PROMPT)
    assert result.reused_tokens == expected
    assert result.computed_tokens == len(PROMPT) - expected
    assert (result.logits - REFERENCE[name]).abs().max().item() <= TOL
    if spec.variant is Variant.HYBRID and expected < min(cached, len(PROMPT) - 1):
        assert "checkpoint boundary" in (loaded.reason or result.reason)


@pytest.mark.parametrize("name", SPECS)
def test_full_reuse_of_a_block_aligned_prompt(name):
    spec = SPECS[name]
    prompt = PROMPT[:16]  # 4 full blocks: everything is cached, the last token is computed again
    reference = ReferenceEngine(spec, model=MODELS[name]).prefill(prompt, reuse=False).logits
    rt = ReferenceEngine(spec, model=MODELS[name])
    rt.prefill(prompt)
    again = rt.prefill(prompt)
    assert again.reused_tokens == (15 if spec.variant is not Variant.HYBRID else 8)
    assert (again.logits - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("name", SPECS)
def test_local_prefix_cache_reuse(name):
    spec = SPECS[name]
    rt = ReferenceEngine(spec, model=MODELS[name])
    rt.prefill(PROMPT[:13])
    result = rt.prefill(PROMPT)
    assert result.reused_tokens == _expected_reuse(spec, 12, len(PROMPT))
    assert (result.logits - REFERENCE[name]).abs().max().item() <= TOL


def test_the_hybrid_refuses_reuse_off_its_checkpoints_and_recomputes():
    spec = SPECS["hybrid"]
    rt = ReferenceEngine(spec, model=MODELS["hybrid"])
    rt.prefill(PROMPT)
    for asked in (4, 12, 20):
        refused = rt.prefill(PROMPT, reuse_tokens=asked)
        assert refused.reused_tokens == 0 and refused.computed_tokens == len(PROMPT)
        assert f"checkpoint boundaries (every 8 tokens); {asked} is not one" in refused.reason
        assert (refused.logits - REFERENCE["hybrid"]).abs().max().item() <= TOL
    for asked in (8, 16):
        ok = rt.prefill(PROMPT, reuse_tokens=asked)
        assert ok.reused_tokens == asked and ok.reason is None
        assert (ok.logits - REFERENCE["hybrid"]).abs().max().item() <= TOL
    lookup = rt.lookup(PROMPT)
    assert lookup.tokens == 16 and "reusing 16 of 20 cached tokens" in lookup.reason


def test_attention_pages_without_their_checkpoint_are_not_reused():
    spec = SPECS["hybrid"]
    registry = DescriptorRegistry()
    writer = ReferenceEngine(spec, model=MODELS["hybrid"], registry=registry)
    writer.prefill(PROMPT)
    tier = HostMemoryBackend(1 << 22)
    writer.save(PROMPT, tier)
    for key in writer.block_keys(PROMPT)[1:4:2]:  # the checkpoints at tokens 8 and 16
        assert tier.delete(writer.payload_key(key, CHECKPOINT_GROUP))
    reader = ReferenceEngine(spec, model=MODELS["hybrid"], registry=registry)
    assert reader.lookup(PROMPT, tier).tokens == 0
    assert reader.load(PROMPT, tier).blocks == 0
    result = reader.prefill(PROMPT)
    assert result.reused_tokens == 0 and (result.logits - REFERENCE["hybrid"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", SPECS)
def test_reuse_after_the_executor_moved_state_disk_host_device(name, tmp_path):
    """Saved to disk, moved disk -> host -> device by transfer commands, loaded from the device tier."""
    spec = SPECS[name]
    registry = DescriptorRegistry()
    disk, host, device = DiskBackend(tmp_path, 1 << 22), HostMemoryBackend(1 << 22), DeviceMemoryBackend(1 << 22)
    writer = ReferenceEngine(spec, model=MODELS[name], registry=registry)
    writer.prefill(PROMPT)
    saved = writer.save(PROMPT, disk)
    ex = TransferExecutor(BackendCatalog("w0", [disk, host, device]))
    try:
        for hop, (src, dst) in enumerate([(Tier.DISK, Tier.HOST), (Tier.HOST, Tier.GPU)]):
            for group in sorted({h.key.group for h in saved.handles}):
                keys = tuple(h.key.key for h in saved.handles if h.key.group == group)
                now = time.time()
                cmd = TransferCommand(transfer_id=f"{name}-{hop}-{group}", request_id="req", kind="prefetch",
                                      descriptor_id=writer.describe().descriptor_id, tenant_namespace="default",
                                      keys=keys, source=EntryLocation(worker="w0", tier=src, group=group),
                                      destination=EntryLocation(worker="w0", tier=dst, group=group),
                                      bytes=sum(h.nbytes for h in saved.handles if h.key.group == group),
                                      issued_at=now, deadline_at=now + 30)
                outcome = ex.execute(cmd)
                assert outcome.status is TransferStatus.COMPLETED, outcome.result.error
    finally:
        ex.close()
    reader = ReferenceEngine(spec, model=MODELS[name], registry=registry)
    reader.load(PROMPT, device)
    result = reader.prefill(PROMPT)
    assert result.reused_tokens == _expected_reuse(spec, 20, len(PROMPT))
    assert (result.logits - REFERENCE[name]).abs().max().item() <= TOL
