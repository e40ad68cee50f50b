"""The SGLang HiCache storage backend's core: data-plane pages, index-gated existence, no stale reads.

Acceptance: pages round-trip through each tier; ``exists`` and ``batch_exists`` agree with the
index; a page evicted elsewhere reads as a miss, never as stale data. Page keys are SGLang's own
page hashes of real token ids.
"""

from __future__ import annotations

import pytest
import torch

from connectors.sglang.hashing import page_hashes_hex
from connectors.sglang.hicache_core import HiCacheCore, page_scope
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.dataplane import BackendCatalog, DeviceMemoryBackend, DiskBackend, HostMemoryBackend, RemoteBackend
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.descriptor import DType, Tier
from nexuskv.index import GlobalIndex
from nexuskv.models import gqa_descriptor
from tests.connectors.reference import POLICY, PROFILE, cost_model, slow_links

PAGE = 4
DESC = gqa_descriptor(model="test/tiny-sglang", num_layers=2, num_kv_heads=2, head_dim=8, block_size=PAGE,
                      dtype=DType.FLOAT16, engine_family="sglang", tenant_namespace="hicache-test")
TOKENS = torch.randint(0, 32_000, (6 * PAGE,), generator=torch.Generator().manual_seed(3)).tolist()
KEYS = page_hashes_hex(TOKENS, PAGE)
PAGE_SHAPE = (2, 2, PAGE, 2, 8)  # layers, K|V, tokens, heads, head dim


def _page(i: int) -> torch.Tensor:
    return torch.randn(PAGE_SHAPE, generator=torch.Generator().manual_seed(100 + i)).to(torch.float16)


class _Index:
    """The index the backends publish into, with a switch to lose batches (a gap)."""

    def __init__(self) -> None:
        self.index = GlobalIndex()
        self.drop_next = False

    def publish(self, batch: KvEventBatch) -> None:
        if self.drop_next:
            self.drop_next = False
            return
        assert self.index.apply(batch).status == "applied"

    def present(self, key: str, worker: str, tier: Tier, core: HiCacheCore) -> bool:
        found = self.index.lookup(page_scope(DESC), [core.canonical(key)])
        return any(m.location.worker == worker and m.location.tier is tier and m.certain and m.prefix_blocks
                   for m in found.matches)


def _core(feed: _Index, worker: str, backends, *, model=None) -> HiCacheCore:
    cost = model or cost_model(DESC)
    tier = backends[0].capabilities.tier
    return HiCacheCore(DESC, worker=worker, catalog=BackendCatalog(worker, backends), tier=tier, index=feed.index,
                       publish=feed.publish, model=lambda: cost, execution=lambda: POLICY, profile=PROFILE)


@pytest.fixture(params=["device", "host", "disk", "remote"])
def tier_backend(request, tmp_path):
    if request.param == "device":
        return DeviceMemoryBackend(1 << 22)
    if request.param == "host":
        return HostMemoryBackend(1 << 22)
    if request.param == "disk":
        return DiskBackend(tmp_path / "disk", 1 << 22)
    return RemoteBackend(request.getfixturevalue("remote_tier_address"))


def test_pages_round_trip_through_each_tier(tier_backend):
    feed = _Index()
    tier = tier_backend.capabilities.tier
    core = _core(feed, f"sglang-hicache/rt-{tier.value}", [tier_backend])
    offset = [Tier.GPU, Tier.HOST, Tier.DISK, Tier.REMOTE].index(tier) + 11
    keys = page_hashes_hex([(t + offset) % 32_000 for t in TOKENS], PAGE)  # pages of their own on the shared tier
    for i, key in enumerate(keys[:3]):
        assert core.set(key, _page(i))
    for i, key in enumerate(keys[:3]):
        got = core.get(key)
        assert got is not None and got.dtype == torch.float16 and torch.equal(got, _page(i))
        target = torch.empty(PAGE_SHAPE, dtype=torch.float16)
        assert core.get(key, target) is target and torch.equal(target, _page(i))
        assert core.exists(key)
    assert core.batch_exists(keys) == 3
    assert core.get(keys[4]) is None and not core.exists(keys[4])
    core.clear()
    assert core.batch_exists(keys) == 0 and core.get(keys[0]) is None


def test_exists_and_batch_exists_agree_with_the_index():
    feed = _Index()
    core = _core(feed, "sglang-hicache/a", [HostMemoryBackend(1 << 22)])
    for i in (0, 1, 3, 4):
        assert core.set(KEYS[i], _page(i))
    truth = [feed.present(k, core.worker, Tier.HOST, core) for k in KEYS]
    assert truth == [True, True, False, True, True, False]
    assert [core.exists(k) for k in KEYS] == truth
    assert core.batch_exists(KEYS) == 2  # consecutive from the first
    assert core.batch_exists(KEYS[3:]) == 2
    assert core.delete(KEYS[1]) and not core.delete(KEYS[2])
    assert not feed.present(KEYS[1], core.worker, Tier.HOST, core)
    assert [core.exists(k) for k in KEYS] == [True, False, False, True, True, False]
    assert core.batch_exists(KEYS) == 1


def test_a_gap_in_the_backends_facts_makes_its_pages_misses():
    feed = _Index()
    core = _core(feed, "sglang-hicache/gap", [HostMemoryBackend(1 << 22)])
    assert core.set(KEYS[0], _page(0))
    feed.drop_next = True
    assert core.set(KEYS[1], _page(1))  # its stored event is lost
    assert core.set(KEYS[2], _page(2))  # the index sees a sequence gap: the publisher is uncertain
    assert [core.exists(k) for k in KEYS[:3]] == [False, False, False]
    assert core.get(KEYS[0]) is None  # the bytes are there; the index does not vouch for them
    assert core.batch_exists(KEYS) == 0


def test_a_page_evicted_elsewhere_reads_as_a_miss(remote_tier_address):
    feed = _Index()
    a = _core(feed, "sglang-hicache/evict-a", [RemoteBackend(remote_tier_address)])
    b = _core(feed, "sglang-hicache/evict-b", [RemoteBackend(remote_tier_address)])
    keys = page_hashes_hex([(t * 7 + 1) % 32_000 for t in TOKENS], PAGE)
    for i, key in enumerate(keys[:4]):
        assert a.set(key, _page(i))
    target = torch.empty(PAGE_SHAPE, dtype=torch.float16)
    assert b.get(keys[0], target) is target  # the shared remote tier: another worker reads what a stored
    assert torch.equal(target, _page(0)) and b.batch_exists(keys) == 4

    assert a.delete(keys[0])  # a evicts it: payload and fact go
    assert not b.exists(keys[0]) and b.get(keys[0]) is None

    pk = PayloadKey(DESC.descriptor_id, a.canonical(keys[1]), 0)
    assert RemoteBackend(remote_tier_address).delete(pk)  # gone behind the index's back
    assert b.exists(keys[1])  # the index still says so ...
    assert b.get(keys[1]) is None  # ... but a read misses, it never returns something else
    assert a.get(keys[1]) is None  # its owner finds it gone and withdraws the fact
    assert not b.exists(keys[1])

    restarted = _core(feed, a.worker, [RemoteBackend(remote_tier_address)])  # a new incarnation of a
    assert restarted.pages() == 0
    assert not b.exists(keys[2]) and b.get(keys[2]) is None  # bytes still there, facts dropped: a miss
    assert b.stats["stale_or_missing"] >= 1


def test_a_corrupt_page_is_a_miss_and_its_fact_is_withdrawn(tmp_path):
    feed = _Index()
    disk = DiskBackend(tmp_path / "disk", 1 << 22)
    core = _core(feed, "sglang-hicache/corrupt", [disk])
    assert core.set(KEYS[0], _page(0))
    path = disk.path(PayloadKey(DESC.descriptor_id, core.canonical(KEYS[0]), 0))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    assert core.exists(KEYS[0])
    assert core.get(KEYS[0]) is None
    assert not core.exists(KEYS[0]) and core.pages() == 0


def test_batch_exists_is_gated_by_the_planner():
    feed = _Index()
    slow = _core(feed, "sglang-hicache/slow", [HostMemoryBackend(1 << 22)], model=slow_links(DESC))
    for i in range(3):
        assert slow.set(KEYS[i], _page(i))
    assert all(slow.exists(k) for k in KEYS[:3])
    assert slow.batch_exists(KEYS) == 0  # loading is slower than recomputing: SGLang recomputes
    assert slow.stats["gated_by_planner"] == 1
    other = gqa_descriptor(model="test/unprofiled", num_layers=2, num_kv_heads=2, head_dim=8, block_size=PAGE)
    unprofiled = _core(feed, "sglang-hicache/unprofiled", [HostMemoryBackend(1 << 22)], model=cost_model(other))
    for i in range(3):
        assert unprofiled.set(KEYS[i], _page(i))
    assert unprofiled.batch_exists(KEYS) == 3  # no cost profile for the model: the index alone decides


def test_a_full_tier_evicts_the_backends_least_recently_used_pages():
    feed = _Index()
    nbytes = _page(0).numel() * 2
    core = _core(feed, "sglang-hicache/small", [HostMemoryBackend(2 * nbytes)])
    assert core.set(KEYS[0], _page(0)) and core.set(KEYS[1], _page(1))
    assert core.get(KEYS[0]) is not None  # page 0 is now the most recently used
    assert core.set(KEYS[2], _page(2))
    assert [core.exists(k) for k in KEYS[:3]] == [True, False, True]
    assert core.stats["evicted"] == 1 and core.pages() == 2
