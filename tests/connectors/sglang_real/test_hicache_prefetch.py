"""A prefetch ``batch_exists`` promised is loaded from that answer, inside SGLang 0.5.23's own controllers.

SGLang's prefetch thread asks ``batch_exists`` and its I/O thread then reads the pages
(``batch_get`` here, in batches of ``STORAGE_BATCH_SIZE``). The backend asks the node's index
sidecar once for the promise and never again per page (the index client's budget made a late
per-page answer a miss, so 31 and 9 of 136 promised pages were loaded). A page whose bytes fail
their checksum is the one exception: SGLang loads the pages before it and recomputes from it.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch

from streams.bus.topics import ensure_topics

from tests.connectors.sglang_real import engine

pytestmark = pytest.mark.broker
PAGE, PAGES = 4, 136


class CountingIndex:
    """The backend's index client, counting the asks that reach it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.asks = 0

    def lookup(self, *args, **kwargs):
        self.asks += 1
        return self.inner.lookup(*args, **kwargs)


@pytest.fixture
def nexuskv_env(kafka_url, tmp_path, monkeypatch, index_sidecar):
    asyncio.run(ensure_topics(kafka_url, partitions=8))
    monkeypatch.setenv("NEXUSKV_BROKER", str(kafka_url))
    monkeypatch.delenv("NEXUSKV_REMOTE_TIER", raising=False)
    monkeypatch.setenv("NEXUSKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NEXUSKV_INDEX_SOCKET", str(index_sidecar.socket))
    return tmp_path


def _controller(kind: str, tmp_path):
    from nexuskv.descriptor import DType
    from nexuskv.models import gqa_descriptor

    d = gqa_descriptor(model="test/tiny-sglang", num_layers=2, num_kv_heads=2, head_dim=16, block_size=PAGE,
                       dtype=DType.BFLOAT16, engine_family="sglang")  # no cost profile: gated by the index alone
    path = tmp_path / "tiny.json"
    path.write_text(d.model_dump_json())
    extra = {"backend_name": "nexuskv", "module_path": "connectors.sglang.hicache",
             "class_name": "NexusKVHiCacheStorage", "tenant": f"promise-{uuid.uuid4().hex[:6]}", "tier": "disk",
             "descriptor": str(path)}
    pools = engine.mha_pools(layers=2, heads=2, head_dim=16, page=PAGE, tokens=2 * PAGES * PAGE)
    build = engine.hybrid_controller if kind == "hybrid" else engine.batching_controller
    return build(pools, extra), pools


def _store(controller, pools, seed: int):
    tokens = torch.randint(0, 128_000, (PAGES * PAGE,), generator=torch.Generator().manual_seed(seed)).tolist()
    hashes = engine.page_hashes(tokens, PAGE)
    indices, pages = engine.fill_host(pools.host, PAGES, seed=seed)
    assert engine.backup(controller, indices, tokens, hashes).completed_tokens == PAGES * PAGE
    pools.host.free(indices)
    controller.storage_backend._bus.index.wait_caught_up()
    return tokens, hashes, pages


@pytest.mark.parametrize("kind, asks", [("hybrid", 1), ("batching", 2)],
                         ids=["HybridCacheController", "HiCacheController"])
def test_a_promised_prefetch_loads_every_page_on_one_ask(nexuskv_env, kind, asks):
    """136 pages: one ask per ``batch_exists`` call SGLang makes (the hybrid controller asks for the
    whole span, the batching one 128 pages at a time), none while its I/O thread reads them."""
    controller, pools = _controller(kind, nexuskv_env)
    try:
        backend = controller.storage_backend
        tokens, _hashes, pages = _store(controller, pools, seed=1)
        counting = backend.core.index = CountingIndex(backend.core.index)
        op, loaded = engine.prefetch(controller, tokens, rid=f"promised-{kind}")
        assert op.storage_hit_count == PAGES * PAGE and op.completed_tokens == PAGES * PAGE
        assert all(torch.equal(engine.host_page(pools.host, loaded, i), pages[i]) for i in range(PAGES))
        assert counting.asks == asks, backend.core.stats
        stats = backend.core.stats
        assert stats["read_on_promise"] == PAGES and stats["asked_at_read"] == 0 and stats["hits"] == PAGES
    finally:
        engine.stop(controller)


def test_a_page_failing_its_checksum_is_recomputed_from_there(nexuskv_env):
    """Page 50's bytes are corrupted on disk after ``batch_exists`` could promise it: SGLang loads
    pages 0-49 from the promise, recomputes from 50 (nothing after it is read), nothing is asked
    again; the corrupt page's fact is withdrawn, so the next prefetch is promised 50 pages."""
    from connectors.sglang.hicache_core import folder_of
    from nexuskv.dataplane.disk import payload_file
    from nexuskv.dataplane.payload import HEADER_BYTES

    controller, pools = _controller("hybrid", nexuskv_env)
    try:
        backend = controller.storage_backend
        core = backend.core
        tokens, hashes, pages = _store(controller, pools, seed=2)
        path = Path(payload_file(folder_of(nexuskv_env / "data", core.worker),
                                 core._payload_key(core.canonical(hashes[50]))))
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 7] ^= 0xFF
        path.write_bytes(bytes(raw))
        counting = core.index = CountingIndex(core.index)
        op, loaded = engine.prefetch(controller, tokens, rid="corrupt")
        assert op.storage_hit_count == PAGES * PAGE  # promised in full: batch_exists reads no bytes
        assert op.completed_tokens == 50 * PAGE  # loaded up to the corrupt page, recomputed from it
        assert all(torch.equal(engine.host_page(pools.host, loaded, i), pages[i]) for i in range(50))
        assert counting.asks == 1 and core.stats["asked_at_read"] == 0
        assert core.stats["stale_or_missing"] == 1 and core.stats["hits"] == 50  # page 51 on was not read
        pools.host.free(loaded)

        backend._bus.index.wait_caught_up()  # the withdrawn fact reaches the sidecar
        again, _ = engine.prefetch(controller, tokens, rid="after", load=False)
        assert again.storage_hit_count == 50 * PAGE
    finally:
        engine.stop(controller)
