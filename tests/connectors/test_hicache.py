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
    assert all(page is not None for page in b.get_many(keys[:4]))  # SGLang reads what batch_exists promised
    assert b.stats["read_on_promise"] == 4

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


def test_a_full_tier_makes_room_by_utility_and_refuses_what_is_worth_less():
    feed = _Index()
    nbytes = _page(0).numel() * 2
    core = _core(feed, "sglang-hicache/small", [HostMemoryBackend(2 * nbytes)])
    assert core.set(KEYS[0], _page(0)) and core.set(KEYS[1], _page(1))
    assert core.get(KEYS[0]) is not None  # page 0 was read again: worth more than page 1
    assert core.set(KEYS[2], _page(2))  # the tier is full: page 1, the cheapest, leaves
    assert [core.exists(k) for k in KEYS[:3]] == [True, False, True]
    assert core.stats["evicted"] == 1 and core.pages() == 2
    for _ in range(3):  # both pages are read again and again
        assert core.get(KEYS[0]) is not None and core.get(KEYS[2]) is not None
    assert not core.set(KEYS[3], _page(3))  # a page never read is worth less than either: refused, and said
    assert core.stats["set_refused"] == 1 and [core.exists(k) for k in (KEYS[0], KEYS[2], KEYS[3])] == [True, True,
                                                                                                       False]
    held = {k.key for k in core.catalog.backends[0].keys()}
    facts = {key for (pub, tier, _g), members in feed.index.facts().items() if pub == core.worker
             for _scope, key in members}
    assert held == facts == {core.canonical(KEYS[0]), core.canonical(KEYS[2])}


def test_a_batch_of_pages_is_announced_in_one_batch():
    feed = _Index()
    published = []
    core = _core(feed, "sglang-hicache/batch", [HostMemoryBackend(1 << 22)])
    core.publish = lambda b: (published.append(b), feed.publish(b))
    assert core.set_many([(KEYS[i], _page(i)) for i in range(4)]) == [True] * 4
    assert len(published) == 1 and sum(len(e) for e in published[0].events) == 4
    assert core.batch_exists(KEYS) == 4


def test_a_reader_rank_reads_the_writers_disk_folder(tmp_path):
    """An MLA model's replicated pages: the writer rank stores them, another rank reads its folder."""
    from connectors.sglang.hicache_core import FolderSource

    feed = _Index()
    writer = _core(feed, "sglang-hicache/h/tp0", [DiskBackend(tmp_path / "tp0", 1 << 22)])
    reader = HiCacheCore(DESC, worker="sglang-hicache/h/tp1", catalog=BackendCatalog(
        "sglang-hicache/h/tp1", [DiskBackend(tmp_path / "tp1", 1 << 22)]), tier=Tier.DISK, index=feed.index,
        publish=feed.publish, model=lambda: cost_model(DESC), execution=lambda: POLICY, profile=PROFILE,
        owner=writer.worker, owner_source=FolderSource(tmp_path / "tp0"))
    assert writer.set_many([(KEYS[i], _page(i)) for i in range(3)]) == [True] * 3
    assert reader.batch_exists(KEYS) == 3
    target = torch.empty(PAGE_SHAPE, dtype=torch.float16)
    assert reader.get(KEYS[1], target) is target and torch.equal(target, _page(1))
    path = writer.catalog.backends[0].path(PayloadKey(DESC.descriptor_id, writer.canonical(KEYS[2]), 0))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert reader.get(KEYS[2], target) is None  # verified on read: a corrupt file is a miss
    stranger = _core(feed, "sglang-hicache/h/tp2", [DiskBackend(tmp_path / "tp2", 1 << 22)])
    assert stranger.batch_exists(KEYS) == 0  # a rank that does not read the writer's folder


def _fixed_cost_model(latency_s: float):
    """Loading pays only in bulk: every transfer costs ``latency_s``, a page 10 us; recomputing a page 1 ms."""
    from nexuskv.cost import ComputeCost, CostModel, HardwareProfile, LinearCost, LinkCost

    hw = HardwareProfile(name=PROFILE, hbm_bytes_per_s=1e11, prefill_chunk_tokens=2048, lookup_s=1e-5, sync_s=1e-5,
                         label="test")
    compute = ComputeCost(model=DESC.model, profile=PROFILE, source="test",
                          params=LinearCost.independent((0.0, 1e-3 / PAGE, 0.0), (1e-6, 1e-7, 0.0)))
    links = [LinkCost(profile=PROFILE, source=Tier.GPU, destination=Tier.GPU, label="in place",
                      params=LinearCost.independent((1e-6, 0.0, 0.0), (1e-7, 0.0, 0.0))),
             LinkCost(profile=PROFILE, source=Tier.HOST, destination=Tier.GPU, label="bulk only",
                      params=LinearCost.independent((latency_s, 1e-5, 0.0), (latency_s / 100, 1e-7, 0.0)))]
    return CostModel.build("bulk", [hw], [compute], links)


def test_a_full_batch_is_priced_as_the_prefetch_it_starts():
    """SGLang's batching controller asks 128 pages at a time: a full batch is answered when the largest
    prefetch SGLang can make from there pays back, not only when 128 pages alone do."""
    from connectors.sglang import hicache_core
    from connectors.sglang.hashing import page_hashes_hex as hashes

    feed = _Index()
    core = _core(feed, "sglang-hicache/bulk", [HostMemoryBackend(1 << 26)], model=_fixed_cost_model(0.3))
    keys = hashes(list(range(200 * PAGE)), PAGE)
    tiny = torch.zeros(8, dtype=torch.float16)
    assert core.set_many([(k, tiny) for k in keys]) == [True] * 200
    batch = hicache_core.STORAGE_BATCH_SIZE
    assert core.batch_exists(keys[:batch], batched=True) == 0  # 128 pages alone do not pay back 0.3 s
    core.use_host_pool(1000)
    assert core.batch_exists(keys[:batch], batched=True) == batch  # ... but the prefetch they start can
    assert core.stats["answered_ahead"] == 1
    assert core.batch_exists(keys[:batch]) == 0  # a whole span of 128 (the hybrid controller) is what it is
    canonicals, holders, _ = core.readable_run(keys)
    assert core.gate(canonicals, holders) == 0  # nor do 200 (0.2 s of recompute against 0.3 s)
    assert core.gate(canonicals[:1], holders[:1], more=True) == 1  # one page heading a 1,000-page prefetch


class _CountingIndex:
    """An index view that counts the asks reaching it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.asks = 0

    def lookup(self, *args, **kwargs):
        self.asks += 1
        return self.inner.lookup(*args, **kwargs)


def test_promised_pages_are_read_without_asking_again(monkeypatch):
    """What ``batch_exists`` answered is read from that answer, once; a read without a promise asks
    once for all its pages; a promise expires; a read stops at its first miss."""
    from connectors.sglang import hicache_core

    feed = _Index()
    now = [1000.0]
    backend = HostMemoryBackend(1 << 22)
    cost = cost_model(DESC)
    core = HiCacheCore(DESC, worker="sglang-hicache/promise", catalog=BackendCatalog("sglang-hicache/promise",
                                                                                      [backend]),
                       tier=Tier.HOST, index=feed.index, publish=feed.publish, model=lambda: cost,
                       execution=lambda: POLICY, profile=PROFILE, clock=lambda: now[0])
    for i in range(5):
        assert core.set(KEYS[i], _page(i))
    counting = core.index = _CountingIndex(core.index)
    assert core.batch_exists(KEYS) == 5 and counting.asks == 1
    pages = core.get_many(KEYS[:5])
    assert all(torch.equal(p, _page(i)) for i, p in enumerate(pages))
    assert counting.asks == 1 and core.stats["read_on_promise"] == 5 and core.stats["asked_at_read"] == 0
    assert all(p is not None for p in core.get_many(KEYS[:5]))  # a promise is read once: one ask for the five
    assert counting.asks == 2 and core.stats["asked_at_read"] == 5

    assert core.batch_exists(KEYS) == 5
    now[0] += hicache_core.PROMISE_TTL_S + 1
    assert core.get(KEYS[0]) is not None  # expired: asked again, still vouched for
    assert core.stats["promises_expired"] == 1 and counting.asks == 4

    assert core.batch_exists(KEYS) == 5
    hits = core.stats["hits"]
    assert backend.delete(PayloadKey(DESC.descriptor_id, core.canonical(KEYS[1]), 0))  # gone behind the index's back
    got = core.get_many(KEYS[:5])
    assert got[0] is not None and got[1:] == [None] * 4  # up to the first miss; SGLang recomputes from there
    assert core.stats["hits"] == hits + 1 and core.stats["stale_or_missing"] == 1
    assert core.batch_exists(KEYS) == 1  # its own page found missing: the fact is withdrawn

    monkeypatch.setattr(hicache_core, "MAX_PROMISES", 2)
    dropped = core.stats["promises_dropped"]
    core.promise([core.canonical(k) for k in KEYS[2:5]], [core.worker] * 3)
    assert core.stats["promises_dropped"] == dropped + 2  # the one promise left before, and the oldest new one
