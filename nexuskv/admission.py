"""Admission and eviction by one utility, with pins, TTLs, tier budgets, demotion or drop.

The utility of keeping a unit of state in a tier is its expected gain per byte there
(whitepaper §7.5)::

    utility(entry, tier) = P(reuse) * max(0, EG(entry, tier)) / bytes        seconds per byte

where ``EG(entry, tier)`` is the Effective Gain a reuse served from that tier would have (the
planner's number: recompute time minus the cost of serving it from there; :func:`block_gains`
derives it from the cost model for one block). Admission and eviction use the same number: a
candidate is admitted only if it is worth more per byte than everything it would displace;
victims leave cheapest first (expired ones first of all: a TTL past is utility 0); a pinned
resident, and one a transfer is reading (``busy``), never leaves. A victim is *demoted* to the
next tier when it still has positive utility there and that tier has room, and *dropped*
otherwise — the sglang#26305 lesson: state whose only remaining home is a tier slower than
recomputing is not worth keeping. Demotion does not cascade: the lower tier's own evictions are
its own admission. A resident other held blocks chain from (``anchored``: a prefix parent) may be
demoted but not dropped, so the blocks after it stay reachable by prefix; it can be dropped once
they are gone (leaves first, as SGLang's radix cache evicts).

``P(reuse)`` comes from a block's use history (:class:`ReuseModel`: an exponentially decayed use
count read as a Poisson rate; a block used once decays towards 0, one that recurs stays near 1).

Which resident leaves first is an :class:`EvictionPolicy`: :class:`ByUtility` (the above) or
:class:`Lru` (least recently used first, everything admitted: the engine-native baseline the
§10.4 ablation compares against).

:func:`displacement_price` turns the same utilities into the ``C_pollution`` price the planner
charges a prefetch (seconds of expected gain lost per GiB it would displace).

Everything here is pure: snapshots in, frozen decisions out; the tier managers
(:mod:`nexuskv.dataplane.tiers`) act on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import ClassVar, Protocol

from nexuskv.cost import ComputeCost, LinkCost
from nexuskv.descriptor import Tier

__all__ = ["Resident", "TierBudget", "TierState", "EvictionKind", "Eviction", "Admission", "PinDecision",
           "EvictionPolicy", "ByUtility", "Lru", "EVICTION_POLICIES", "ReuseModel", "block_gains",
           "utility", "admit", "evict_for", "eviction_order", "pin", "displacement_price"]

GIB = float(1 << 30)
_LN2 = math.log(2.0)


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
    last_used: float = 0.0  # seconds since the epoch (what LRU ranks by)
    busy: bool = False  # a transfer or reader is using it now: never a victim
    anchored: bool = False  # held blocks chain from it: demote it if it must leave, never drop it

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

    def movable(self, now: float) -> bool:
        """May leave its tier now (neither pinned nor in use)."""
        return not self.busy and not self.pinned(now)


def utility(entry: Resident, tier: Tier, *, now: float) -> float:
    """``P(reuse) * max(0, EG(tier)) / bytes`` — seconds of expected gain per byte; 0 when expired."""
    if entry.expired(now):
        return 0.0
    gain = entry.gains.get(tier)
    if gain is None or gain <= 0.0:
        return 0.0
    return entry.p_reuse * gain / entry.nbytes


# -- the use history behind P(reuse) ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReuseModel:
    """``P(reuse within horizon)`` from an exponentially decayed use count.

    Each use adds 1 to a score that halves every ``half_life_s``; a steady rate of λ uses per
    second holds the score at ``λ * half_life / ln 2``, so the score read back as a rate is
    ``λ = score * ln 2 / half_life``, and ``P(reuse) = 1 - exp(-λ * horizon)`` (Poisson). A block
    used once starts at ``1 - 2^(-horizon/half_life)`` (0.5 with the default horizon) and decays;
    one that recurs faster than its half-life stays near 1.
    """

    half_life_s: float = 600.0
    horizon_s: float | None = None  # None: the half-life

    def __post_init__(self) -> None:
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s: {self.half_life_s} is not positive")
        if self.horizon_s is not None and not self.horizon_s > 0:
            raise ValueError(f"horizon_s: {self.horizon_s} is not positive")

    def decayed(self, score: float, since: float, now: float) -> float:
        """``score`` last updated at ``since``, as it stands at ``now``."""
        if now <= since:
            return score
        return score * 2.0 ** (-(now - since) / self.half_life_s)

    def used(self, score: float, since: float, now: float, uses: float = 1.0) -> float:
        """The score after ``uses`` more uses at ``now``."""
        return self.decayed(score, since, now) + uses

    def p_reuse(self, score: float, since: float, now: float) -> float:
        rate = self.decayed(score, since, now) * _LN2 / self.half_life_s
        horizon = self.horizon_s if self.horizon_s is not None else self.half_life_s
        return 1.0 - math.exp(-rate * horizon)


def block_gains(compute: ComputeCost | None, links: Mapping[Tier, LinkCost | None], *, block_tokens: int,
                position: int, nbytes: int) -> dict[Tier, float]:
    """EG in seconds of reusing one block from each tier instead of recomputing it.

    The block's compute is its marginal prefill at its depth, ``c1*b + c2*b*s`` for ``b`` tokens
    ending a context of ``s = (position + 1) * b``; serving it costs its share of the tier's link
    to the GPU, ``per_page + bytes * seconds_per_byte + latency / (position + 1)`` (one load
    brings the block with its prefix, so the fixed latency is shared by the blocks before it).
    A tier without a link in ``links`` cannot serve it and gets no entry; a link of ``None`` means
    in place (no copy, the GPU tier). Without a compute cost (an unknown model) every listed tier
    gets 1 second: utilities then rank by reuse and bytes alone.
    """
    if compute is None:
        return {tier: 1.0 for tier in links}
    b = block_tokens
    c = compute.params.mean
    gain = c[1] * b + c[2] * b * (position + 1) * b
    out: dict[Tier, float] = {}
    for tier, link in links.items():
        if link is None:
            out[tier] = gain
            continue
        out[tier] = gain - (link.per_page_s + nbytes * link.params.mean[2] + link.latency_s / (position + 1))
    return out


# -- budgets and state -----------------------------------------------------------------------------

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
    """What a tier holds now, and the bytes set aside in it (reservations, copies landing)."""

    budget: TierBudget
    residents: tuple[Resident, ...] = ()
    reserved_bytes: int = 0

    @property
    def tier(self) -> Tier:
        return self.budget.tier

    @property
    def used_bytes(self) -> int:
        return sum(r.nbytes for r in self.residents)

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget.capacity_bytes - self.used_bytes - self.reserved_bytes)

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


# -- policies --------------------------------------------------------------------------------------

class EvictionPolicy(Protocol):
    """Which resident leaves first (lowest ``priority``), and whether a newcomer may displace it."""

    name: ClassVar[str]

    def priority(self, resident: Resident, tier: Tier, *, now: float) -> float: ...

    def may_displace(self, candidate: Resident, victim_priority: float, tier: Tier, *, now: float) -> bool: ...


class ByUtility:
    """Cheapest per byte first; a newcomer displaces only what is worth less per byte than itself
    (a tie keeps the resident: state gets the chance to be used again before an equal one takes
    its place)."""

    name: ClassVar[str] = "utility"

    def priority(self, resident: Resident, tier: Tier, *, now: float) -> float:
        return utility(resident, tier, now=now)

    def may_displace(self, candidate: Resident, victim_priority: float, tier: Tier, *, now: float) -> bool:
        return victim_priority < utility(candidate, tier, now=now)


class Lru:
    """Least recently used first; everything is admitted (vLLM's and SGLang's own caches)."""

    name: ClassVar[str] = "lru"

    def priority(self, resident: Resident, tier: Tier, *, now: float) -> float:
        return 0.0 if resident.expired(now) else resident.last_used

    def may_displace(self, candidate: Resident, victim_priority: float, tier: Tier, *, now: float) -> bool:
        return True


EVICTION_POLICIES: dict[str, type] = {p.name: p for p in (ByUtility, Lru)}
_UTILITY = ByUtility()


def eviction_order(state: TierState, *, now: float,
                   policy: EvictionPolicy | None = None) -> tuple[tuple[Resident, float], ...]:
    """Residents that may leave, first to go first: ``(resident, priority)``; ties by entry id.

    Pinned and busy residents never appear. With the default policy the priority is the
    utility per byte.
    """
    chosen = policy or _UTILITY
    tier = state.tier
    scored = [(r, chosen.priority(r, tier, now=now)) for r in state.residents if r.movable(now)]
    scored.sort(key=lambda ru: (ru[1], ru[0].entry_id))
    return tuple(scored)


def _eviction(victim: Resident, u: float, lower: TierState | None, lower_free: int, now: float,
              why: str) -> Eviction | None:
    if lower is not None and victim.nbytes <= lower_free:
        below = utility(victim, lower.tier, now=now)
        if below > 0.0:
            return Eviction(victim.entry_id, EvictionKind.DEMOTE, victim.nbytes, u, lower.tier,
                            f"{why}; still worth {below:.3g} s/B on {lower.tier.value}")
        if victim.anchored:
            return None
        return Eviction(victim.entry_id, EvictionKind.DROP, victim.nbytes, u, None,
                        f"{why}; reuse from {lower.tier.value} would not pay (EG <= 0 there)")
    if victim.anchored:
        return None  # blocks chain from it: it may move down, not vanish
    reason = f"{why}; no room below" if lower is not None else f"{why}; no lower tier"
    return Eviction(victim.entry_id, EvictionKind.DROP, victim.nbytes, u, None, reason)


def evict_for(state: TierState, need_bytes: int, *, now: float, lower: TierState | None = None,
              below_utility: float | None = None, policy: EvictionPolicy | None = None,
              candidate: Resident | None = None) -> tuple[Eviction, ...] | None:
    """Evictions that free ``need_bytes``, first to go first; None if that cannot be done.

    With ``below_utility`` (or a ``candidate`` and a policy that judges it), only residents the
    newcomer may displace may go; None when that is not enough.
    """
    if need_bytes <= 0:
        return ()
    chosen = policy or _UTILITY
    freed, out, lower_free = 0, [], (lower.free_bytes if lower is not None else 0)
    for victim, u in eviction_order(state, now=now, policy=chosen):
        if freed >= need_bytes:
            break
        if below_utility is not None and u >= below_utility:
            return None
        if candidate is not None and not chosen.may_displace(candidate, u, state.tier, now=now):
            return None
        if victim.expired(now):
            why = "expired (TTL)"
        elif chosen.name == "utility":
            why = f"utility {u:.3g} s/B, cheapest first"
        else:
            why = f"{chosen.name}: priority {u:.6g}, lowest first"
        ev = _eviction(victim, utility(victim, state.tier, now=now), lower, lower_free, now, why)
        if ev is None:
            continue
        if ev.kind is EvictionKind.DEMOTE:
            lower_free -= victim.nbytes
        out.append(ev)
        freed += victim.nbytes
    return tuple(out) if freed >= need_bytes else None


def admit(candidate: Resident, state: TierState, *, now: float, lower: TierState | None = None,
          policy: EvictionPolicy | None = None) -> Admission:
    """Admit ``candidate`` to ``state``'s tier if the policy lets it displace what it must.

    By utility (the default): only when it is worth more per byte than everything it displaces,
    and never when it is worth nothing there. By LRU: whenever unpinned residents can make room.
    """
    chosen = policy or _UTILITY
    tier = state.tier
    u = utility(candidate, tier, now=now)

    def refuse(reason: str) -> Admission:
        return Admission(candidate.entry_id, tier, False, u, (), reason)

    if u <= 0.0 and chosen.name == "utility":
        return refuse(f"no gain from {tier.value}: EG <= 0 or expired, caching it here cannot pay")
    quota = state.budget.tenant_quota_bytes.get(candidate.tenant)
    if quota is not None and state.tenant_bytes(candidate.tenant) + candidate.nbytes > quota:
        return refuse(f"tenant {candidate.tenant} would exceed its {quota} bytes on {tier.value}")
    if candidate.nbytes > state.budget.capacity_bytes:
        return refuse(f"{candidate.nbytes} bytes exceed the tier's capacity {state.budget.capacity_bytes}")
    need = candidate.nbytes - state.free_bytes
    evictions = evict_for(state, need, now=now, lower=lower, policy=chosen, candidate=candidate)
    if evictions is None:
        if chosen.name == "utility":
            return refuse(f"would displace state worth at least its {u:.3g} s/B (or pinned, busy or anchored state)")
        return refuse("no room: what is left is pinned, busy or anchored")
    reason = (f"utility {u:.3g} s/B" if chosen.name == "utility" else f"{chosen.name}") + (
        f", displacing {len(evictions)} entries" if evictions else ", fits")
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
    displace, per GiB. Infinite when pinned or busy state makes room impossible.
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
