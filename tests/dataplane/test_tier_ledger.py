"""The tier manager's pure ledger on its own: pins, reservations, leases and what the index learns,
without a backend (a backend is an opaque handle to the ledger; what it counts comes in as a Room)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nexuskv.admission import ReuseModel
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.dataplane.tier_ledger import Held, Room, TierLedger
from nexuskv.descriptor import Tier

from tests.dataplane.tiering import BLOCK_BYTES, IDENTITY, chain_tokens, save_blocks

HOST = SimpleNamespace(capabilities=SimpleNamespace(tier=Tier.HOST), label="host")
DISK = SimpleNamespace(capabilities=SimpleNamespace(tier=Tier.DISK), label="disk")
NOW = 1_000.0


def _ledger(**kw) -> TierLedger:
    args = dict(reuse=ReuseModel(), gains=None, pin_fraction=0.5, tenant_pin_quota=None, lease_s=5.0, drop_log=16)
    args.update(kw)
    return TierLedger([HOST, DISK], **args)


def _rooms(capacity_blocks: int = 8, used_blocks: int = 0) -> dict[int, Room]:
    cap, used = capacity_blocks * BLOCK_BYTES, used_blocks * BLOCK_BYTES
    return {id(b): Room(cap, used, cap - used) for b in (HOST, DISK)}


def _saved(ledger: TierLedger, blocks: int, *, backend=HOST, tenant: str = "acme", seed: int = 1) -> list[PayloadKey]:
    events: list = []
    keys = []
    for i, sb in enumerate(save_blocks(chain_tokens(seed, blocks))):
        ledger.saved(backend, (sb.key, sb.identity, i, BLOCK_BYTES), tenant=tenant, gains={}, now=NOW, events=events)
        keys.append(sb.key)
    return keys


def test_a_saved_chain_is_announced_once_and_its_removal_is_reported_with_the_drop():
    ledger = _ledger()
    events: list = []
    sbs = save_blocks(chain_tokens(1, 2))
    for i, sb in enumerate(sbs):
        ledger.saved(HOST, (sb.key, sb.identity, i, BLOCK_BYTES), tenant="acme", gains={}, now=NOW, events=events)
    ledger.saved(DISK, (sbs[0].key, sbs[0].identity, 0, BLOCK_BYTES), tenant="acme", gains={}, now=NOW, events=events)
    assert [(e.kind, e.tier) for e in events] == [("stored", Tier.HOST), ("stored", Tier.HOST), ("moved", Tier.DISK)]
    assert events[0].identity.identity == IDENTITY
    head, tail = (ledger.blocks[sb.key] for sb in sbs)
    assert head.children == {tail.key} and tail.parent == head.key
    assert ledger.holds(head.key, Tier.DISK) and not ledger.holds(tail.key, Tier.DISK)
    assert ledger.contents() == {(Tier.HOST, 0): {head.key, tail.key}, (Tier.DISK, 0): {head.key}}

    events.clear()
    assert ledger.remove_copy(tail, HOST, events, why="test", now=NOW + 1) is not None
    assert [(e.kind, e.tier, e.key) for e in events] == [("removed", Tier.HOST, tail.key)]
    assert tail.key not in ledger.blocks and head.children == set()  # forgotten, and its parent knows
    assert list(ledger.drops) == [(NOW + 1, tail.key, Tier.HOST, "test")]
    assert ledger.counters["dropped"] == 1 and ledger.counters["blocks_dropped"] == 1
    assert ledger.remove_copy(tail, HOST, events, why="again", now=NOW + 2) is None  # not held there any more


def test_pins_stay_within_the_tiers_quota_and_the_tenants_scope_and_end_at_their_time():
    ledger = _ledger()
    mine = _saved(ledger, 3)
    theirs = _saved(ledger, 1, tenant="other", seed=9)
    # Another tenant's block is never pinned by this tenant's hint; this tenant's are.
    out = ledger.pin("h1", mine + theirs, until=NOW + 10, tenant="acme", tier=None, now=NOW, rooms=_rooms(8, 4))
    assert out.ok and out.pinned_blocks == 3 and "1 of another tenant not pinned" in out.reason
    assert ledger.counters["hint_blocks_refused"] == 1
    only_theirs = ledger.pin("h2", theirs, until=NOW + 10, tenant="acme", tier=None, now=NOW, rooms=_rooms(8, 4))
    assert not only_theirs.ok and only_theirs.reason.startswith("tenant:")
    # Pinned: 3 of 8 blocks; the quota is half the tier, so a fourth block fits and a fifth would not.
    more = _saved(ledger, 2, seed=2)
    over = ledger.pin("h3", more, until=NOW + 10, tenant="acme", tier=Tier.HOST, now=NOW, rooms=_rooms(8, 6))
    assert not over.ok and over.pinned_blocks == 0 and "h3" in over.reason and str(2 * BLOCK_BYTES) in over.reason
    assert ledger.counters["pins_refused"] == 1 and all(not ledger.blocks[k].pins for k in more)
    assert ledger.pin("h4", more[:1], until=NOW + 10, tenant="acme", tier=None, now=NOW, rooms=_rooms(8, 6)).ok
    # A pin ends at its time (expire), or when its owner is unpinned, in the owner's tenant only.
    assert ledger.unpin("h4", tenant="other") == 0 and ledger.unpin("h4") == 1
    ledger.expire(NOW + 9)
    assert all(ledger.blocks[k].pins for k in mine)
    ledger.expire(NOW + 10)
    assert not any(ledger.blocks[k].pins for k in mine)


def test_a_tenants_pin_quota_counts_what_it_pins_in_every_tier():
    ledger = _ledger(tenant_pin_quota=lambda tenant: 2 * BLOCK_BYTES if tenant == "acme" else None)
    keys = _saved(ledger, 3)
    assert ledger.pin("a", keys[:2], until=NOW + 10, tenant="acme", tier=None, now=NOW, rooms=_rooms(64, 3)).ok
    out = ledger.pin("b", keys[2:], until=NOW + 10, tenant="acme", tier=None, now=NOW, rooms=_rooms(64, 3))
    assert not out.ok and out.reason == f"tenant acme would pin more than its {2 * BLOCK_BYTES} bytes"


def test_reservations_are_held_per_transfer_cancelled_in_their_tenant_and_expire_unless_landing():
    ledger = _ledger()
    ledger.hold("p1", Held(HOST, SimpleNamespace(remaining=100), NOW + 5, "acme"))
    ledger.hold("p2", Held(HOST, SimpleNamespace(remaining=50), NOW + 50, "acme"))
    ledger.hold("c1", Held(HOST, SimpleNamespace(remaining=70), NOW + 5, "acme", landing=True))
    ledger.hold("d1", Held(DISK, SimpleNamespace(remaining=30), NOW + 5, "acme"))
    assert ledger.prefetch_held(HOST) == 150  # a copy landing is not a prefetch's share
    assert ledger.counts(HOST, NOW)[3:] == (220, 70)  # reserved, landing
    assert ledger.cancel("p2", "other") is None and ledger.cancel("c1", None) is None  # not theirs; running
    assert ledger.cancel("p2", "acme").reservation.remaining == 50 and "p2" not in ledger.held
    expired, garbage = ledger.expire(NOW + 5)
    assert sorted(h.backend.label for h in expired) == ["disk", "host"] and garbage == []
    assert set(ledger.held) == {"c1"} and ledger.counters["reservations_expired"] == 2
    assert ledger.take("c1").landing and ledger.take("c1") is None and ledger.take_all() == []


def test_a_landed_copy_nobody_can_find_is_kept_for_its_lease_then_is_garbage_unless_pinned_or_read():
    ledger = _ledger()
    keys = [PayloadKey("tiny-desc", 1), PayloadKey("tiny-desc", 2), PayloadKey("tiny-desc", 3)]
    events: list = []
    ledger.land("t1", "acme", DISK, keys, [BLOCK_BYTES] * 3, lease_until=NOW + 30, now=NOW, events=events)
    assert events == [] and ledger.landed_keys("t1") == keys  # no identity: held, not announced
    assert ledger.counts(DISK, NOW)[:2] == (3, 3)
    assert ledger.p_reuse(NOW)[keys[0]] == 1.0 and ledger.p_reuse(NOW + 30)[keys[0]] == 0.0
    assert ledger.expire(NOW + 29)[1] == []
    ledger.pin("keep", keys[:1], until=NOW + 60, tenant="acme", tier=Tier.DISK, now=NOW + 29, rooms=_rooms(8, 3))
    taken = ledger.take_readers(DISK, keys[1:2], NOW + 29)
    _, garbage = ledger.expire(NOW + 30)
    assert [blk.key for blk, backend in garbage] == [keys[2]] and garbage[0][1] is DISK
    ledger.give_readers(taken)
    assert [blk.key for blk, _ in ledger.expire(NOW + 31)[1]] == [keys[1], keys[2]]
    # A second landing of a held block extends its lease.
    ledger.land("t2", "acme", HOST, keys[2:], [BLOCK_BYTES], lease_until=NOW + 90, now=NOW + 31, events=events)
    ledger.land("t3", "acme", HOST, keys[2:], [BLOCK_BYTES], lease_until=NOW + 120, now=NOW + 31, events=events)
    assert ledger.blocks[keys[2]].lease_until == NOW + 120


def test_found_payloads_are_garbage_at_once_unless_adopted_with_their_identity():
    ledger = _ledger()
    sbs = save_blocks(chain_tokens(4, 2))
    for sb in sbs:
        ledger.found(DISK, sb.key, BLOCK_BYTES, NOW)
    leftover = PayloadKey("tiny-desc", 77)
    ledger.found(DISK, leftover, BLOCK_BYTES, NOW)
    assert ledger.adopt([(sb.key, sb.identity, i) for i, sb in enumerate(sbs)], tenant="acme", now=NOW) == 2
    assert ledger.blocks[sbs[0].key].children == {sbs[1].key}
    _, garbage = ledger.expire(NOW)
    assert [blk.key for blk, _ in garbage] == [leftover]


def test_leaves_first_orders_a_chain_deepest_first():
    ledger = _ledger()
    keys = _saved(ledger, 3)
    assert ledger.leaves_first(keys) == keys[::-1]


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_the_pinned_budget_is_the_ledgers_fraction_of_the_room(fraction):
    ledger = _ledger(pin_fraction=fraction)
    state = ledger.state(HOST, Room(8 * BLOCK_BYTES, 0, 8 * BLOCK_BYTES), NOW)
    assert state.budget.max_pinned_bytes == int(8 * BLOCK_BYTES * fraction) and state.residents == ()


def test_the_ledger_imports_nothing_that_does_io_reads_a_clock_or_starts_a_thread():
    import ast
    from pathlib import Path

    import nexuskv.dataplane.tier_ledger as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported <= {"__future__", "collections", "collections.abc", "dataclasses", "typing", "nexuskv.admission",
                        "nexuskv.dataplane.payload", "nexuskv.dataplane.tier_facts", "nexuskv.descriptor"}, imported
    # Nor names them: no fact sink (it returns TierChange records), no clock, no thread, no tensor.
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"TierFacts", "time", "threading", "os", "torch"}
