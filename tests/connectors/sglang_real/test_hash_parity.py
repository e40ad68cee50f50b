"""NexusKV's SGLang page hash (``connectors.sglang.hashing``) equals SGLang 0.5.23's own.

SGLang computes page keys with its native extension (``mem_cache/cpp_utils/hash_binding.cpp``
through ``get_hash_str``) and its events' block hashes from them (``hash_str_to_int64``); its
radix cache publishes those hashes. The reproduction must match all three, page for page.
"""

from __future__ import annotations

import random
from array import array

import pytest

from connectors.kv_wire import normalise_hash
from connectors.sglang.hashing import event_hash, event_hash_signed, page_hash_hex, page_hashes_hex


@pytest.mark.parametrize("page", [1, 4, 16, 64])
def test_page_chains_match_sglangs_native_hash(page):
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    rng = random.Random(page)
    pages = 0
    for _ in range({1: 20, 4: 10, 16: 5, 64: 3}[page]):
        tokens = [rng.randrange(0, 1 << 32) if rng.random() < 0.05 else rng.randrange(0, 200_000)
                  for _ in range(page * rng.randint(1, 30))]
        prior = rng.choice([None, page_hash_hex(tokens[:page])])
        theirs = get_hash_str(array("q", tokens), prior, page_size=page)
        ours = page_hashes_hex(tokens, page, prior)
        assert ours == list(theirs)
        assert [event_hash_signed(h) for h in ours] == [hash_str_to_int64(h) for h in theirs]
        assert [event_hash(h) for h in ours] == [normalise_hash(hash_str_to_int64(h)) for h in theirs]
        pages += len(ours)
    assert pages >= {1: 200, 4: 100, 16: 50, 64: 30}[page] // 2


def test_bigram_pages_match_sglangs_eagle_hash():
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_hash_str

    rng = random.Random(9)
    for page in (1, 4, 16):
        raw = [rng.randrange(0, 150_000) for _ in range(page * 12 + 1)]
        key = RadixKey(array("q", raw), is_bigram=True)
        theirs = get_hash_str(key, None, page_size=page)
        pairs = [(raw[j], raw[j + 1]) for j in range(len(raw) - 1)]
        ours, prev = [], None
        for i in range(len(pairs) // page):
            prev = page_hash_hex(pairs[i * page:(i + 1) * page], prev)
            ours.append(prev)
        assert ours == list(theirs)


def test_a_radix_cache_publishes_the_hashes_we_compute():
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    page = 8
    device = MHATokenToKVPool(size=1 << 13, page_size=page, dtype=torch.float16, head_num=1, head_dim=4, layer_num=1,
                              device="cpu", enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=1 << 13, page_size=page, dtype=torch.float16, device="cpu",
                                            kvcache=device, need_sort=False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                                       page_size=page, enable_kv_cache_events=True))
    rng = random.Random(5)
    shared = [rng.randrange(0, 150_000) for _ in range(page * 20)]
    checked = 0
    for _ in range(40):
        tokens = shared[: page * rng.randint(0, 20)] + [rng.randrange(0, 150_000) for _ in range(page * rng.randint(1, 25))]
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=allocator.alloc(len(tokens))))
        ours = {event_hash_signed(h) for h in page_hashes_hex(tokens, page)}
        for event in cache.take_events():
            if type(event).__name__ == "BlockStored":
                assert set(event.block_hashes) <= ours
                checked += len(event.block_hashes)
    assert checked >= 500
