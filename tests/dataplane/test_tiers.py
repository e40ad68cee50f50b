"""The tier manager: admission and eviction by utility on real tiers, with a real index fed by its events.

Every test checks the three views agree at the end — what the tiers really hold, what the manager
believes, what a :class:`~nexuskv.index.GlobalIndex` fed with the manager's events holds — besides
its own point.
"""

from __future__ import annotations

import time

import pytest
import torch

from nexuskv.admission import Lru
from nexuskv.contracts.transfers import TransferCommand, TransferStatus
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.disk import DiskBackend
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation

from tests.dataplane.tiering import BLOCK_BYTES, Harness, chain_tokens, save_blocks


def _agree(h: Harness, m) -> None:
    assert h.tier_contents() == m.contents() == h.index_contents()
    assert all(v == (0, 0) for v in m.audit().values()), m.audit()
    stats = h.index.stats()
    assert stats.unresolved_blocks == 0 and stats.uncertain_publishers == 0
    for u in m.usage():
        assert u.used_bytes + u.reserved_bytes <= u.capacity_bytes


@pytest.fixture
def tiers(tmp_path):
    def make(host_blocks=8, disk_blocks=16, **kw):
        host = HostMemoryBackend(host_blocks * BLOCK_BYTES, pin=False)
        disk = DiskBackend(tmp_path / "disk", disk_blocks * BLOCK_BYTES)
        h = Harness([host, disk])
        return h, h.manager(**kw), host, disk
    return make


def test_saves_are_announced_and_the_index_holds_what_the_tiers_hold(tiers):
    h, m, host, _disk = tiers()
    out = m.save(save_blocks(chain_tokens(1, 4)), Tier.HOST, tenant="acme")
    assert out.ok and out.saved == 4 and out.nbytes == 4 * BLOCK_BYTES
    again = m.save(save_blocks(chain_tokens(1, 4)), Tier.HOST, tenant="acme")
    assert again.saved == 0 and again.already == 4 and again.ok
    assert host.used_bytes() == 4 * BLOCK_BYTES
    _agree(h, m)
    assert h.batches[0].events[0].type == "cleared" and [b.seq for b in h.batches] == list(range(len(h.batches)))


def test_a_tier_overfilled_many_times_keeps_saving_and_keeps_the_recurring_prefix(tiers):
    h, m, host, disk = tiers(host_blocks=8, disk_blocks=16)
    recurring = chain_tokens(1, 4)
    found = []
    for i in range(60):  # 60 one-off chains of 4 blocks: 240 blocks through 24 blocks of room
        h.clock.now += 1.0
        if i % 5 == 0:
            found.append(m.save(save_blocks(recurring), Tier.HOST, tenant="acme").already)
        one = m.save(save_blocks(chain_tokens(100 + i, 4)), Tier.HOST, tenant="acme")
        assert one.ok, one.reasons  # a full tier makes room: a new block is worth more than stale ones
        assert host.used_bytes() <= host.capacity_bytes and disk.used_bytes() <= disk.capacity_bytes
    # Seen once, the prefix is worth what any new block is and leaves with the stale ones; from its
    # second return on it is worth more than a block seen once, and stays.
    assert found[:2] == [0, 0] and found[2:] == [4] * 10
    assert m.counters["demoted"] > 0 and m.counters["dropped"] > 0
    # The one-off chains are what left; the recurring one is still in the fastest tier.
    keys = [b.key for b in save_blocks(recurring)]
    assert all(m.holds(k, Tier.HOST) for k in keys)
    _agree(h, m)


def test_utility_keeps_a_recurring_prefix_through_a_scan_that_lru_loses(tiers):
    def run(**kw):
        h, m, host, _disk = tiers(host_blocks=8, disk_blocks=0, **kw)
        recurring = chain_tokens(1, 4)
        found = 0
        for i in range(20):
            h.clock.now += 10.0
            found += m.save(save_blocks(recurring), Tier.HOST, tenant="acme").already == 4
            for j in range(3):  # a scan: 12 one-off blocks between two uses of the recurring prefix
                m.save(save_blocks(chain_tokens(1000 + 3 * i + j, 4)), Tier.HOST, tenant="acme")
        _agree(h, m)
        return found
    assert run() == 19  # held every time after the first
    assert run(policy=Lru()) == 0  # evicted by every scan


def test_a_block_worth_less_than_everything_is_refused_with_the_reason(tiers):
    h, m, host, _disk = tiers(host_blocks=4, disk_blocks=0)
    hot = chain_tokens(1, 4)
    for _ in range(10):
        h.clock.now += 1.0
        m.save(save_blocks(hot), Tier.HOST, tenant="acme")
    out = m.save(save_blocks(chain_tokens(2, 1)), Tier.HOST, tenant="acme")
    assert not out.ok and out.refused == 1 and "would displace" in out.reasons[0]
    assert m.counters["save_refused"] == 1
    _agree(h, m)


def test_pinned_and_busy_blocks_never_leave(tiers):
    h, m, host, _disk = tiers(host_blocks=4, disk_blocks=0)
    first = save_blocks(chain_tokens(1, 2))
    second = save_blocks(chain_tokens(2, 2))
    m.save(first, Tier.HOST, tenant="acme")
    m.save(second, Tier.HOST, tenant="acme")
    pinned = m.pin("hint-1", [b.key for b in first], until=h.clock.now + 7200, tenant="acme")
    assert pinned.ok and pinned.pinned_blocks == 2
    with m.reading(host, [b.key for b in second]):
        h.clock.now += 1.0
        out = m.save(save_blocks(chain_tokens(3, 2)), Tier.HOST, tenant="acme")
        assert not out.ok and "pinned, busy or anchored" in out.reasons[0]
    h.clock.now += 3600.0  # the reader is gone, and the use it counted has long decayed
    out = m.save(save_blocks(chain_tokens(3, 2)), Tier.HOST, tenant="acme")
    assert out.ok, out.reasons  # the unpinned chain made room
    assert all(m.holds(b.key, Tier.HOST) for b in first)
    assert m.unpin("hint-1") == 2
    _agree(h, m)


def test_pins_are_held_within_the_tier_quota(tiers):
    h, m, _host, _disk = tiers(host_blocks=8, disk_blocks=0, pin_fraction=0.25)
    a, b = save_blocks(chain_tokens(1, 2)), save_blocks(chain_tokens(2, 2))
    m.save(a + b, Tier.HOST, tenant="acme")
    assert m.pin("p1", [x.key for x in a], until=h.clock.now + 5, tenant="acme").ok
    refused = m.pin("p2", [x.key for x in b], until=h.clock.now + 5, tenant="acme")
    assert not refused.ok and "pinned bytes would exceed" in refused.reason
    usage = next(u for u in m.usage() if u.tier is Tier.HOST)
    assert usage.pinned_bytes == 2 * BLOCK_BYTES and usage.in_flight_bytes == 0
    h.clock.now += 6
    m.tick()
    assert m.pin("p2", [x.key for x in b], until=h.clock.now + 5, tenant="acme").ok  # the first pin lapsed


def test_a_prefetch_reservation_holds_real_room_until_it_expires(tiers):
    h, m, host, _disk = tiers(host_blocks=4, disk_blocks=0, prefetch_fraction=0.75)
    assert m.reserve("t-1", Tier.HOST, 3 * BLOCK_BYTES, tenant="acme", expires_at=h.clock.now + 2) is None
    assert host.free_bytes() == BLOCK_BYTES
    out = m.save(save_blocks(chain_tokens(1, 2)), Tier.HOST, tenant="acme")
    assert out.saved == 1 and out.refused == 1  # only one block fits beside the reservation
    usage = next(u for u in m.usage() if u.tier is Tier.HOST)
    assert usage.reserved_bytes == 3 * BLOCK_BYTES
    h.clock.now += 3
    m.tick()
    assert m.counters["reservations_expired"] == 1 and host.free_bytes() == 3 * BLOCK_BYTES
    _agree(h, m)


def test_a_prefix_parent_outlives_the_blocks_chained_from_it(tiers):
    h, m, host, _disk = tiers(host_blocks=4, disk_blocks=0)
    chain = save_blocks(chain_tokens(1, 4))
    m.save(chain, Tier.HOST, tenant="acme")
    h.clock.now += 1000.0  # the chain is stale now: new blocks displace it, leaves first
    m.save(save_blocks(chain_tokens(2, 2)), Tier.HOST, tenant="acme")
    held = [m.holds(b.key, Tier.HOST) for b in chain]
    assert held == [True, True, False, False]
    # A block whose parent is not held cannot be keyed by the index: refused, never announced.
    orphan = save_blocks(chain_tokens(1, 4), start=3)
    out = m.save(orphan, Tier.HOST, tenant="acme")
    assert out.refused == 1 and "prefix parent is not held" in out.reasons[0]
    _agree(h, m)


def test_leftovers_of_an_earlier_process_are_dropped_at_the_first_tick(tmp_path):
    disk = DiskBackend(tmp_path / "disk", 8 * BLOCK_BYTES)
    data = torch.ones(BLOCK_BYTES, dtype=torch.uint8)
    pk = PayloadKey("tiny-desc", 12345)
    disk.put(PayloadHeader.for_data(pk, host_view(data)), data)
    again = DiskBackend(tmp_path / "disk", 8 * BLOCK_BYTES)
    h = Harness([again])
    m = h.manager()
    assert m.tick() == 1 and again.keys() == [] and m.counters["garbage"] == 1
    _agree(h, m)


def _command(tid: str, keys, src: Tier, dst: Tier, *, deadline_in: float = 30.0) -> TransferCommand:
    now = time.time()
    return TransferCommand(transfer_id=tid, request_id=f"r-{tid}", descriptor_id="tiny-desc", tenant_namespace="acme",
                           keys=tuple(k.key for k in keys), source=EntryLocation(worker="w0", tier=src),
                           destination=EntryLocation(worker="w0", tier=dst), bytes=len(keys) * BLOCK_BYTES,
                           issued_at=now, deadline_at=now + deadline_in)


def test_the_executor_copies_through_the_manager_and_what_landed_is_announced(tmp_path):
    device = DeviceMemoryBackend(4 * BLOCK_BYTES)
    host = HostMemoryBackend(8 * BLOCK_BYTES, pin=False)
    h = Harness([device, host])
    h.clock = time.time  # the executor checks deadlines on the wall clock
    m = h.manager()
    h.facts.clock = time.time
    ex = TransferExecutor(h.catalog, tiers=m, clock=time.time)
    try:
        chain = save_blocks(chain_tokens(1, 3))
        assert m.save(chain, Tier.HOST, tenant="acme").ok
        keys = [b.key for b in chain]
        out = ex.submit(_command("t-1", keys, Tier.HOST, Tier.GPU)).result(30)
        assert out.status is TransferStatus.COMPLETED and out.result.blocks_moved == 3
        assert all(m.holds(k, Tier.GPU) for k in keys)
        # A second copy that does not fit beside the first makes room by utility: the first copy's
        # blocks are demoted to host, where they are already held.
        other = save_blocks(chain_tokens(2, 3))
        assert m.save(other, Tier.HOST, tenant="acme").ok
        out2 = ex.submit(_command("t-2", [b.key for b in other], Tier.HOST, Tier.GPU)).result(30)
        assert out2.status is TransferStatus.COMPLETED, out2.result.error
        assert device.used_bytes() <= device.capacity_bytes
        assert h.tier_contents() == m.contents() == h.index_contents()
        # A cancel that comes before its command: the command is answered cancelled on arrival.
        assert not ex.cancel("t-3", "the request recomputes")
        out3 = ex.submit(_command("t-3", keys, Tier.HOST, Tier.GPU)).result(30)
        assert out3.status is TransferStatus.CANCELLED and "recomputes" in out3.result.error
    finally:
        ex.close()


def test_a_copy_from_outside_the_manager_is_held_for_its_request_then_collected(tmp_path):
    device = DeviceMemoryBackend(4 * BLOCK_BYTES)
    outside = HostMemoryBackend(8 * BLOCK_BYTES, pin=False)
    h = Harness([device])
    m = h.manager(lease_s=0.0)
    chain = save_blocks(chain_tokens(1, 2))
    reservation, why = m.admit_copy("t-1", "acme", device, [(b.key, BLOCK_BYTES) for b in chain],
                                    expires_at=h.clock.now + 1)
    assert reservation is not None, why
    for b in chain:
        outside.put(PayloadHeader.for_data(b.key, host_view(b.data)), b.data)
        got = outside.get(b.key)
        device.put(got[0], got[1], reservation)
    m.landed("t-1", "acme", device, [b.key for b in chain], [BLOCK_BYTES] * 2, lease_until=h.clock.now + 1)
    assert m.contents() == {} and h.index_contents() == {}  # no identity: held, not announced
    assert next(u for u in m.usage() if u.tier is Tier.GPU).unannounced_blocks == 2
    assert m.tick() == 0  # its request may still use it
    h.clock.now += 2
    assert m.tick() == 2 and device.keys() == []
    _agree(h, m)


def test_a_copy_that_cannot_be_admitted_is_rejected_for_capacity_with_the_reason(tmp_path):
    device = DeviceMemoryBackend(2 * BLOCK_BYTES)
    host = HostMemoryBackend(8 * BLOCK_BYTES, pin=False)
    h = Harness([device, host])
    h.clock = time.time
    m = h.manager()
    ex = TransferExecutor(h.catalog, tiers=m, clock=time.time)
    try:
        chain = save_blocks(chain_tokens(1, 3))
        m.save(chain, Tier.HOST, tenant="acme")
        out = ex.submit(_command("t-big", [b.key for b in chain], Tier.HOST, Tier.GPU)).result(30)
        assert out.status is TransferStatus.REJECTED_CAPACITY and "refused" in out.result.error
        assert device.keys() == [] and device.free_bytes() == device.capacity_bytes
    finally:
        ex.close()


def test_a_queued_copys_room_is_not_held_to_the_prefetch_share_but_to_its_time(tiers):
    h, m, host, _disk = tiers(host_blocks=4, disk_blocks=0)  # default share: 25 % of the tier
    assert "prefetch share" in m.reserve("hint", Tier.HOST, 3 * BLOCK_BYTES, tenant="acme",
                                         expires_at=h.clock.now + 2)
    assert m.reserve("copy", Tier.HOST, 3 * BLOCK_BYTES, tenant="acme", expires_at=h.clock.now + 3600,
                     share=False) is None  # the executor's own room for a command it will run
    assert host.free_bytes() == BLOCK_BYTES
    h.clock.now += 61  # held 60 s at most, whatever the deadline said
    m.tick()
    assert m.counters["reservations_expired"] == 1 and m.counters["reservations_shortened"] == 1
    assert host.free_bytes() == 4 * BLOCK_BYTES
    _agree(h, m)
