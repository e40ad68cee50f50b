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

from streams.bus.topics import ensure_topics

from tests.connectors.sglang_real import engine

pytestmark = pytest.mark.broker

LLAMA = "meta-llama/Llama-3.1-8B"
README_EXTRA = ('{"backend_name":"nexuskv","module_path":"connectors.sglang.hicache",'
                '"class_name":"NexusKVHiCacheStorage","tier":"remote","tenant":"acme",'
                '"model":"meta-llama/Llama-3.1-8B","hicache_storage_pass_prefix_keys":true}')


@pytest.fixture
def nexuskv_env(kafka_url, remote_tier_address, tmp_path, monkeypatch, index_sidecar):
    """SGLang's environment as the README sets it: the bus, the remote tier, the data folder, the
    node's index sidecar (which the backend asks)."""
    import asyncio

    asyncio.run(ensure_topics(kafka_url, partitions=8))
    monkeypatch.setenv("NEXUSKV_BROKER", str(kafka_url))
    monkeypatch.setenv("NEXUSKV_REMOTE_TIER", remote_tier_address)
    monkeypatch.setenv("NEXUSKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NEXUSKV_INDEX_SOCKET", str(index_sidecar.socket))
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
            backend._bus.index.wait_caught_up()
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
    controller.storage_backend._bus.index.wait_caught_up()
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
        c1.storage_backend._bus.index.wait_caught_up()
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
        b1._bus.index.wait_caught_up()
        op, loaded = engine.prefetch(c1, tokens, rid="mla-tp1")
        assert op.storage_hit_count == n * page and op.completed_tokens == n * page
        assert all(torch.equal(engine.host_page(p1.host, loaded, i), pages[i]) for i in range(n))
    finally:
        for controller, _ in ranks:
            engine.stop(controller)


def _tiny_descriptor(path, *, page: int, layers: int = 2, heads: int = 2, head_dim: int = 16,
                     model: str = "test/tiny-sglang"):
    from nexuskv.descriptor import DType
    from nexuskv.models import gqa_descriptor

    d = gqa_descriptor(model=model, num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=page,
                       dtype=DType.BFLOAT16, engine_family="sglang")
    path.write_text(d.model_dump_json())
    return str(path)


def _extra(**keys):
    return {"backend_name": "nexuskv", "module_path": "connectors.sglang.hicache",
            "class_name": "NexusKVHiCacheStorage", "tenant": f"t-{uuid.uuid4().hex[:6]}", **keys}


def test_hybrid_model_side_pool_pages_round_trip_through_the_v2_calls(nexuskv_env):
    """Fix 5: a hybrid (sliding-window) model. SGLang's hybrid controller backs up the KV pages and the
    SWA pool's trailing window with ``batch_set_v2``, checks both with ``batch_exists_v2`` and reads
    the window back with ``batch_get_v2``."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    page, n, window = 4, 6, 2
    pools = engine.mha_pools(layers=2, heads=2, head_dim=16, page=page, tokens=4 * n * page)
    engine.add_swa_pool(pools, layers=1)
    extra = _extra(tier="remote", descriptor=_tiny_descriptor(nexuskv_env / "tiny.json", page=page))
    controller = engine.hybrid_controller(pools, extra)
    try:
        backend = controller.storage_backend
        swa = pools.extra["swa"][0]
        tokens = _tokens(n * page, seed=21)
        hashes = engine.page_hashes(tokens, page)
        kv_indices, kv_pages = engine.fill_host(pools.host, n, seed=5)
        swa_indices, swa_pages = engine.fill_host(swa, window, seed=6)
        sidecar = PoolTransfer(name=PoolName.SWA, host_indices=swa_indices, keys=hashes[-window:],
                               hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert engine.backup(controller, kv_indices, tokens, hashes, extra_pools=[sidecar]).completed_tokens \
            == n * page
        pools.host.free(kv_indices)
        swa.free(swa_indices)
        backend._bus.index.wait_caught_up()
        ask = PoolTransfer(name=PoolName.SWA, keys=hashes[-window:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        op, loaded = engine.prefetch(controller, tokens, rid="swa", pool_transfers=[ask])
        assert op.storage_hit_count == n * page
        assert all(torch.equal(engine.host_page(pools.host, loaded, i), kv_pages[i]) for i in range(n))
        got_swa = [engine.host_page(swa, ask.host_indices, i) for i in range(window)]
        assert all(torch.equal(a, b) for a, b in zip(got_swa, swa_pages))

        # The window is what makes a prefix restorable: without its pages, SGLang's query finds none.
        other = _tokens(n * page, seed=22)
        other_hashes = engine.page_hashes(other, page)
        kv2, _ = engine.fill_host(pools.host, n, seed=7)
        assert engine.backup(controller, kv2, other, other_hashes).completed_tokens == n * page  # no SWA pages
        pools.host.free(kv2)
        backend._bus.index.wait_caught_up()
        ask2 = PoolTransfer(name=PoolName.SWA, keys=other_hashes[-window:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        op2, _ = engine.prefetch(controller, other, rid="swa-missing", pool_transfers=[ask2], load=False)
        assert op2.storage_hit_count == 0
    finally:
        engine.stop(controller)


def test_interface_v1_pages_round_trip_through_a_staging_page(nexuskv_env):
    """Fix 10: ``interface_v1`` on a layer_first host pool, whose pages are not contiguous (one copy
    through a staging page); the v1 and the generic paths store the same bytes."""
    page, n = 4, 5
    pools = engine.mha_pools(layers=2, heads=2, head_dim=16, page=page, tokens=4 * n * page)
    descriptor = _tiny_descriptor(nexuskv_env / "tiny.json", page=page)
    tenant = f"v1-{uuid.uuid4().hex[:6]}"
    v1 = engine.hybrid_controller(pools, _extra(tier="remote", descriptor=descriptor, tenant=tenant,
                                                interface_v1=1, worker="sglang-v1"))
    generic_pools = engine.mha_pools(layers=2, heads=2, head_dim=16, page=page, tokens=4 * n * page)
    generic = engine.hybrid_controller(generic_pools, _extra(tier="remote", descriptor=descriptor, tenant=tenant,
                                                             worker="sglang-generic"))  # two servers, two names
    try:
        assert v1.page_set_func == v1._page_set_zero_copy and generic.page_set_func == generic._generic_page_set
        tokens = _tokens(n * page, seed=31)
        written, read, _ = _round_trip(v1, pools, tokens, 8, rid="v1")
        assert len(read) == n and all(torch.equal(a, b) for a, b in zip(written, read))
        generic.storage_backend._bus.index.wait_caught_up()
        op, loaded = engine.prefetch(generic, tokens, rid="generic-reads-v1")
        assert op.storage_hit_count == n * page
        assert all(torch.equal(engine.host_page(generic_pools.host, loaded, i), written[i]) for i in range(n))
    finally:
        engine.stop(v1)
        engine.stop(generic)


def test_the_default_disk_tier_is_read_when_sglang_will_load_the_whole_prefetch(nexuskv_env, monkeypatch):
    """Fix 8: with the shipped H200 profile, 16 pages of Llama-3.1-8B (4 tokens a page) on the default
    disk tier do not pay priced alone from token 0 — the old gate — but do after the 16 pages SGLang
    already holds (``prefix_keys``); SGLang's batching controller asks 128 pages at a time, and its
    full batch is priced as the prefetch it starts, the rest in its context."""
    monkeypatch.delenv("NEXUSKV_REMOTE_TIER")
    page, n, ctx = 4, 16, 16
    pools = engine.mha_pools(layers=32, heads=8, head_dim=128, page=page, tokens=200 * page)
    extra = engine.readme_extra_config(json.dumps({k: v for k, v in json.loads(README_EXTRA).items() if k != "tier"}
                                                  | {"tenant": f"gate-{uuid.uuid4().hex[:6]}"}))
    controller = engine.hybrid_controller(pools, extra, model_name=LLAMA)
    try:
        backend = controller.storage_backend
        assert backend.config.tier.value == "disk"
        prefix_tokens = _tokens(ctx * page, seed=41)
        prefix = engine.page_hashes(prefix_tokens, page)
        tokens = _tokens(n * page, seed=42)
        written, read, op = _round_trip(controller, pools, tokens, 9, rid="ctx", prefix=prefix, last_hash=prefix[-1])
        assert op.storage_hit_count == n * page and all(torch.equal(a, b) for a, b in zip(written, read))
        canonicals, holders, count = backend.core.readable_run(engine.page_hashes(tokens, page, prefix[-1]))
        assert count == n and backend.core.gate(canonicals, holders) == 0  # the batch alone, from token 0
        op0, _ = engine.prefetch(controller, tokens, rid="no-context", last_hash=prefix[-1], load=False)
        assert op0.storage_hit_count == 0  # SGLang passing no prefix keys: priced from token 0
    finally:
        engine.stop(controller)

    batching = engine.batching_controller(pools, extra, model_name=LLAMA)
    try:
        backend = batching.storage_backend
        long_prefix = engine.page_hashes(_tokens(128 * page, seed=44), page)  # 128 pages held by SGLang
        long_tokens = _tokens(192 * page, seed=43)
        written, read, op = _round_trip(batching, pools, long_tokens, 10, rid="batched", prefix=long_prefix,
                                        last_hash=long_prefix[-1])
        assert op.storage_hit_count == 192 * page, backend.core.stats  # a full batch of 128, then 64
        assert all(torch.equal(a, b) for a, b in zip(written, read))
        assert backend.core.stats["answered_ahead"] == 1
    finally:
        engine.stop(batching)
