"""Admission and eviction by one utility; pins, TTLs, budgets, demotion versus drop."""

from __future__ import annotations

import math

import pytest

from nexuskv.admission import (
    EvictionKind,
    Resident,
    TierBudget,
    TierState,
    admit,
    displacement_price,
    evict_for,
    eviction_order,
    pin,
    utility,
)
from nexuskv.descriptor import Tier

NOW = 1000.0
MB = 1 << 20


def res(entry_id, nbytes=100 * MB, p=0.5, gpu=1.0, host=0.5, disk=None, tenant="t", **kw) -> Resident:
    gains = {Tier.GPU: gpu, Tier.HOST: host}
    if disk is not None:
        gains[Tier.DISK] = disk
    return Resident(entry_id, tenant, nbytes, p, gains, **kw)


def gpu(capacity_mb, *residents, **budget) -> TierState:
    return TierState(TierBudget(Tier.GPU, capacity_mb * MB, **budget), tuple(residents))


def host(capacity_mb, *residents) -> TierState:
    return TierState(TierBudget(Tier.HOST, capacity_mb * MB), tuple(residents))


def test_utility_is_expected_gain_per_byte():
    r = res("a", nbytes=2 * MB, p=0.25, gpu=4.0)
    assert utility(r, Tier.GPU, now=NOW) == pytest.approx(0.25 * 4.0 / (2 * MB))
    assert utility(r, Tier.DISK, now=NOW) == 0.0  # cannot be served from there
    assert utility(res("b", host=-0.2), Tier.HOST, now=NOW) == 0.0  # a tier slower than recomputing
    assert utility(res("c", expires_at=NOW), Tier.GPU, now=NOW) == 0.0  # TTL passed


def test_a_large_popular_state_can_be_worth_less_per_byte_than_small_ones():
    big = res("big", nbytes=1000 * MB, p=0.9, gpu=2.0)
    small = res("small", nbytes=10 * MB, p=0.3, gpu=0.5)
    assert utility(big, Tier.GPU, now=NOW) < utility(small, Tier.GPU, now=NOW)
    full = gpu(1000, big)
    assert admit(small, full, now=NOW).admit  # displaces the big one, worth less per byte
    assert not admit(big, gpu(1000, small, res("s2", nbytes=10 * MB, p=0.3, gpu=0.5)), now=NOW).admit


def test_admission_fits_in_free_space_without_evictions():
    a = admit(res("new"), gpu(500, res("old")), now=NOW)
    assert a.admit and a.evictions == () and "fits" in a.reason


def test_admission_and_eviction_use_the_same_utility_cheapest_first():
    cheap, mid, dear = res("cheap", gpu=0.1), res("mid", gpu=0.5), res("dear", gpu=3.0)
    state = gpu(300, dear, cheap, mid)
    assert [r.entry_id for r, _u in eviction_order(state, now=NOW)] == ["cheap", "mid", "dear"]
    a = admit(res("new", gpu=1.0), state, now=NOW)
    assert a.admit and [e.entry_id for e in a.evictions] == ["cheap"]
    two = admit(res("new", nbytes=200 * MB, gpu=4.0), state, now=NOW)
    assert [e.entry_id for e in two.evictions] == ["cheap", "mid"]
    refused = admit(res("new", gpu=0.05), state, now=NOW)  # worth less than the cheapest resident
    assert not refused.admit and "would displace" in refused.reason
    # 200 MB at 0.3: "cheap" (0.1) may go, but "mid" (0.5) is worth more than the newcomer: refused.
    assert not admit(res("new", nbytes=200 * MB, gpu=0.3), state, now=NOW).admit


def test_a_victim_is_demoted_when_still_worth_it_below_and_dropped_otherwise():
    keeps_value = res("keeps", gpu=0.1, host=0.05)
    worthless_below = res("worthless", gpu=0.1, host=-1.0)
    state = gpu(200, keeps_value, worthless_below)
    a = admit(res("new", nbytes=200 * MB, gpu=2.0), state, now=NOW, lower=host(1000))
    kinds = {e.entry_id: (e.kind, e.to_tier) for e in a.evictions}
    assert kinds == {"keeps": (EvictionKind.DEMOTE, Tier.HOST), "worthless": (EvictionKind.DROP, None)}
    no_room = admit(res("new", nbytes=200 * MB, gpu=2.0), state, now=NOW, lower=host(50))
    assert {e.kind for e in no_room.evictions} == {EvictionKind.DROP}
    assert "no room below" in no_room.evictions[0].reason


def test_pinned_state_never_leaves_and_expired_state_leaves_first():
    pinned = res("pinned", gpu=0.01, pinned_until=NOW + 10)
    expired = res("expired", gpu=9.0, expires_at=NOW - 1)
    state = gpu(200, pinned, expired)
    a = admit(res("new", gpu=1.0), state, now=NOW)
    assert a.admit and [e.entry_id for e in a.evictions] == ["expired"] and "TTL" in a.evictions[0].reason
    blocked = admit(res("new", nbytes=200 * MB, gpu=5.0), state, now=NOW)
    assert not blocked.admit and "pinned" in blocked.reason
    later = admit(res("new", nbytes=200 * MB, gpu=5.0), state, now=NOW + 11)  # the pin has lapsed
    assert later.admit and {e.entry_id for e in later.evictions} == {"pinned", "expired"}


def test_budgets_quotas_and_pins():
    state = gpu(1000, res("a", tenant="t1"), res("b", tenant="t1"), tenant_quota_bytes={"t1": 250 * MB},
                max_pinned_bytes=150 * MB)
    over = admit(res("c", tenant="t1"), state, now=NOW)
    assert not over.admit and "t1 would exceed" in over.reason
    assert admit(res("c", tenant="t2"), state, now=NOW).admit
    assert not admit(res("huge", nbytes=2000 * MB), state, now=NOW).admit
    assert not admit(res("z", gpu=0.0), state, now=NOW).admit
    assert pin(res("p"), state, until=NOW + 5, now=NOW).ok
    busy = gpu(1000, res("q", pinned_until=NOW + 5), max_pinned_bytes=150 * MB)
    assert not pin(res("p"), busy, until=NOW + 5, now=NOW).ok


def test_evict_for_reports_impossible_requests():
    state = gpu(100, res("only", pinned_until=NOW + 1))
    assert evict_for(state, 10 * MB, now=NOW) is None
    assert evict_for(state, 0, now=NOW) == ()


def test_displacement_price_is_what_a_prefetch_would_cost_resident_state():
    state = gpu(200, res("a", p=0.5, gpu=1.0), res("b", p=0.5, gpu=4.0))
    assert displacement_price(state, 0, now=NOW) == 0.0
    assert displacement_price(gpu(500, res("a")), 100 * MB, now=NOW) == 0.0  # fits
    price = displacement_price(state, 100 * MB, now=NOW)  # displaces "a": 0.5 s expected, per 100 MiB
    assert price == pytest.approx(0.5 * 1.0 / (100 * MB / (1 << 30)))
    assert math.isinf(displacement_price(gpu(100, res("p", pinned_until=NOW + 1)), 50 * MB, now=NOW))


def test_residents_validate():
    with pytest.raises(ValueError):
        res("x", nbytes=0)
    with pytest.raises(ValueError):
        res("x", p=1.5)
