"""The HiCache backend inside SGLang 0.5.23's own controllers, on Apache Kafka and NexusKV's tiers.

SGLang's ``StorageBackendFactory`` builds the backend from the README's extra config, its backup
thread writes pages through ``batch_set``/``batch_set_v1``/``batch_set_v2``, its prefetch thread
asks ``batch_exists``/``batch_exists_v2`` and its I/O thread reads the pages back into its host
pool; the tests compare the bytes SGLang ends up with.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from streams.topics import ensure_topics
from tests.connectors.sglang_real import engine

pytestmark = pytest.mark.broker

LLAMA = "meta-llama/Llama-3.1-8B"
README_EXTRA = ('{"backend_name":"nexuskv","module_path":"connectors.sglang.hicache",'
                '"class_name":"NexusKVHiCacheStorage","tier":"remote","tenant":"acme",'
                '"model":"meta-llama/Llama-3.1-8B","hicache_storage_pass_prefix_keys":true}')


@pytest.fixture
def nexuskv_env(kafka_url, remote_tier_address, tmp_path, monkeypatch):
    """SGLang's environment as the README sets it: the bus, the remote tier, the data folder."""
    import asyncio

    asyncio.run(ensure_topics(kafka_url, partitions=8))
    monkeypatch.setenv("NEXUSKV_BROKER", str(kafka_url))
    monkeypatch.setenv("NEXUSKV_REMOTE_TIER", remote_tier_address)
    monkeypatch.setenv("NEXUSKV_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_readme_config_pages_round_trip_through_sglang(nexuskv_env):
    """Fixes 1 and 9: the README's flags start (no page_size given, --file-storage-path added), and pages
    SGLang's backup thread writes come back byte-equal through its prefetch threads."""
    page, n = 16, 10  # 10 pages of Llama-3.1-8B (20 MiB): what the shipped H200 profile says is worth loading
    pools = engine.mha_pools(layers=32, heads=8, head_dim=128, page=page, tokens=2 * n * page)
    extra = engine.readme_extra_config(README_EXTRA.replace("acme", f"acme-{uuid.uuid4().hex[:6]}"),
                                       file_storage_path=str(nexuskv_env / "sglang-files"))
    assert "page_size" not in extra and extra["file_storage_path"]
    controller = engine.hybrid_controller(pools, extra, model_name=LLAMA)
    try:
        backend = controller.storage_backend
        assert type(backend).__name__ == "NexusKVHiCacheStorage"
        assert backend.config.descriptor.block_size == page
        rounds = 0
        for r in range(4):
            tokens = _tokens(n * page, seed=r)
            hashes = engine.page_hashes(tokens, page)
            indices, pages = engine.fill_host(pools.host, n, seed=100 + r)
            op = engine.backup(controller, indices, tokens, hashes)
            assert op.completed_tokens == n * page
            pools.host.free(indices)
            backend._bus.wait_caught_up()
            got, loaded = engine.prefetch(controller, tokens, rid=f"r{r}")
            assert got.storage_hit_count == n * page and got.completed_tokens == n * page
            assert all(torch.equal(engine.host_page(pools.host, loaded, i), pages[i]) for i in range(n))
            pools.host.free(loaded)
            rounds += 1
        assert rounds == 4 and backend.core.stats["hits"] == 4 * n
    finally:
        engine.stop(controller)


def _round_trip(controller, pools, tokens, pages_seed, *, rid, prefix=None, last_hash=None):
    """Write ``tokens``' pages through SGLang's backup thread and read them back; (written, read) pages."""
    page = pools.page_size
    n = len(tokens) // page
    hashes = engine.page_hashes(tokens, page, last_hash)
    indices, pages = engine.fill_host(pools.host, n, seed=pages_seed)
    assert engine.backup(controller, indices, tokens, hashes).completed_tokens == n * page
    pools.host.free(indices)
    controller.storage_backend._bus.wait_caught_up()
    op, loaded = engine.prefetch(controller, tokens, rid=rid, last_hash=last_hash, prefix_keys=prefix)
    read = [engine.host_page(pools.host, loaded, i) for i in range(op.storage_hit_count // page)] if loaded is not None \
        else []
    if loaded is not None:
        pools.host.free(loaded)
    return pages, read, op


def test_tensor_parallel_ranks_keep_their_own_shards(nexuskv_env):
    """Fix 2: two TP ranks of an MHA/GQA model on the shared remote tier, from the README's config
    (``model=`` alone): each starts with its own shard descriptor, neither reads the other's pages."""
    page, n = 16, 10
    extra = engine.readme_extra_config(README_EXTRA.replace("acme", f"acme-{uuid.uuid4().hex[:6]}"))
    ranks = []
    try:
        for r in range(2):
            pools = engine.mha_pools(layers=32, heads=4, head_dim=128, page=page, tokens=2 * n * page)
            ranks.append((engine.hybrid_controller(pools, extra, model_name=LLAMA, tp_rank=r, tp_size=2), pools))
        (c0, p0), (c1, p1) = ranks
        d0, d1 = c0.storage_backend.config.descriptor, c1.storage_backend.config.descriptor
        assert (d0.parallel.tp_rank, d1.parallel.tp_rank) == (0, 1) and d0.descriptor_id != d1.descriptor_id
        assert c0.storage_backend.config.worker.endswith("/tp0") and c1.storage_backend.config.worker.endswith("/tp1")
        tokens = _tokens(n * page, seed=7)
        written0, read0, _ = _round_trip(c0, p0, tokens, 1, rid="tp0-a")
        assert len(read0) == n and all(torch.equal(a, b) for a, b in zip(written0, read0))
        c1.storage_backend._bus.wait_caught_up()
        op, _ = engine.prefetch(c1, tokens, rid="tp1-before", load=False)
        assert op.storage_hit_count == 0  # rank 0's shard is not rank 1's
        written1, read1, _ = _round_trip(c1, p1, tokens, 2, rid="tp1-a")
        assert len(read1) == n and all(torch.equal(a, b) for a, b in zip(written1, read1))
        assert not any(torch.equal(a, b) for a, b in zip(written0, read1))
        _, again0, _ = _round_trip(c0, p0, tokens, 1, rid="tp0-b")  # rank 0 still reads its own bytes
        assert all(torch.equal(a, b) for a, b in zip(written0, again0))
    finally:
        for controller, _ in ranks:
            engine.stop(controller)


def test_mla_ranks_read_what_the_writer_rank_stored_on_disk(nexuskv_env):
    """Fix 3 (and fix 10's direct path): an MLA model at TP=2 on the disk tier. SGLang writes from rank
    0 only; rank 1 finds and reads those pages, straight into its page_first host pool (interface_v1)."""
    page, n = 16, 6
    extra = {"backend_name": "nexuskv", "module_path": "connectors.sglang.hicache",
             "class_name": "NexusKVHiCacheStorage", "tier": "disk", "tenant": f"mla-{uuid.uuid4().hex[:6]}",
             "model": "deepseek-ai/DeepSeek-V3", "interface_v1": True}
    ranks = []
    try:
        for r in range(2):
            pools = engine.mla_pools(layers=61, kv_lora_rank=512, rope_dim=64, page=page, tokens=2 * n * page,
                                     layout="page_first")
            ranks.append((engine.hybrid_controller(pools, extra, model_name="deepseek-ai/DeepSeek-V3",
                                                   tp_rank=r, tp_size=2), pools))
        (c0, p0), (c1, p1) = ranks
        b0, b1 = c0.storage_backend, c1.storage_backend
        assert c0.page_get_func == c0._page_get_zero_copy  # SGLang took the v1 path
        assert b0.config.descriptor.descriptor_id == b1.config.descriptor.descriptor_id  # replicated state
        assert b1.config.owner == b0.config.worker
        tokens = _tokens(n * page, seed=11)
        hashes = engine.page_hashes(tokens, page)
        i0, pages = engine.fill_host(p0.host, n, seed=3)
        i1, _ = engine.fill_host(p1.host, n, seed=4)  # rank 1's copy; SGLang skips its backup
        assert engine.backup(c0, i0, tokens, hashes).completed_tokens == n * page
        engine.backup(c1, i1, tokens, hashes)
        p0.host.free(i0)
        p1.host.free(i1)
        assert b1.core.pages() == 0 and b0.core.pages() == n
        b1._bus.wait_caught_up()
        op, loaded = engine.prefetch(c1, tokens, rid="mla-tp1")
        assert op.storage_hit_count == n * page and op.completed_tokens == n * page
        assert all(torch.equal(engine.host_page(p1.host, loaded, i), pages[i]) for i in range(n))
    finally:
        for controller, _ in ranks:
            engine.stop(controller)
