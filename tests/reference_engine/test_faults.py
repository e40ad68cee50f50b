"""Missing, corrupt and partial state: the runtime restores what verifies, and recomputes the rest."""

from __future__ import annotations

import pytest
import torch

from nexuskv.dataplane import DescriptorRegistry, DiskBackend, HostMemoryBackend
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, TinyModel

SPEC = ReferenceModelSpec.gqa()
MODEL = TinyModel(SPEC)
PROMPT = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(5)).tolist()


def _saved(tier) -> tuple[ReferenceEngine, torch.Tensor]:
    registry = DescriptorRegistry()
    writer = ReferenceEngine(SPEC, model=MODEL, registry=registry)
    reference = writer.prefill(PROMPT, reuse=False).logits
    writer.save(PROMPT, tier)
    return ReferenceEngine(SPEC, model=MODEL, registry=registry), reference


@pytest.mark.parametrize("bad_block", [0, 2, 4])
def test_a_flipped_byte_on_disk_stops_the_load_there_and_the_rest_recomputes(tmp_path, bad_block):
    disk = DiskBackend(tmp_path, 1 << 20)
    reader, reference = _saved(disk)
    path = disk.path(reader.payload_key(reader.block_keys(PROMPT)[bad_block]))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    loaded = reader.load(PROMPT, disk)
    assert loaded.blocks == bad_block and f"block {bad_block}" in loaded.reason and "checksum" in loaded.reason
    result = reader.prefill(PROMPT)
    assert result.reused_tokens == bad_block * SPEC.block_size
    assert (result.logits - reference).abs().max().item() <= 1e-5


def test_a_missing_block_ends_the_reusable_prefix():
    host = HostMemoryBackend(1 << 20)
    reader, reference = _saved(host)
    host.delete(reader.payload_key(reader.block_keys(PROMPT)[3]))
    assert reader.lookup(PROMPT, host).tokens == 12
    assert reader.load(PROMPT, host).blocks == 3
    result = reader.prefill(PROMPT)
    assert result.reused_tokens == 12 and (result.logits - reference).abs().max().item() <= 1e-5


def test_a_full_destination_saves_a_prefix_and_says_so():
    small = HostMemoryBackend(2 * SPEC.block_size * 768)
    writer = ReferenceEngine(SPEC, model=MODEL)
    writer.prefill(PROMPT)
    saved = writer.save(PROMPT, small)
    assert saved.blocks == 2 and "saving stopped at block 2" in saved.reason and "do not fit" in saved.reason
    again = writer.save(PROMPT, small)
    assert again.already_there == 2 and again.blocks == 0


def test_a_pool_too_small_for_the_prompt_keeps_what_fits():
    rt = ReferenceEngine(SPEC, model=MODEL, num_pages=2)
    first = rt.prefill(PROMPT)
    assert first.stored_blocks == 2 and rt.cached_blocks() == 2
    again = rt.prefill(PROMPT)
    assert again.reused_tokens == 8
