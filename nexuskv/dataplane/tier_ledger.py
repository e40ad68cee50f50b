"""The tier manager's ledger: what is where in one worker's tiers, and who holds it there.

The pure part of :class:`~nexuskv.dataplane.tiers.TierManager` (the in-engine adapter's tier
manager; the service is :mod:`streams.tier_manager`): every held block with its copies per
backend, its use history, identity and prefix links; the pins on it; the room set aside per
transfer (reservations); the leases of blocks nobody can find through the index; the counters and
the drop log. It does no I/O, reads no clock and starts no thread: the time of every change is
passed in, a backend is an opaque handle here (only its tier is read), what a backend counts
comes in as a :class:`Room`, the changes the index must learn go out as
:class:`~nexuskv.dataplane.tier_facts.TierChange` records appended to the caller's list, and a
reservation the ledger lets go of is handed back for the caller to release. The facade holds its
lock around every call; the mover (:mod:`.tier_mover`) does what the ledger records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nexuskv.admission import Resident, ReuseModel, TierBudget, TierState
from nexuskv.admission import pin as pin_decision
from nexuskv.dataplane.payload import PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity, TierChange
from nexuskv.descriptor import Tier

__all__ = ["Room", "Copy", "LedgerBlock", "Held", "PinOutcome", "HintEffect", "GainFn", "TierLedger", "COUNTERS"]

#: ``gains(key, position, nbytes)`` -> EG in seconds of reusing the block from each tier.
GainFn = Callable[[PayloadKey, int, int], Mapping[Tier, float]]

COUNTERS = ("saved", "save_refused", "save_failed", "copies_admitted", "copies_refused", "landed", "demoted",
            "dropped", "blocks_dropped", "garbage", "pins", "pins_refused", "reservations", "reservations_refused",
            "reservations_expired", "reservations_shortened", "hint_blocks_refused")


def tier_of(backend: Any) -> Tier:
    return backend.capabilities.tier


@dataclass(frozen=True, slots=True)
class Room:
    """What one backend counts now: its capacity, the payload bytes it stores and its free bytes
    (capacity less stored, reserved and committing)."""

    capacity_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class PinOutcome:
    ok: bool
    pinned_blocks: int
    reason: str


@dataclass(frozen=True, slots=True)
class HintEffect:
    """What an evict or demote hint did: blocks acted on, and blocks left alone by reason
    (``tenant``: another tenant's; ``pinned``; ``busy``: being read or copied; ``anchored``: a prefix
    parent held blocks chain from)."""

    acted: int
    refused: Mapping[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        left = ", ".join(f"{n} {why}" for why, n in sorted(self.refused.items()))
        return f"{self.acted}" + (f" (left alone: {left})" if left else "")


@dataclass(slots=True)
class Copy:
    """One block's copy in one backend."""

    backend: Any
    nbytes: int
    readers: int = 0
    leaving: bool = False
    landing: str | None = None  # transfer id it landed by (demote/evict hints name it)


@dataclass(slots=True)
class LedgerBlock:
    key: PayloadKey
    tenant: str
    nbytes: int
    score: float
    since: float
    last_used: float
    position: int
    parent: PayloadKey | None = None
    identity: BlockIdentity | None = None  # None: held, not announced (no tokens were given)
    children: set[PayloadKey] = field(default_factory=set)  # announced blocks held here whose parent this is
    lease_until: float | None = None  # unannounced blocks: worth keeping until then
    pins: dict[str, float] = field(default_factory=dict)  # owner -> until
    gains: Mapping[Tier, float] | None = None
    copies: dict[int, Copy] = field(default_factory=dict)  # id(backend) -> copy

    def pinned_until(self) -> float | None:
        return max(self.pins.values()) if self.pins else None


@dataclass(slots=True)
class Held:
    """Room set aside in one backend, for a prefetch hint or a copy in progress."""

    backend: Any
    reservation: Any  # the backend's Reservation: released by whoever takes it out of the ledger
    expires_at: float
    tenant: str
    landing: bool = False  # a copy is writing into it now


class TierLedger:
    """What the tiers of one worker hold, pins, reservations and leases (see the module docstring)."""

    def __init__(self, backends: Sequence[Any], *, reuse: ReuseModel, gains: GainFn | None, pin_fraction: float,
                 tenant_pin_quota: Callable[[str], int | None] | None, lease_s: float, drop_log: int) -> None:
        self.backends = tuple(backends)
        self.reuse = reuse
        self.gains = gains
        self.pin_fraction = pin_fraction
        self.tenant_pin_quota = tenant_pin_quota
        self.lease_s = lease_s
        self.blocks: dict[PayloadKey, LedgerBlock] = {}
        self.held: dict[str, Held] = {}  # transfer id -> room set aside for it
        self.landed: dict[str, list[tuple[PayloadKey, int]]] = {}  # transfer id -> blocks it landed, where
        self.price_bytes: dict[int, float] = {}
        #: The last drops, newest last: (time, key, tier, why) — what left the worker's tiers and why.
        self.drops: deque[tuple[float, PayloadKey, Tier, str]] = deque(maxlen=drop_log)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- queries ----------------------------------------------------------------------------------

    def holds(self, key: PayloadKey, tier: Tier) -> bool:
        blk = self.blocks.get(key)
        return blk is not None and any(tier_of(c.backend) is tier and not c.leaving for c in blk.copies.values())

    def keys(self, tier: Tier) -> list[PayloadKey]:
        return [k for k, blk in self.blocks.items() if any(tier_of(c.backend) is tier for c in blk.copies.values())]

    def keys_in(self, backend: Any) -> set[PayloadKey]:
        return {k for k, blk in self.blocks.items() if id(backend) in blk.copies}

    def contents(self) -> dict[tuple[Tier, int], set[PayloadKey]]:
        out: dict[tuple[Tier, int], set[PayloadKey]] = {}
        for blk in self.blocks.values():
            if blk.identity is None:
                continue
            for c in blk.copies.values():
                out.setdefault((tier_of(c.backend), blk.key.group), set()).add(blk.key)
        return out

    def readable(self, key: PayloadKey, tier: Tier) -> Copy | None:
        """The copy of ``key`` in ``tier`` a read may use (not one leaving)."""
        blk = self.blocks.get(key)
        if blk is None:
            return None
        return next((c for c in blk.copies.values() if tier_of(c.backend) is tier and not c.leaving), None)

    def counts(self, backend: Any, now: float) -> tuple[int, int, int, int, int]:
        """(blocks, unannounced blocks, pinned bytes, reserved bytes, bytes of copies landing) in ``backend``."""
        blocks = unannounced = pinned = 0
        for blk in self.blocks.values():
            c = blk.copies.get(id(backend))
            if c is None:
                continue
            blocks += 1
            unannounced += blk.identity is None
            pu = blk.pinned_until()
            if pu is not None and now < pu:
                pinned += c.nbytes
        reserved = sum(h.reservation.remaining for h in self.held.values() if h.backend is backend)
        landing = sum(h.reservation.remaining for h in self.held.values() if h.backend is backend and h.landing)
        return blocks, unannounced, pinned, reserved, landing

    def price_size(self, backend: Any, capacity_bytes: int) -> int:
        """The copy size a tier's price is quoted for: the running mean of what entered it."""
        return int(self.price_bytes.get(id(backend)) or max(1, capacity_bytes // 64))

    def landed_keys(self, transfer_id: str) -> list[PayloadKey]:
        return [k for k, _ in self.landed.get(transfer_id, [])]

    def leaves_first(self, keys: Sequence[PayloadKey]) -> list[PayloadKey]:
        """``keys``, deepest first: a prefix parent leaves only after the blocks that chain from it."""
        return sorted(keys, key=lambda k: -(self.blocks[k].position if k in self.blocks else 0))

    # -- scoring ----------------------------------------------------------------------------------

    def gains_of(self, blk: LedgerBlock) -> Mapping[Tier, float]:
        """The block's EG per tier, as valued when it was admitted (with the prompt it came with)."""
        if blk.gains is None:
            blk.gains = self.block_gains(blk.key, blk.position, blk.nbytes)
        return blk.gains

    def block_gains(self, key: PayloadKey, position: int, nbytes: int) -> Mapping[Tier, float]:
        if self.gains is None:
            return {tier_of(b): 1.0 for b in self.backends}
        return self.gains(key, position, nbytes)

    def run_gains(self, run: Sequence[tuple[PayloadKey, int, int]]) -> dict[Tier, float]:
        """The mean EG per block of a run of blocks ``(key, position, nbytes)`` saved or copied together.

        Every block of a prompt is valued alike, at the prompt's mean: a block's own EG grows with
        its depth (attention over a longer context), but a deep block is worth nothing without the
        shallow ones before it, so valuing blocks by depth would refuse a new prompt's first
        blocks — and with them the whole prompt — wherever deep blocks of older prompts sit.
        """
        total: dict[Tier, float] = {}
        for key, position, nbytes in run:
            for tier, g in self.block_gains(key, position, nbytes).items():
                total[tier] = total.get(tier, 0.0) + g
        n = max(1, len(run))
        return {tier: g / n for tier, g in total.items()}

    def p_reuse(self, now: float) -> dict[PayloadKey, float]:
        """``P(reuse)`` of every held block; a prefix parent's is at least its likeliest child's (any
        reuse of a block reuses its prefix)."""
        out: dict[PayloadKey, float] = {}
        for blk in sorted(self.blocks.values(), key=lambda b: -b.position):
            if blk.identity is None:
                lease = blk.lease_until if blk.lease_until is not None else now
                p = 1.0 if now < lease else 0.0
            else:
                p = self.reuse.p_reuse(blk.score, blk.since, now)
            for child in blk.children:
                p = max(p, out.get(child, 0.0))
            out[blk.key] = min(1.0, max(0.0, p))
        return out

    def resident(self, blk: LedgerBlock, copy: Copy, now: float, entry_id: str, p: float) -> Resident:
        expires = (blk.lease_until if blk.lease_until is not None else now) if blk.identity is None else None
        return Resident(entry_id, blk.tenant, copy.nbytes, p, self.gains_of(blk),
                        pinned_until=blk.pinned_until(), expires_at=expires, last_used=blk.last_used,
                        busy=copy.readers > 0 or copy.leaving, anchored=bool(blk.children) and len(blk.copies) == 1)

    def state(self, backend: Any, room: Room, now: float, refs: list | None = None,
              p_reuse: dict[PayloadKey, float] | None = None) -> TierState:
        """``backend``'s residents and budget for :mod:`nexuskv.admission`; ``refs`` collects the
        blocks in resident order (a resident's ``entry_id`` is its index there)."""
        p_reuse = p_reuse if p_reuse is not None else self.p_reuse(now)
        residents = []
        for blk in self.blocks.values():
            c = blk.copies.get(id(backend))
            if c is None:
                continue
            residents.append(self.resident(blk, c, now, str(len(residents)), p_reuse.get(blk.key, 0.0)))
            if refs is not None:
                refs.append(blk)
        budget = TierBudget(tier_of(backend), room.capacity_bytes,
                            max_pinned_bytes=int(room.capacity_bytes * self.pin_fraction))
        # Bytes set aside in the backend (prefetches, copies landing, demotions), and what it counts
        # but the ledger does not yet (a commit in progress), are not free.
        reserved = max(0, room.capacity_bytes - room.used_bytes - room.free_bytes)
        untracked = room.used_bytes - sum(r.nbytes for r in residents)
        return TierState(budget, tuple(residents), reserved_bytes=reserved + max(0, untracked))

    # -- blocks and copies ------------------------------------------------------------------------

    def use(self, blk: LedgerBlock, now: float, uses: float = 1.0) -> None:
        blk.score = self.reuse.used(blk.score, blk.since, now, uses)
        blk.since = now
        blk.last_used = now

    def touch(self, keys: Iterable[PayloadKey], now: float) -> int:
        n = 0
        for k in keys:
            blk = self.blocks.get(k)
            if blk is not None:
                self.use(blk, now)
                n += 1
        return n

    def note_size(self, backend: Any, nbytes: int) -> None:
        prev = self.price_bytes.get(id(backend))
        self.price_bytes[id(backend)] = nbytes if prev is None else 0.9 * prev + 0.1 * nbytes

    def found(self, backend: Any, key: PayloadKey, nbytes: int, now: float) -> None:
        """A payload a previous process left in ``backend``: no identity, garbage at the first tick."""
        blk = self.blocks.get(key)
        if blk is None:
            blk = self.blocks[key] = LedgerBlock(key, "", nbytes, 0.0, now, now, 0, lease_until=now)
        blk.copies[id(backend)] = Copy(backend, nbytes)

    def announce(self, blk: LedgerBlock, identity: BlockIdentity, events: list[TierChange], *,
                 tier: Tier | None = None) -> None:
        """Give ``blk`` its identity: a stored event with tokens in one tier, tier events for the rest."""
        blk.identity = identity
        blk.lease_until = None
        if identity.parent is not None:
            blk.parent = PayloadKey(blk.key.descriptor_id, identity.parent, blk.key.group)
            parent = self.blocks.get(blk.parent)
            if parent is not None:
                parent.children.add(blk.key)
        tiers = [tier_of(c.backend) for c in blk.copies.values()]
        first = tier if tier is not None else (tiers[0] if tiers else None)
        if first is None:
            return
        events.append(TierChange("stored", first, blk.key, identity))
        for t in tiers:
            if t is not first:
                events.append(TierChange("moved", t, blk.key, identity))

    def saved(self, backend: Any, block: tuple[PayloadKey, BlockIdentity | None, int, int], *, tenant: str,
              gains: Mapping[Tier, float], now: float, events: list[TierChange]) -> None:
        """A save wrote ``(key, identity, position, nbytes)`` into ``backend``: hold and announce it."""
        key, identity, position, nbytes = block
        blk = self.blocks.get(key)
        if blk is None:  # new: this save is its first use
            blk = self.blocks[key] = LedgerBlock(key, tenant, nbytes, 1.0, now, now, position, gains=gains)
        blk.copies[id(backend)] = Copy(backend, nbytes)
        if identity is not None:
            if blk.identity is None:
                self.announce(blk, identity, events, tier=tier_of(backend))
            else:
                events.append(TierChange("moved", tier_of(backend), key, blk.identity))
        else:
            blk.lease_until = now + self.lease_s
        self.counters["saved"] += 1
        self.note_size(backend, nbytes)

    def moved(self, blk: LedgerBlock, src: Any, dst: Any, events: list[TierChange]) -> None:
        """A demotion copied ``blk`` from ``src`` into ``dst`` (``src``'s copy is dropped next)."""
        copy = blk.copies[id(src)]
        blk.copies[id(dst)] = Copy(dst, copy.nbytes, landing=copy.landing)
        if blk.identity is not None:
            events.append(TierChange("moved", tier_of(dst), blk.key, blk.identity))
        self.counters["demoted"] += 1

    def land(self, transfer_id: str, tenant: str, backend: Any, keys: Sequence[PayloadKey], nbytes: Sequence[int],
             *, lease_until: float, now: float, events: list[TierChange]) -> None:
        """A copy committed ``keys`` into ``backend``: hold them; announce those whose identity is known."""
        tier = tier_of(backend)
        record = self.landed.setdefault(transfer_id, [])
        run = self.run_gains([(k, i, n) for i, (k, n) in enumerate(zip(keys, nbytes))])
        for key, n in zip(keys, nbytes):
            blk = self.blocks.get(key)
            if blk is None:  # new here: the copy is its first use (a held source counted its read)
                blk = self.blocks[key] = LedgerBlock(key, tenant, n, 1.0, now, now, 0, lease_until=lease_until,
                                                     gains=run)
            if id(backend) not in blk.copies:
                blk.copies[id(backend)] = Copy(backend, n, landing=transfer_id)
                if blk.identity is not None:
                    events.append(TierChange("moved", tier, key, blk.identity))
                self.note_size(backend, n)
            elif blk.identity is None:
                blk.lease_until = max(blk.lease_until or now, lease_until)
            record.append((key, id(backend)))
            self.counters["landed"] += 1
        while len(self.landed) > 4096:
            self.landed.pop(next(iter(self.landed)))

    def remove_copy(self, blk: LedgerBlock, backend: Any, events: list[TierChange], *, why: str, now: float,
                    demoted: bool = False) -> Copy | None:
        """``blk`` leaves ``backend`` (the caller deletes the payload); the copy, or None when not held there."""
        copy = blk.copies.pop(id(backend), None)
        if copy is None:
            return None
        if blk.identity is not None:
            events.append(TierChange("removed", tier_of(backend), blk.key, blk.identity))
        if not demoted:
            self.counters["dropped"] += 1
            if not blk.copies:
                self.counters["blocks_dropped"] += 1
                self.drops.append((now, blk.key, tier_of(backend), why))
        if not blk.copies:
            self.forget(blk)
        return copy

    def forget(self, blk: LedgerBlock) -> None:
        self.blocks.pop(blk.key, None)
        if blk.parent is not None:
            parent = self.blocks.get(blk.parent)
            if parent is not None:
                parent.children.discard(blk.key)

    def adopt(self, entries: Sequence[tuple[PayloadKey, BlockIdentity, int]], *, tenant: str, now: float) -> int:
        """Found payloads whose identities their publisher re-announced itself: kept as announced."""
        n = 0
        for key, identity, position in entries:
            blk = self.blocks.get(key)
            if blk is None:
                continue
            blk.identity, blk.lease_until, blk.tenant, blk.position = identity, None, tenant, position
            blk.score, blk.since = max(blk.score, 1.0), now
            blk.parent = None if identity.parent is None else PayloadKey(key.descriptor_id, identity.parent, key.group)
            n += 1
        for blk in self.blocks.values():
            if blk.identity is not None and blk.parent is not None and blk.parent in self.blocks:
                self.blocks[blk.parent].children.add(blk.key)
        return n

    # -- readers ----------------------------------------------------------------------------------

    def take_readers(self, backend: Any, keys: Sequence[PayloadKey], now: float) -> list[Copy]:
        """Mark ``keys``' copies in ``backend`` as being read (never evicted meanwhile); each is a use."""
        taken: list[Copy] = []
        for k in keys:
            blk = self.blocks.get(k)
            c = blk.copies.get(id(backend)) if blk is not None else None
            if c is not None:
                c.readers += 1
                taken.append(c)
                self.use(blk, now)  # type: ignore[arg-type]
        return taken

    @staticmethod
    def give_readers(taken: Sequence[Copy]) -> None:
        for c in taken:
            c.readers -= 1

    # -- pins -------------------------------------------------------------------------------------

    def pin(self, owner: str, keys: Sequence[PayloadKey], *, until: float, tenant: str, tier: Tier | None,
            now: float, rooms: Mapping[int, Room]) -> PinOutcome:
        """Pin the held ``keys`` (in ``tier``, or wherever held) until ``until``, all or none, within
        each tier's pinned quota (``rooms``: what each backend counts, by ``id``) and the tenant's."""
        held = [self.blocks[k] for k in keys if k in self.blocks
                and (tier is None or any(tier_of(c.backend) is tier for c in self.blocks[k].copies.values()))]
        targets = [blk for blk in held if blk.tenant == tenant]  # a pin acts in its own tenant's scope
        if len(targets) < len(held):
            self.counters["hint_blocks_refused"] += len(held) - len(targets)
            if not targets:
                return PinOutcome(False, 0, f"tenant: {len(held)} blocks held here are another tenant's "
                                            f"than {tenant}'s; none pinned")
        if not targets or until <= now:
            return PinOutcome(True, 0, "nothing held here to pin")
        add: dict[int, int] = {}
        for blk in targets:
            pu = blk.pinned_until()
            if pu is not None and now < pu:
                continue
            for bid, c in blk.copies.items():
                add[bid] = add.get(bid, 0) + c.nbytes
        for b in self.backends:
            extra = add.get(id(b), 0)
            if not extra:
                continue
            probe = Resident("pin", tenant, extra, 1.0, {}, last_used=now)
            d = pin_decision(probe, self.state(b, rooms[id(b)], now), until=until, now=now)
            if not d.ok:
                self.counters["pins_refused"] += 1
                return PinOutcome(False, 0, f"{d.reason} (pin {owner} of {len(targets)} blocks, {extra} bytes)")
        quota = self.tenant_pin_quota(tenant) if self.tenant_pin_quota is not None else None
        if quota is not None:
            mine = sum(c.nbytes for blk in self.blocks.values() if blk.tenant == tenant
                       and (blk.pinned_until() or 0) > now for c in blk.copies.values())
            if mine + sum(add.values()) > quota:
                self.counters["pins_refused"] += 1
                return PinOutcome(False, 0, f"tenant {tenant} would pin more than its {quota} bytes")
        for blk in targets:
            blk.pins[owner] = max(until, blk.pins.get(owner, until))
            self.use(blk, now)
        self.counters["pins"] += 1
        other = len(held) - len(targets)
        return PinOutcome(True, len(targets), f"{len(targets)} blocks pinned until {until:.3f}"
                          + (f"; tenant: {other} of another tenant not pinned" if other else ""))

    def unpin(self, owner: str, *, tenant: str | None = None) -> int:
        n = 0
        for blk in self.blocks.values():
            if owner in blk.pins and (tenant is None or blk.tenant == tenant):
                del blk.pins[owner]
                n += 1
        return n

    # -- what a hint may act on -------------------------------------------------------------------

    @staticmethod
    def hint_target(blk: LedgerBlock, tenant: str | None, now: float, refused: dict[str, int]) -> bool:
        """Whether a demote or evict hint may act on ``blk`` at all; counts why not."""
        why = None
        if tenant is not None and blk.tenant != tenant:
            why = "tenant"
        elif (blk.pinned_until() or 0.0) > now:
            why = "pinned"
        if why is not None:
            refused[why] = refused.get(why, 0) + 1
        return why is None

    @staticmethod
    def copy_target(blk: LedgerBlock, c: Copy, refused: dict[str, int]) -> bool:
        why = "busy" if c.readers or c.leaving else "anchored" if blk.children and len(blk.copies) == 1 else None
        if why is not None:
            refused[why] = refused.get(why, 0) + 1
        return why is None

    def effect(self, acted: int, refused: dict[str, int]) -> HintEffect:
        self.counters["hint_blocks_refused"] += sum(refused.values())
        return HintEffect(acted, dict(refused))

    # -- reservations -----------------------------------------------------------------------------

    def prefetch_held(self, backend: Any) -> int:
        """Bytes prefetch hints hold in ``backend`` now (room of copies landing not counted)."""
        return sum(h.reservation.remaining for h in self.held.values() if h.backend is backend and not h.landing)

    def hold(self, transfer_id: str, held: Held) -> None:
        self.held[transfer_id] = held

    def take(self, transfer_id: str) -> Held | None:
        """The room held for ``transfer_id``, out of the ledger (the caller releases or reuses it)."""
        return self.held.pop(transfer_id, None)

    def cancel(self, transfer_id: str, tenant: str | None) -> Held | None:
        """A prefetch's room, taken out for a cancel: not a running copy's, not another tenant's."""
        h = self.held.get(transfer_id)
        if h is None or h.landing or (tenant is not None and h.tenant != tenant):
            return None
        return self.held.pop(transfer_id)

    def take_all(self) -> list[Held]:
        out = list(self.held.values())
        self.held.clear()
        return out

    # -- time -------------------------------------------------------------------------------------

    def expire(self, now: float) -> tuple[list[Held], list[tuple[LedgerBlock, Any]]]:
        """What ``now`` ends: the reservations past their time (out of the ledger, to release) and
        the copies that are garbage (no identity, lease over, unpinned, idle: to drop); pins past
        their time end here."""
        expired = []
        for tid, h in list(self.held.items()):
            if not h.landing and now >= h.expires_at:
                del self.held[tid]
                expired.append(h)
                self.counters["reservations_expired"] += 1
        garbage = []
        for blk in self.blocks.values():
            for owner, until in list(blk.pins.items()):
                if now >= until:
                    del blk.pins[owner]
            if blk.identity is None and (blk.lease_until is None or now >= blk.lease_until) and not blk.pins:
                garbage.extend((blk, c.backend) for c in blk.copies.values() if not c.readers and not c.leaving)
        return expired, garbage
