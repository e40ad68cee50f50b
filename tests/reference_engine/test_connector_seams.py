"""The reference engine's seams for a KV connector: paged KV views, blocks allocated then filled."""

from __future__ import annotations

import pytest
import torch

from nexuskv.contracts.keyed_events import KeyedBatch, KeyedStored, TierStored, unpack_hashes
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec

PROMPT = list(range(1, 27))  # 6 full blocks of 4


def _runtime(**kw) -> tuple[ReferenceEngine, list[KeyedBatch]]:
    batches: list[KeyedBatch] = []
    rt = ReferenceEngine(ReferenceModelSpec.gqa(), publisher=lambda r: batches.append(r) if isinstance(r, KeyedBatch)
                          else None, **kw)
    return rt, batches


def test_kv_cache_views_are_the_pages():
    rt, _ = _runtime()
    rt.prefill(PROMPT)
    caches = rt.kv_caches()
    assert list(caches) == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    page = rt.block_ids(PROMPT, 1)[0]
    block = torch.cat([c[page].reshape(-1) for c in caches.values()]).view(torch.uint8)
    assert torch.equal(block, rt.pages.bytes_of(page))  # a block over every layer is the page's payload
    assert rt.computed_tokens(PROMPT) == 24 and rt.block_ids(PROMPT + [9] * 8, 8) is None


def test_allocated_blocks_are_announced_only_when_adopted():
    rt, batches = _runtime()
    pages = rt.allocate_blocks(PROMPT, 0, 3)
    assert len(pages) == 3 and batches == []
    with pytest.raises(ValueError, match="cached already"):
        rt.allocate_blocks(PROMPT, 2, 4)
    rt.adopt_blocks(PROMPT, 0, 2)
    rt.release_blocks(PROMPT, 2, 3)
    (stored,) = batches[-1].events
    # Keyed by the runtime (no token ids on the bus): the keys of the prompt's first two blocks.
    assert isinstance(stored, KeyedStored) and len(stored) == 2 and stored.token_ids is None
    assert stored.keys == b"".join(BlockKeyer(rt.scope, rt.block_size).digests(PROMPT[:8]))
    assert rt.computed_tokens(PROMPT) == 8  # the adopted blocks are cache hits, the released one is gone
    rt.announce_copies(unpack_hashes(stored.engine_hashes), Tier.DISK)
    (copy,) = batches[-1].events
    assert copy.tier is Tier.DISK and isinstance(copy, TierStored)


def test_allocation_that_does_not_fit_gives_back_what_it_took():
    rt, _ = _runtime(num_pages=4)
    assert rt.allocate_blocks(PROMPT, 0, 6) is None  # six pinned pages do not fit in four
    assert rt.cached_blocks() == 0 and rt.allocate_blocks(PROMPT, 0, 4) is not None
