"""Admission and eviction by one utility; pins, TTLs, budgets, demotion versus drop."""

from __future__ import annotations

import math

import pytest

from nexuskv.admission import (
    EVICTION_POLICIES,
    EvictionKind,
    Lru,
    Resident,
    ReuseModel,
    TierBudget,
    TierState,
    admit,
    block_gains,
    displacement_price,
    evict_for,
    eviction_order,
    pin,
    utility,
)
from nexuskv.descriptor import Tier
from nexuskv.profiles import shipped_cost_model

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


# -- eviction policies, reserved room, state in use, prefix parents, the reuse model, block gains ----

def test_busy_and_reserved_room_are_not_free():
    state = TierState(TierBudget(Tier.GPU, 300 * MB), (res("a", gpu=0.1, busy=True), res("b", gpu=0.2)),
                      reserved_bytes=100 * MB)
    assert state.free_bytes == 0
    assert [r.entry_id for r, _u in eviction_order(state, now=NOW)] == ["b"]  # the busy one never appears
    a = admit(res("new", gpu=1.0), state, now=NOW)
    assert a.admit and [e.entry_id for e in a.evictions] == ["b"]
    assert not admit(res("new", nbytes=200 * MB, gpu=1.0), state, now=NOW).admit


def test_a_prefix_parent_is_demoted_but_never_dropped():
    parent = res("parent", gpu=0.01, host=0.01, anchored=True)
    leaf = res("leaf", gpu=0.5)
    state = gpu(200, parent, leaf)
    to_host = admit(res("new", gpu=2.0), state, now=NOW, lower=host(1000))
    assert [(e.entry_id, e.kind) for e in to_host.evictions] == [("parent", EvictionKind.DEMOTE)]
    nowhere = admit(res("new", gpu=2.0), state, now=NOW)  # no tier below: the leaf goes instead
    assert [(e.entry_id, e.kind) for e in nowhere.evictions] == [("leaf", EvictionKind.DROP)]


def test_lru_evicts_the_least_recently_used_and_admits_everything():
    old, recent = res("old", gpu=9.0, last_used=NOW - 50), res("recent", gpu=0.01, last_used=NOW - 1)
    state = gpu(200, recent, old)
    lru = Lru()
    assert [r.entry_id for r, _ in eviction_order(state, now=NOW, policy=lru)] == ["old", "recent"]
    a = admit(res("new", gpu=0.0), state, now=NOW, policy=lru)  # worth nothing: LRU takes it anyway
    assert a.admit and [e.entry_id for e in a.evictions] == ["old"]
    assert not admit(res("new", gpu=0.0), state, now=NOW).admit  # by utility it is refused
    assert set(EVICTION_POLICIES) == {"utility", "lru"}


def test_the_reuse_model_reads_a_decayed_use_count_as_a_poisson_rate():
    m = ReuseModel(half_life_s=100.0)
    once = m.used(0.0, NOW, NOW)
    assert m.p_reuse(once, NOW, NOW) == pytest.approx(0.5)  # one use, horizon = half-life
    assert m.p_reuse(once, NOW, NOW + 100) == pytest.approx(1 - math.exp(-0.5 * math.log(2)))
    assert m.p_reuse(once, NOW, NOW + 10_000) < 1e-10  # a one-off decays to nothing
    score, t = 0.0, NOW
    for _ in range(50):  # used every 10 s: the score settles at rate * half-life / ln 2
        score, t = m.used(score, t, t + 10.0), t + 10.0
    assert m.decayed(score, t, t) == pytest.approx(0.1 * 100 / math.log(2), rel=0.05)
    assert m.p_reuse(score, t, t) > 0.99
    with pytest.raises(ValueError):
        ReuseModel(half_life_s=0)


def test_block_gains_are_recompute_minus_the_tiers_share_of_a_load():
    model = shipped_cost_model()
    compute = model.compute_for("meta-llama/Llama-3.1-8B", "h200x1-rdma4x200")
    host = model.link("h200x1-rdma4x200", Tier.HOST, Tier.GPU)
    g0 = block_gains(compute, {Tier.GPU: None, Tier.HOST: host}, block_tokens=16, position=0, nbytes=2 << 20)
    g9 = block_gains(compute, {Tier.GPU: None, Tier.HOST: host}, block_tokens=16, position=9, nbytes=2 << 20)
    c = compute.params.mean
    assert g0[Tier.GPU] == pytest.approx(c[1] * 16 + c[2] * 16 * 16)  # in place: the whole compute
    load = host.per_page_s + (2 << 20) * host.params.mean[2] + host.latency_s
    assert g0[Tier.HOST] == pytest.approx(g0[Tier.GPU] - load)
    assert g9[Tier.GPU] > g0[Tier.GPU]  # deeper: attention over a longer context
    assert block_gains(None, {Tier.DISK: host}, block_tokens=16, position=0, nbytes=1) == {Tier.DISK: 1.0}
