"""The remote tier's capacity ledger: a full store evicts by utility, quotas, pins, reads, garbage."""

import pytest

from nexuskv.admission import ReuseModel
from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadKey
from nexuskv.dataplane.remote_ledger import OfferedBlock, RemoteLedger
from nexuskv.dataplane.tier_facts import BlockIdentity

D = "sd1-remote-ledger"
PAYLOAD = 1024
OBJ = PAYLOAD + HEADER_BYTES
IDENT = PublisherIdentity(tenant_namespace="t1", model="m", model_revision="r", tokenizer_revision="r",
                          descriptor_id=D, engine_family="test")


def key(k: int) -> PayloadKey:
    return PayloadKey(D, k, 0)


def block(k: int, parent: int | None = None, position: int = 0) -> OfferedBlock:
    return OfferedBlock(key(k), PAYLOAD, position, BlockIdentity(IDENT, (), 16, parent=parent))


def ledger(**kw) -> RemoteLedger:
    # 10 objects fit under the high watermark (0.9), 8 under the low one (0.8).
    kw.setdefault("reuse", ReuseModel(half_life_s=10.0))
    kw.setdefault("low_watermark", 0.8)
    kw.setdefault("high_watermark", 0.9)
    return RemoteLedger(10 * OBJ * 10 // 9 + 8, **kw)


def fill(led: RemoteLedger, keys, *, tenant="t1", now=0.0):
    for k in keys:
        d = led.offer([block(k)], offer_id=f"o{k}", tenant=tenant, now=now)
        assert d.admitted == (key(k),), d.refused


def test_an_offer_that_fits_is_admitted_and_announced_as_stored():
    led = ledger()
    d = led.offer([block(1), block(2, parent=1, position=1)], offer_id="o", tenant="t1", now=0.0)
    assert d.admitted == (key(1), key(2)) and not d.refused and not d.evicted
    assert [(c.kind, c.key) for c in d.changes] == [("stored", key(1)), ("stored", key(2))]
    assert led.held_bytes() == 2 * OBJ
    again = led.offer([block(1)], offer_id="o2", tenant="t1", now=1.0)
    assert again.already == (key(1),) and not again.changes


def test_a_block_whose_parent_is_not_held_is_refused():
    led = ledger()
    d = led.offer([block(5, parent=4, position=1)], offer_id="o", tenant="t1", now=0.0)
    assert d.refused == ((key(5), "its prefix parent is not held by the remote tier"),)
    assert d.delete == (key(5),) and not led.holds(key(5))


def test_a_full_store_evicts_the_cheapest_block_instead_of_refusing():
    led = ledger()
    fill(led, range(1, 11))  # full under the high watermark
    for _ in range(3):  # blocks 2..10 are reused; block 1 is not
        led.touch([key(k) for k in range(2, 11)], now=5.0)
    d = led.offer([block(11)], offer_id="o11", tenant="t1", now=20.0)
    assert d.admitted == (key(11),)
    evicted = [k for k, _ in d.evicted]
    assert evicted[0] == key(1), d.evicted  # the one nobody reused goes first
    # Only what the newcomer is worth more than may go for it (the reused blocks stay).
    assert evicted == [key(1)] and led.held_bytes() <= led.high_bytes
    assert ("removed", key(1)) in [(c.kind, c.key) for c in d.changes]
    assert key(1) in d.delete


def test_evicting_for_a_newcomer_frees_down_to_the_low_watermark_when_it_may():
    led = ledger()
    fill(led, range(1, 11), now=0.0)  # none reused: the newcomer is worth more than each
    d = led.offer([block(11)], offer_id="o11", tenant="t1", now=20.0)
    assert d.admitted == (key(11),) and len(d.evicted) > 1
    assert led.held_bytes() <= led.low_bytes + OBJ  # the next saves fit without rescoring


def test_a_newcomer_worth_less_than_everything_held_is_refused():
    led = ledger()
    fill(led, range(1, 11), now=100.0)
    for _ in range(5):
        led.touch([key(k) for k in range(1, 11)], now=100.0)
    d = led.offer([block(11)], offer_id="o11", tenant="t1", now=100.0)
    assert not d.admitted and d.refused[0][0] == key(11) and "displace" in d.refused[0][1]
    assert not d.evicted and led.counters["refused_utility"] == 1


def test_a_tenant_at_its_quota_displaces_only_its_own_blocks():
    led = ledger(tenant_shares=(0.5, {}))  # each tenant: half of 10 objects
    fill(led, range(1, 6), tenant="t1")
    fill(led, range(21, 24), tenant="t2")
    d = led.offer([block(6)], offer_id="o6", tenant="t1", now=30.0)  # t1's old blocks have decayed
    assert d.admitted == (key(6),)
    assert d.evicted and all(k.key in range(1, 6) for k, _ in d.evicted)
    assert "tenant quota" in d.evicted[0][1]
    assert led.tenant_bytes("t1") <= led.quota("t1") and led.tenant_bytes("t2") == 3 * OBJ


def test_a_tenant_at_its_quota_whose_blocks_are_worth_more_is_refused():
    led = ledger(tenant_shares=(1.0, {"t1": 0.3}))  # t1: 3 objects
    fill(led, range(1, 4), tenant="t1", now=50.0)
    led.touch([key(1), key(2), key(3)], now=50.0)
    d = led.offer([block(4)], offer_id="o4", tenant="t1", now=50.0)
    assert not d.admitted and "quota" in d.refused[0][1] and led.counters["refused_quota"] == 1


def test_pinned_and_read_blocks_are_kept_when_the_store_is_full():
    led = ledger()
    fill(led, range(1, 11))
    ok, why = led.pin("hint-1", [key(k) for k in range(1, 6)], until=100.0, now=1.0)
    assert ok, why
    assert led.reading("t-1", [key(k) for k in range(6, 11)], until=100.0, now=1.0) == 5
    d = led.offer([block(11)], offer_id="o11", tenant="t1", now=50.0)
    assert not d.admitted and not d.evicted  # nothing movable: refused, nothing displaced
    assert led.usage(50.0).pinned_bytes == 5 * OBJ and led.usage(50.0).in_flight_bytes == 5 * OBJ
    led.done("t-1")
    d = led.offer([block(11)], offer_id="o11", tenant="t1", now=50.0)
    assert d.admitted == (key(11),)
    assert all(k.key in range(6, 11) for k, _ in d.evicted)  # only unpinned ones left
    # Reads and pins end by themselves at their deadline.
    head = led.keep_headroom(led.capacity_bytes, now=200.0)
    assert {k.key for k, _ in head.evicted} & set(range(1, 6))


def test_headroom_evicts_leaves_before_their_parents_down_to_the_low_watermark():
    led = ledger()
    chain = [block(1)] + [block(k, parent=k - 1, position=k - 1) for k in range(2, 9)]
    assert len(led.offer(chain, offer_id="c", tenant="t1", now=0.0).admitted) == 8
    fill(led, [20, 21], now=0.0)
    led.touch([key(20), key(21)], now=1.0)
    assert led.keep_headroom(led.high_bytes, now=2.0).evicted == ()  # at the mark: nothing to do
    d = led.keep_headroom(led.capacity_bytes, now=2.0)  # the store is full (saves in flight)
    assert led.capacity_bytes - sum(OBJ for _ in d.evicted) <= led.low_bytes
    order = [k.key for k, _ in d.evicted]
    assert order[:3] == [8, 7, 6], order  # the chain's leaves first, deepest first
    assert [c.kind for c in d.changes] == ["removed"] * len(order)
    assert d.short_bytes == 0


def test_unoffered_objects_are_collected_after_the_lease_and_lost_ones_forgotten():
    led = ledger(lease_s=10.0)
    fill(led, [1], now=0.0)
    listing = {key(1): OBJ, key(50): OBJ, key(51): OBJ}
    first = led.sweep(listing, listed_at=1.0, now=1.0)
    assert first.collected == () and led.usage(1.0).unoffered_blocks == 2
    led.offer([block(51)], offer_id="late", tenant="t1", now=5.0)  # offered within its lease
    second = led.sweep(listing, listed_at=12.0, now=12.0)
    assert second.collected == (key(50),)  # never offered: garbage
    assert led.holds(key(51))
    gone = led.sweep({key(51): OBJ}, listed_at=13.0, now=13.0)  # key 1 vanished behind the owner's back
    assert gone.lost == (key(1),) and [(c.kind, c.key) for c in gone.changes] == [("removed", key(1))]
    # A block admitted after the listing was taken is not lost for missing from it.
    led.offer([block(60)], offer_id="o60", tenant="t1", now=14.0)
    assert led.sweep({key(51): OBJ}, listed_at=13.5, now=14.0).lost == ()


def test_the_price_is_zero_with_room_and_positive_when_full():
    led = ledger()
    fill(led, range(1, 5))
    assert led.price(OBJ, now=1.0) == 0.0
    fill(led, range(5, 11))
    assert led.price(OBJ, now=1.0) > 0.0
    u = led.usage(1.0)
    assert u.blocks == 10 and u.used_bytes == 10 * OBJ and u.price_s_per_gib > 0


def test_invalid_configuration_is_refused():
    with pytest.raises(ValueError, match="watermarks"):
        RemoteLedger(1 << 20, low_watermark=0.9, high_watermark=0.8)
    with pytest.raises(ValueError, match="share"):
        RemoteLedger(1 << 20, tenant_shares=(1.0, {"t": 1.5}))
