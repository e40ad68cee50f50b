"""Admission and eviction by one utility, with pins, TTLs, tier budgets, demotion or drop.

The utility of keeping a unit of state in a tier is its expected gain per byte there
(whitepaper §7.5)::

    utility(entry, tier) = P(reuse) * max(0, EG(entry, tier)) / bytes        seconds per byte

where ``EG(entry, tier)`` is the Effective Gain a reuse served from that tier would have (the
planner's number: recompute time minus the cost of serving it from there). Admission and
eviction use the same number: a candidate is admitted only if it is worth more per byte than
everything it would displace; victims leave cheapest first (expired ones first of all: a TTL
past is utility 0); a pinned resident never leaves. A victim is *demoted* to the next tier when it
still has positive utility there and that tier has room, and *dropped* otherwise — the
sglang#26305 lesson: state whose only remaining home is a tier slower than recomputing is not
worth keeping. Demotion does not cascade: the lower tier's own evictions are its own admission.

:func:`displacement_price` turns the same utilities into the ``C_pollution`` price the planner
charges a prefetch (seconds of expected gain lost per GiB it would displace).

Everything here is pure: snapshots in, frozen decisions out; the tier managers act on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from nexuskv.descriptor import Tier

__all__ = ["Resident", "TierBudget", "TierState", "EvictionKind", "Eviction", "Admission", "PinDecision",
           "utility", "admit", "evict_for", "eviction_order", "pin", "displacement_price"]

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class Resident:
    """A unit of state a tier holds (or is asked to hold), with what it is worth."""

    entry_id: str
    tenant: str
    nbytes: int
    p_reuse: float  # probability of reuse within the planning horizon, [0, 1]
    gains: Mapping[Tier, float]  # EG in seconds if reused from each tier; a missing tier cannot serve it
    pinned_until: float | None = None  # seconds since the epoch
    expires_at: float | None = None  # TTL: seconds since the epoch

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"nbytes: {self.nbytes} is not positive")
        if not 0.0 <= self.p_reuse <= 1.0:
            raise ValueError(f"p_reuse: {self.p_reuse} is not a probability")
        object.__setattr__(self, "gains", MappingProxyType(dict(self.gains)))

    def pinned(self, now: float) -> bool:
        return self.pinned_until is not None and now < self.pinned_until

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def utility(entry: Resident, tier: Tier, *, now: float) -> float:
    """``P(reuse) * max(0, EG(tier)) / bytes`` — seconds of expected gain per byte; 0 when expired."""
    if entry.expired(now):
        return 0.0
    gain = entry.gains.get(tier)
    if gain is None or gain <= 0.0:
        return 0.0
    return entry.p_reuse * gain / entry.nbytes


@dataclass(frozen=True, slots=True)
class TierBudget:
    """Capacity of one tier of one worker, and the limits inside it (bytes)."""

    tier: Tier
    capacity_bytes: int
    max_pinned_bytes: int | None = None
    tenant_quota_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_quota_bytes", MappingProxyType(dict(self.tenant_quota_bytes)))


@dataclass(frozen=True, slots=True)
class TierState:
    """What a tier holds now."""

    budget: TierBudget
    residents: tuple[Resident, ...] = ()

    @property
    def tier(self) -> Tier:
        return self.budget.tier

    @property
    def used_bytes(self) -> int:
        return sum(r.nbytes for r in self.residents)

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget.capacity_bytes - self.used_bytes)

    def tenant_bytes(self, tenant: str) -> int:
        return sum(r.nbytes for r in self.residents if r.tenant == tenant)

    def pinned_bytes(self, now: float) -> int:
        return sum(r.nbytes for r in self.residents if r.pinned(now))


class EvictionKind(StrEnum):
    DEMOTE = "demote"
    DROP = "drop"


@dataclass(frozen=True, slots=True)
class Eviction:
    entry_id: str
    kind: EvictionKind
    nbytes: int
    utility: float  # per byte, in the tier it leaves
    to_tier: Tier | None
    reason: str


@dataclass(frozen=True, slots=True)
class Admission:
    entry_id: str
    tier: Tier
    admit: bool
    utility: float
    evictions: tuple[Eviction, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class PinDecision:
    entry_id: str
    ok: bool
    reason: str


def eviction_order(state: TierState, *, now: float) -> tuple[tuple[Resident, float], ...]:
    """Unpinned residents, cheapest first: ``(resident, utility per byte)``; ties by entry id."""
    scored = [(r, utility(r, state.tier, now=now)) for r in state.residents if not r.pinned(now)]
    scored.sort(key=lambda ru: (ru[1], ru[0].entry_id))
    return tuple(scored)


def _eviction(victim: Resident, u: float, lower: TierState | None, lower_free: int, now: float,
              why: str) -> Eviction:
    if lower is not None and victim.nbytes <= lower_free:
        below = utility(victim, lower.tier, now=now)
        if below > 0.0:
            return Eviction(victim.entry_id, EvictionKind.DEMOTE, victim.nbytes, u, lower.tier,
                            f"{why}; still worth {below:.3g} s/B on {lower.tier.value}")
        return Eviction(victim.entry_id, EvictionKind.DROP, victim.nbytes, u, None,
                        f"{why}; reuse from {lower.tier.value} would not pay (EG <= 0 there)")
    reason = f"{why}; no room below" if lower is not None else f"{why}; no lower tier"
    return Eviction(victim.entry_id, EvictionKind.DROP, victim.nbytes, u, None, reason)


def evict_for(state: TierState, need_bytes: int, *, now: float, lower: TierState | None = None,
              below_utility: float | None = None) -> tuple[Eviction, ...] | None:
    """Evictions that free ``need_bytes``, cheapest first; None if that cannot be done.

    With ``below_utility``, only residents worth less per byte may go (None when that is not enough).
    """
    if need_bytes <= 0:
        return ()
    freed, out, lower_free = 0, [], (lower.free_bytes if lower is not None else 0)
    for victim, u in eviction_order(state, now=now):
        if freed >= need_bytes:
            break
        if below_utility is not None and u >= below_utility:
            return None
        why = "expired (TTL)" if victim.expired(now) else f"utility {u:.3g} s/B, cheapest first"
        ev = _eviction(victim, u, lower, lower_free, now, why)
        if ev.kind is EvictionKind.DEMOTE:
            lower_free -= victim.nbytes
        out.append(ev)
        freed += victim.nbytes
    return tuple(out) if freed >= need_bytes else None


def admit(candidate: Resident, state: TierState, *, now: float, lower: TierState | None = None) -> Admission:
    """Admit ``candidate`` to ``state``'s tier if it is worth more per byte than what it displaces."""
    tier = state.tier
    u = utility(candidate, tier, now=now)

    def refuse(reason: str) -> Admission:
        return Admission(candidate.entry_id, tier, False, u, (), reason)

    if u <= 0.0:
        return refuse(f"no gain from {tier.value}: EG <= 0 or expired, caching it here cannot pay")
    quota = state.budget.tenant_quota_bytes.get(candidate.tenant)
    if quota is not None and state.tenant_bytes(candidate.tenant) + candidate.nbytes > quota:
        return refuse(f"tenant {candidate.tenant} would exceed its {quota} bytes on {tier.value}")
    if candidate.nbytes > state.budget.capacity_bytes:
        return refuse(f"{candidate.nbytes} bytes exceed the tier's capacity {state.budget.capacity_bytes}")
    need = candidate.nbytes - state.free_bytes
    evictions = evict_for(state, need, now=now, lower=lower, below_utility=u)
    if evictions is None:
        return refuse(f"would displace state worth at least its {u:.3g} s/B (or pinned state)")
    reason = f"utility {u:.3g} s/B" + (f", displacing {len(evictions)} cheaper entries" if evictions else ", fits")
    return Admission(candidate.entry_id, tier, True, u, evictions, reason)


def pin(entry: Resident, state: TierState, *, until: float, now: float) -> PinDecision:
    """Whether ``entry`` may be pinned until ``until`` within the tier's pinned-bytes budget."""
    cap = state.budget.max_pinned_bytes
    already = entry.pinned(now)
    if cap is not None and not already and state.pinned_bytes(now) + entry.nbytes > cap:
        return PinDecision(entry.entry_id, False,
                           f"pinned bytes would exceed {cap} on {state.tier.value}")
    return PinDecision(entry.entry_id, True, f"pinned until {until:.3f}")


def displacement_price(state: TierState, nbytes: int, *, now: float) -> float:
    """Seconds of expected gain lost per GiB if ``nbytes`` of new state landed in this tier.

    0 while it fits in free space; otherwise the utility of the cheapest residents it would
    displace, per GiB. Infinite when pinned state makes room impossible.
    """
    need = nbytes - state.free_bytes
    if need <= 0 or nbytes <= 0:
        return 0.0
    lost, freed = 0.0, 0
    for victim, u in eviction_order(state, now=now):
        if freed >= need:
            break
        lost += u * victim.nbytes
        freed += victim.nbytes
    if freed < need:
        return float("inf")
    return lost / (nbytes / GIB)
