"""The shared remote tier's one capacity ledger: offers admitted or refused, evictions, garbage.

Every worker's tier manager passes the remote tier (Mooncake Store) through unmanaged: its
capacity is shared, so no worker may evict another's blocks from it. :class:`RemoteLedger` is the
ledger of its one owner, the remote-tier manager (:mod:`streams.remote_tier_manager`), and decides
with the same utility as the local tiers (:mod:`nexuskv.admission`: expected gain per byte,
``P(reuse)`` from a decayed use count, pinned and in-use state kept):

* **Offers.** A writer puts its objects first (the backend acknowledges only what reads back)
  and then offers them (:class:`~nexuskv.contracts.tier_offers.TierOffer`). :meth:`RemoteLedger.offer`
  admits each block, in chain order, when it fits under the high watermark or is worth more per
  byte than what it displaces; otherwise it is *refused* and its object must be deleted. A block
  whose prefix parent the tier does not hold is refused (the index could not key it). A block
  already held counts a use.
* **Per-tenant quotas.** A tenant holds at most its share of the capacity below the high
  watermark; at its quota a new block displaces only the tenant's own cheaper blocks.
* **Headroom.** Writers put before they offer, so the store must keep room for saves in
  progress: admissions keep held bytes under the *high* watermark, and once the store's own use
  passes it (:meth:`RemoteLedger.keep_headroom`) the cheapest unpinned, idle blocks leave until
  it is back at the *low* watermark. A full store evicts by utility instead of refusing saves.
* **Pins and reads.** A pinned block (:meth:`RemoteLedger.pin`) and one a transfer reads
  (:meth:`RemoteLedger.reading`, until its deadline or :meth:`RemoteLedger.done`) never leaves;
  a prefix parent that held blocks chain from leaves only after them.
* **Garbage.** An object in the store that no offer named within ``lease_s`` of being first
  seen (:meth:`RemoteLedger.sweep`: a writer that died between its put and its offer, an
  executor's copy the index cannot find) is collected; a held block found missing is forgotten.

Every method takes ``now`` and returns a frozen decision that says what to delete and which
:class:`~nexuskv.dataplane.tier_facts.TierChange` to announce; the service does the I/O (the
store's header checks and deletes, the owner's publisher). Sizes are object bytes: a payload of
``n`` bytes takes ``n + 128`` in the store (its header), as the store counts them.
Not thread-safe: one caller (the service's loop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from nexuskv.admission import (
    ByUtility,
    EvictionPolicy,
    Resident,
    ReuseModel,
    TierBudget,
    TierState,
    admit,
    displacement_price,
    evict_for,
    eviction_order,
)
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity, TierChange
from nexuskv.descriptor import Tier

__all__ = [
    "HeadroomDecision",
    "OfferDecision",
    "OfferedBlock",
    "RemoteGainFn",
    "RemoteLedger",
    "RemoteUsage",
    "SweepDecision",
]

#: ``gains(key, position, nbytes)`` -> EG in seconds of reusing the block from the remote tier.
RemoteGainFn = Callable[[PayloadKey, int, int], float]
_TIER = Tier.REMOTE


@dataclass(frozen=True, slots=True)
class OfferedBlock:
    """One offered block whose stored header the owner checked: its address, payload bytes, chain."""

    key: PayloadKey
    nbytes: int  # payload bytes (the object takes nbytes + HEADER_BYTES)
    position: int
    identity: BlockIdentity

    @property
    def parent(self) -> PayloadKey | None:
        p = self.identity.parent
        return None if p is None else PayloadKey(self.key.descriptor_id, p, self.key.group)


@dataclass(frozen=True, slots=True)
class OfferDecision:
    """What one offer did: admitted and already-held keys; refused and evicted keys (delete their
    objects), each with its reason; the changes to announce, in order."""

    offer_id: str
    tenant: str
    admitted: tuple[PayloadKey, ...] = ()
    already: tuple[PayloadKey, ...] = ()
    refused: tuple[tuple[PayloadKey, str], ...] = ()
    evicted: tuple[tuple[PayloadKey, str], ...] = ()
    changes: tuple[TierChange, ...] = ()

    @property
    def delete(self) -> tuple[PayloadKey, ...]:
        """Objects to delete from the store: the refused, then the evicted."""
        return tuple(k for k, _ in self.refused) + tuple(k for k, _ in self.evicted)


@dataclass(frozen=True, slots=True)
class HeadroomDecision:
    """Evictions that bring the store from above the high watermark back to the low one."""

    used_bytes: int
    target_bytes: int
    evicted: tuple[tuple[PayloadKey, str], ...] = ()
    changes: tuple[TierChange, ...] = ()
    short_bytes: int = 0  # what pinned, busy or anchored state kept from being freed

    @property
    def delete(self) -> tuple[PayloadKey, ...]:
        return tuple(k for k, _ in self.evicted)


@dataclass(frozen=True, slots=True)
class SweepDecision:
    """Garbage to delete (unoffered past the lease) and held blocks found gone (already announced removed)."""

    collected: tuple[PayloadKey, ...] = ()
    lost: tuple[PayloadKey, ...] = ()
    changes: tuple[TierChange, ...] = ()


@dataclass(frozen=True, slots=True)
class RemoteUsage:
    capacity_bytes: int
    used_bytes: int  # object bytes the ledger holds (announced blocks)
    unoffered_bytes: int  # object bytes seen in the store that no offer has named yet
    pinned_bytes: int
    in_flight_bytes: int  # held bytes transfers are reading now
    blocks: int
    unoffered_blocks: int
    price_s_per_gib: float
    price_bytes: int
    counters: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Entry:
    key: PayloadKey
    tenant: str
    nbytes: int  # object bytes
    score: float
    since: float
    last_used: float
    position: int
    identity: BlockIdentity
    gain: float
    admitted_at: float
    parent: PayloadKey | None = None
    children: set[PayloadKey] = field(default_factory=set)
    pins: dict[str, float] = field(default_factory=dict)  # owner -> until
    readers: dict[str, float] = field(default_factory=dict)  # transfer id -> until

    def pinned_until(self) -> float | None:
        return max(self.pins.values()) if self.pins else None


class RemoteLedger:
    """The remote tier's capacity ledger (see the module docstring)."""

    def __init__(self, capacity_bytes: int, *, low_watermark: float = 0.7, high_watermark: float = 0.8,
                 tenant_shares: tuple[float, Mapping[str, float]] = (1.0, {}), lease_s: float = 30.0,
                 policy: EvictionPolicy | None = None, reuse: ReuseModel | None = None,
                 gains: RemoteGainFn | None = None, pin_fraction: float = 0.5) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: {capacity_bytes} is not positive")
        if not 0.0 < low_watermark < high_watermark < 1.0:
            raise ValueError(f"watermarks: need 0 < low ({low_watermark}) < high ({high_watermark}) < 1")
        default, overrides = tenant_shares
        for tenant, share in {"default": default, **overrides}.items():
            if not 0.0 < share <= 1.0:
                raise ValueError(f"tenant share of {tenant}: {share} is not in (0, 1]")
        if lease_s <= 0:
            raise ValueError(f"lease_s: {lease_s} is not positive")
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        self.default_share = default
        self.shares = dict(overrides)
        self.lease_s = lease_s
        self.policy = policy or ByUtility()
        self.reuse = reuse or ReuseModel()
        self.gains = gains
        self.pin_fraction = pin_fraction
        self._blocks: dict[PayloadKey, _Entry] = {}
        self._unoffered: dict[PayloadKey, tuple[float, int]] = {}  # key -> (first seen, object bytes)
        self._reads: dict[str, tuple[tuple[PayloadKey, ...], float]] = {}  # transfer id -> (keys, until)
        self._sizes = 0.0  # running mean object size (the price's typical copy)
        self.counters: dict[str, int] = dict.fromkeys(
            ("offers", "admitted", "already", "refused", "refused_quota", "refused_parent", "refused_utility",
             "evicted", "evicted_headroom", "collected", "lost", "pins", "pins_refused", "reads"), 0)

    # -- queries ----------------------------------------------------------------------------------

    @property
    def high_bytes(self) -> int:
        return int(self.capacity_bytes * self.high_watermark)

    @property
    def low_bytes(self) -> int:
        return int(self.capacity_bytes * self.low_watermark)

    def quota(self, tenant: str) -> int:
        """Object bytes ``tenant`` may hold: its share of the capacity below the high watermark."""
        return int(self.high_bytes * self.shares.get(tenant, self.default_share))

    def holds(self, key: PayloadKey) -> bool:
        return key in self._blocks

    def keys(self) -> list[PayloadKey]:
        return list(self._blocks)

    def tenant_bytes(self, tenant: str) -> int:
        return sum(e.nbytes for e in self._blocks.values() if e.tenant == tenant)

    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self._blocks.values())

    def contents(self) -> dict[int, set[PayloadKey]]:
        """Announced keys by KV group."""
        out: dict[int, set[PayloadKey]] = {}
        for k in self._blocks:
            out.setdefault(k.group, set()).add(k)
        return out

    def state(self, now: float) -> TierState:
        return self._state(now)[0]

    def price(self, nbytes: int, *, now: float) -> float:
        """Seconds of expected gain lost per GiB if ``nbytes`` more landed in the remote tier now."""
        return displacement_price(self.state(now), nbytes, now=now)

    def usage(self, now: float) -> RemoteUsage:
        state, _ = self._state(now)
        size = int(self._sizes) or max(1, self.capacity_bytes // 64)
        pinned = sum(e.nbytes for e in self._blocks.values() if (e.pinned_until() or 0.0) > now)
        reading = sum(e.nbytes for e in self._blocks.values() if any(u > now for u in e.readers.values()))
        return RemoteUsage(
            capacity_bytes=self.capacity_bytes, used_bytes=self.held_bytes(),
            unoffered_bytes=sum(n for _, n in self._unoffered.values()), pinned_bytes=pinned,
            in_flight_bytes=reading, blocks=len(self._blocks), unoffered_blocks=len(self._unoffered),
            price_s_per_gib=displacement_price(state, size, now=now), price_bytes=size, counters=dict(self.counters))

    # -- scoring ----------------------------------------------------------------------------------

    def _gain(self, key: PayloadKey, position: int, nbytes: int) -> float:
        return 1.0 if self.gains is None else self.gains(key, position, nbytes)

    def _p_reuse(self, now: float) -> dict[PayloadKey, float]:
        """``P(reuse)`` of every held block; a prefix parent's is at least its likeliest child's."""
        out: dict[PayloadKey, float] = {}
        for e in sorted(self._blocks.values(), key=lambda b: -b.position):
            p = self.reuse.p_reuse(e.score, e.since, now)
            for child in e.children:
                p = max(p, out.get(child, 0.0))
            out[e.key] = min(1.0, max(0.0, p))
        return out

    def _state(self, now: float, *, tenant: str | None = None) -> tuple[TierState, list[_Entry]]:
        """The tier as :mod:`nexuskv.admission` sees it, under the high watermark (or one tenant's
        blocks under its quota); residents are entry ids into the returned list."""
        p_reuse = self._p_reuse(now)
        refs: list[_Entry] = []
        residents = []
        # Deepest first: a tie in utility (a parent is worth at least its child) then evicts leaves first.
        for e in sorted(self._blocks.values(), key=lambda b: -b.position):
            if tenant is not None and e.tenant != tenant:
                continue
            busy = any(until > now for until in e.readers.values())
            residents.append(Resident(f"{len(refs):09d}", e.tenant, e.nbytes, p_reuse.get(e.key, 0.0), {_TIER: e.gain},
                                      pinned_until=e.pinned_until(), last_used=e.last_used, busy=busy,
                                      anchored=bool(e.children)))
            refs.append(e)
        if tenant is not None:
            budget = TierBudget(_TIER, self.quota(tenant))
            return TierState(budget, tuple(residents)), refs
        budget = TierBudget(_TIER, self.high_bytes, max_pinned_bytes=int(self.capacity_bytes * self.pin_fraction))
        unoffered = sum(n for _, n in self._unoffered.values())
        return TierState(budget, tuple(residents), reserved_bytes=unoffered), refs

    # -- offers -----------------------------------------------------------------------------------

    def offer(self, blocks: Sequence[OfferedBlock], *, offer_id: str, tenant: str, now: float) -> OfferDecision:
        """Admit or refuse each block of one offer, in order (see the module docstring)."""
        self.counters["offers"] += 1
        admitted: list[PayloadKey] = []
        already: list[PayloadKey] = []
        refused: list[tuple[PayloadKey, str]] = []
        evicted: list[tuple[PayloadKey, str]] = []
        changes: list[TierChange] = []
        fresh = [b for b in blocks if b.key not in self._blocks]
        n = max(1, len(fresh))
        gain = sum(self._gain(b.key, b.position, b.nbytes) for b in fresh) / n  # the prompt's mean, per block
        for b in blocks:  # a save is a use of what is held already, counted before anything is scored
            e = self._blocks.get(b.key)
            if e is not None:
                self._use(e, now)
        for b in blocks:
            self._unoffered.pop(b.key, None)
            if b.key in self._blocks:
                already.append(b.key)
                self.counters["already"] += 1
                continue
            parent = b.parent
            if parent is not None and parent not in self._blocks:
                refused.append((b.key, "its prefix parent is not held by the remote tier"))
                self.counters["refused_parent"] += 1
                continue
            size = b.nbytes + HEADER_BYTES
            candidate = Resident("candidate", tenant, size, min(1.0, self.reuse.p_reuse(1.0, now, now)), {_TIER: gain},
                                 last_used=now)
            why = self._make_room(candidate, tenant, now, evicted, changes)
            if why is not None:
                refused.append((b.key, why))
                continue
            e = _Entry(b.key, tenant, size, 1.0, now, now, b.position, b.identity, gain, now, parent=parent)
            self._blocks[b.key] = e
            if parent is not None:
                self._blocks[parent].children.add(b.key)
            changes.append(TierChange("stored", _TIER, b.key, b.identity))
            admitted.append(b.key)
            self.counters["admitted"] += 1
            self._sizes = size if not self._sizes else 0.9 * self._sizes + 0.1 * size
        self.counters["refused"] += len(refused)
        return OfferDecision(offer_id, tenant, tuple(admitted), tuple(already), tuple(refused), tuple(evicted),
                             tuple(changes))

    def _make_room(self, candidate: Resident, tenant: str, now: float, evicted: list[tuple[PayloadKey, str]],
                   changes: list[TierChange]) -> str | None:
        """Evict what ``candidate`` may displace so it fits its tenant's quota and the high watermark;
        None when it fits now, else why it is refused (nothing was evicted then)."""
        quota = self.quota(tenant)
        if candidate.nbytes > quota:
            self.counters["refused_quota"] += 1
            return f"{candidate.nbytes} bytes exceed tenant {tenant}'s quota of {quota} bytes"
        victims: list[tuple[_Entry, str]] = []
        mine = self.tenant_bytes(tenant)
        if quota < self.high_bytes and mine + candidate.nbytes > quota:  # a whole share is the tier's own bound
            own, refs = self._state(now, tenant=tenant)
            evs = evict_for(own, mine + candidate.nbytes - quota, now=now, policy=self.policy, candidate=candidate)
            if evs is None:
                self.counters["refused_quota"] += 1
                return (f"tenant {tenant} holds {mine} of its {quota}-byte quota and its blocks there are worth at least "
                        f"as much per byte (or pinned, read or anchored)")
            victims += [(refs[int(ev.entry_id)], f"tenant quota: {ev.reason}") for ev in evs]
        state, refs = self._state(now)
        if victims:
            gone = {id(v) for v, _ in victims}
            keep = tuple(r for r, e in zip(state.residents, refs) if id(e) not in gone)
            state = TierState(state.budget, keep, reserved_bytes=state.reserved_bytes)
        decision = admit(candidate, state, now=now, policy=self.policy)
        if not decision.admit:
            self.counters["refused_utility"] += 1
            return decision.reason
        if decision.evictions:  # evicting anyway: free down to the low watermark, so the next saves fit
            extra = evict_for(state, candidate.nbytes - state.free_bytes + self.high_bytes - self.low_bytes, now=now,
                              policy=self.policy, candidate=candidate)
            evs = extra if extra is not None else decision.evictions
            victims += [(refs[int(ev.entry_id)], ev.reason) for ev in evs]
        for e, why in victims:
            self._drop(e, why, evicted, changes)
            self.counters["evicted"] += 1
        return None

    def _drop(self, e: _Entry, why: str, out: list[tuple[PayloadKey, str]], changes: list[TierChange]) -> None:
        if self._blocks.pop(e.key, None) is None:
            return
        if e.parent is not None and e.parent in self._blocks:
            self._blocks[e.parent].children.discard(e.key)
        changes.append(TierChange("removed", _TIER, e.key, e.identity))
        out.append((e.key, why))

    def _use(self, e: _Entry, now: float) -> None:
        e.score = self.reuse.used(e.score, e.since, now)
        e.since = now
        e.last_used = now

    # -- headroom ---------------------------------------------------------------------------------

    def keep_headroom(self, store_used_bytes: int, *, now: float) -> HeadroomDecision:
        """Above the high watermark (the store's own count, unoffered objects and saves in flight
        included), evict the cheapest movable blocks until the store would be at the low one.

        Leaves go before the prefix parents they chain from, so this runs in rounds: a parent
        becomes a victim once the blocks after it are gone."""
        self._expire(now)
        if store_used_bytes <= self.high_bytes:
            return HeadroomDecision(store_used_bytes, self.low_bytes)
        need = store_used_bytes - self.low_bytes
        evicted: list[tuple[PayloadKey, str]] = []
        changes: list[TierChange] = []
        freed = 0
        progress = True
        while freed < need and progress:  # a parent left behind in one pass may go in the next
            progress = False
            state, refs = self._state(now)
            for r, u in eviction_order(state, now=now, policy=self.policy):
                if freed >= need:
                    break
                e = refs[int(r.entry_id)]
                if e.children:
                    continue  # blocks still chain from it
                self._drop(e, f"headroom: store at {store_used_bytes} bytes > high watermark {self.high_bytes}; "
                              f"utility {u:.3g} s/B, cheapest first", evicted, changes)
                freed += e.nbytes
                progress = True
        self.counters["evicted"] += len(evicted)
        self.counters["evicted_headroom"] += len(evicted)
        return HeadroomDecision(store_used_bytes, self.low_bytes, tuple(evicted), tuple(changes),
                                max(0, need - freed))

    # -- pins and reads ---------------------------------------------------------------------------

    def pin(self, owner: str, keys: Sequence[PayloadKey], *, until: float, now: float) -> tuple[bool, str]:
        """Pin the held ``keys`` until ``until``, all or none, within the pinned share of the capacity."""
        targets = [self._blocks[k] for k in keys if k in self._blocks]
        if not targets or until <= now:
            return True, "nothing held here to pin"
        add = sum(e.nbytes for e in targets if (e.pinned_until() or 0.0) <= now)
        pinned = sum(e.nbytes for e in self._blocks.values() if (e.pinned_until() or 0.0) > now)
        cap = int(self.capacity_bytes * self.pin_fraction)
        if pinned + add > cap:
            self.counters["pins_refused"] += 1
            return False, f"pinned bytes would exceed {cap} on the remote tier (pin {owner}, {add} bytes)"
        for e in targets:
            e.pins[owner] = max(until, e.pins.get(owner, until))
            self._use(e, now)
        self.counters["pins"] += 1
        return True, f"{len(targets)} blocks pinned until {until:.3f}"

    def unpin(self, owner: str) -> int:
        n = 0
        for e in self._blocks.values():
            if e.pins.pop(owner, None) is not None:
                n += 1
        return n

    def reading(self, transfer_id: str, keys: Sequence[PayloadKey], *, until: float, now: float) -> int:
        """A transfer reads ``keys`` until ``until`` (its deadline) or :meth:`done`: they stay; each
        counts one use. Returns how many are held."""
        held = tuple(k for k in keys if k in self._blocks)
        for k in held:
            e = self._blocks[k]
            e.readers[transfer_id] = until
            self._use(e, now)
        if held:
            self._reads[transfer_id] = (held, until)
            self.counters["reads"] += 1
        return len(held)

    def done(self, transfer_id: str) -> int:
        """The transfer finished (any outcome): its blocks may leave again."""
        keys, _ = self._reads.pop(transfer_id, ((), 0.0))
        for k in keys:
            e = self._blocks.get(k)
            if e is not None:
                e.readers.pop(transfer_id, None)
        return len(keys)

    def touch(self, keys: Sequence[PayloadKey], *, now: float) -> int:
        """One use of each held key (a hit served from the tier); returns how many were held."""
        n = 0
        for k in keys:
            e = self._blocks.get(k)
            if e is not None:
                self._use(e, now)
                n += 1
        return n

    def _expire(self, now: float) -> None:
        for tid, (keys, until) in list(self._reads.items()):
            if now >= until:
                self.done(tid)
        for e in self._blocks.values():
            for owner, until in list(e.pins.items()):
                if now >= until:
                    del e.pins[owner]

    # -- garbage ----------------------------------------------------------------------------------

    def sweep(self, listed: Mapping[PayloadKey, int], *, listed_at: float, now: float) -> SweepDecision:
        """Reconcile with a listing of the store taken at ``listed_at`` (key -> object bytes):
        objects no offer named within ``lease_s`` of being first seen are collected; held blocks
        admitted before the listing but absent from it are lost (forgotten, announced removed)."""
        self._expire(now)
        collected: list[PayloadKey] = []
        for key, nbytes in listed.items():
            if key in self._blocks:
                continue
            first, _ = self._unoffered.get(key, (listed_at, nbytes))
            if now - first >= self.lease_s:
                self._unoffered.pop(key, None)
                collected.append(key)
            else:
                self._unoffered[key] = (first, nbytes)
        for key in [k for k in self._unoffered if k not in listed]:
            del self._unoffered[key]  # gone already (deleted by its writer, or collected)
        lost: list[tuple[PayloadKey, str]] = []
        changes: list[TierChange] = []
        for e in sorted(self._blocks.values(), key=lambda b: -b.position):
            if e.key not in listed and e.admitted_at < listed_at:
                e.children.clear()
                self._drop(e, "lost: missing from the store", lost, changes)
        self.counters["collected"] += len(collected)
        self.counters["lost"] += len(lost)
        return SweepDecision(tuple(collected), tuple(k for k, _ in lost), tuple(changes))
