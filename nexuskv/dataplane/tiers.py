"""A worker's tiers under one capacity authority: the in-process tier manager.

:class:`TierManager` owns the capacity of the tiers of one worker that it is given (a
:class:`~nexuskv.dataplane.catalog.BackendCatalog`; shared tiers such as the remote store are
passed through unmanaged: their capacity is the store's). Everything that writes those tiers
goes through it — an engine adapter's saves (:meth:`TierManager.save`), the transfer executor's
copies (:meth:`TierManager.admit_copy` before the first byte, :meth:`TierManager.landed` after),
the planner's hints (:meth:`TierManager.pin`, :meth:`~TierManager.unpin`,
:meth:`~TierManager.reserve`, :meth:`~TierManager.demote`, :meth:`~TierManager.evict`) — and it
decides with :mod:`nexuskv.admission`:

* **Admission.** A block enters a full tier only when the eviction policy lets it displace what it
  must (by utility: it is worth more per byte than each victim; a block worth nothing there is
  refused). A refusal is an answer with its reason (:class:`SaveOutcome`), counted and logged by
  the caller — a full tier never makes a save fail silently.
* **Eviction.** Victims leave cheapest first, *demoted* to the next tier of this worker
  (GPU → host → disk) when still worth keeping there and it has room, *dropped* otherwise. Never
  a pinned block, never one a transfer or reader is using (:meth:`TierManager.reading`), never
  a prefix parent other held blocks chain from (it may be demoted, not dropped). Evictions free a
  little more than needed (``slack``), so a run of saves does not rescore the tier each time.
* **Reservations.** A prefetch's room is set aside when its hint arrives (or its command, if that
  comes first) and held until the copy lands in it or the hint's ``expires_at`` passes — at most
  ``prefetch_max_s`` from now whatever the hint says, and only while the room prefetch hints
  hold in that tier stays within ``prefetch_fraction`` of its capacity (a hint beyond it is
  refused with the numbers), so no hint can hold a tier for itself or for long. (The room an
  executor holds for a queued command of its own is bounded in time, not share: the copy needs
  it when it runs.)
* **Hints stay in their tenant's scope.** A pin, unpin, demote or evict acts only on blocks of
  the tenant the hint names, and a release (a cancel) only on that tenant's room; an evict or
  demote never touches a pinned block, one being read or copied, or a prefix parent others
  chain from. What a hint could not do is reported per reason (:class:`HintEffect`).
* **Pins.** Within a quota per tier (``pin_fraction`` of its capacity) and per tenant; a pin
  over quota is refused with the numbers, and pinned bytes are reported apart from bytes in
  flight.
* **Facts.** Every change is an event of the manager's publisher (:mod:`.tier_facts`), so the
  index holds what the tiers hold: a saved block is announced with its :class:`BlockIdentity`;
  a copy that landed from a source outside this manager has no identity (transfer commands carry
  keys, not tokens), so it is held but not announced, kept for its request (until the hint's
  deadline plus ``lease_s``) and then dropped as garbage by :meth:`TierManager.tick` — nothing can
  find it through the index.
* **Price.** :meth:`TierManager.usage` reports each tier's displacement price
  (:func:`nexuskv.admission.displacement_price`) for a typical copy, which the planner charges a
  prefetch as ``C_pollution`` instead of a flat constant.

``P(reuse)`` of a block is its use history (:class:`~nexuskv.admission.ReuseModel`): a save, a
read, a transfer reading it as a source and a pin each count as a use; a prefix parent is at least
as likely to be reused as its likeliest child. Its ``EG`` per tier comes from ``gains`` (the
service derives it from the cost model), valued when the block is admitted at the mean of the
prompt it came with; without ``gains`` every tier is worth 1 s per block and utilities rank by
reuse and bytes alone.

**For engine adapters** (the vLLM connector's worker side, the SGLang storage backend): the
adapter builds one manager over the tiers it writes, in its own process, with its publisher name,
and calls :meth:`TierManager.save` with each block's :class:`SaveBlock` (payload key, bytes, and
the :class:`~nexuskv.dataplane.tier_facts.BlockIdentity` the index keys it by: the adapter's
publisher identity, the block's tokens, its parent's canonical key), then reports what it answered
(a :class:`SaveOutcome`: saved, already held, refused with reasons, failed). It reads through
:meth:`TierManager.read` (or counts a hit with :meth:`TierManager.touch`), deletes with
:meth:`TierManager.evict`, and runs a :class:`streams.tier_manager.TierBus` on its bus loop for
the hints addressed to it and its tier state; the manager's :class:`TierFacts` publishes its
tier events (the adapter no longer emits them itself).

Payloads found in a tier at start have no identity (it is not kept across processes): they are
dropped by the first :meth:`TierManager.tick`.

Thread-safe: one lock over the ledger; drops and demotions run under it, a save's own writes
outside it (into bytes reserved for them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from nexuskv.admission import (
    ByUtility,
    EvictionKind,
    EvictionPolicy,
    Resident,
    ReuseModel,
    TierBudget,
    TierState,
    admit,
    displacement_price,
    evict_for,
)
from nexuskv.admission import (
    pin as pin_decision,
)
from nexuskv.dataplane.backend import Reservation, TierBackend, host_view
from nexuskv.dataplane.catalog import TIER_ORDER, BackendCatalog
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.tier_facts import BlockIdentity, FactSink, TierChange, TierFacts
from nexuskv.descriptor import Tier
from nexuskv.errors import DataPlaneError, TierUnavailableError

__all__ = ["SaveBlock", "SaveOutcome", "TierUsage", "PinOutcome", "HintEffect", "GainFn", "TierManager"]

log = logging.getLogger("nexuskv.tiers")

#: ``gains(key, position, nbytes)`` -> EG in seconds of reusing the block from each tier.
GainFn = Callable[[PayloadKey, int, int], Mapping[Tier, float]]
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class SaveBlock:
    """One block to save: its address, its bytes (host uint8), and what the index needs to key it."""

    key: PayloadKey
    data: torch.Tensor
    identity: BlockIdentity | None = None
    position: int | None = None  # block index in its chain; None: its parent's + 1, or 0


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    tier: Tier
    requested: int
    saved: int = 0
    already: int = 0
    refused: int = 0
    failed: int = 0
    nbytes: int = 0
    held: tuple[PayloadKey, ...] = ()  # saved or already there, in order
    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.refused == 0 and self.failed == 0


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


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One managed tier's state; bytes unless named otherwise."""

    worker: str
    tier: Tier
    backend: str
    capacity_bytes: int
    used_bytes: int  # payload bytes stored (the backend's count)
    reserved_bytes: int  # set aside for prefetches and copies landing
    pinned_bytes: int  # stored bytes under a pin
    in_flight_bytes: int  # bytes of copies landing now (part of reserved)
    blocks: int
    unannounced_blocks: int
    price_s_per_gib: float
    price_bytes: int  # the copy size the price is for
    counters: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Copy:
    backend: TierBackend
    nbytes: int
    readers: int = 0
    leaving: bool = False
    landing: str | None = None  # transfer id it landed by (demote/evict hints name it)


@dataclass(slots=True)
class _Block:
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
    copies: dict[int, _Copy] = field(default_factory=dict)  # id(backend) -> copy

    def pinned_until(self) -> float | None:
        return max(self.pins.values()) if self.pins else None


@dataclass(slots=True)
class _Held:
    """Room set aside in one backend, for a prefetch hint or a copy in progress."""

    backend: TierBackend
    reservation: Reservation
    expires_at: float
    tenant: str
    landing: bool = False  # a copy is writing into it now


class TierManager:
    """The capacity authority of one worker's tiers (see the module docstring)."""

    def __init__(self, catalog: BackendCatalog, *, publisher: str | None = None,
                 facts: FactSink | None = None, policy: EvictionPolicy | None = None,
                 reuse: ReuseModel | None = None, gains: GainFn | None = None,
                 clock: Callable[[], float] = time.time, pin_fraction: float = 0.5,
                 tenant_pin_quota: Callable[[str], int | None] | None = None, lease_s: float = 5.0,
                 slack: float = 1 / 32, drop_log: int = 4096, prefetch_fraction: float = 0.25,
                 prefetch_max_s: float = 60.0) -> None:
        if not 0.0 <= pin_fraction <= 1.0:
            raise ValueError(f"pin_fraction: {pin_fraction} is not in [0, 1]")
        if not 0.0 < prefetch_fraction <= 1.0:
            raise ValueError(f"prefetch_fraction: {prefetch_fraction} is not in (0, 1]")
        if prefetch_max_s <= 0:
            raise ValueError(f"prefetch_max_s: {prefetch_max_s} is not positive")
        self.prefetch_fraction = prefetch_fraction
        self.prefetch_max_s = prefetch_max_s
        self.catalog = catalog
        self.worker = catalog.worker
        self.facts = facts if facts is not None else TierFacts(publisher or catalog.worker, None, clock=clock)
        self.policy = policy or ByUtility()
        self.reuse = reuse or ReuseModel()
        self.gains = gains
        self.clock = clock
        self.pin_fraction = pin_fraction
        self.tenant_pin_quota = tenant_pin_quota
        self.lease_s = lease_s
        self.slack = slack
        self._lock = threading.RLock()
        self._blocks: dict[PayloadKey, _Block] = {}
        self._held: dict[str, _Held] = {}  # transfer id -> room set aside for it
        self._landed: dict[str, list[tuple[PayloadKey, int]]] = {}  # transfer id -> blocks it landed, where
        self._price_bytes: dict[int, float] = {}
        #: The last drops, newest last: (time, key, tier, why) — what left the worker's tiers and why.
        self.drops: deque[tuple[float, PayloadKey, Tier, str]] = deque(maxlen=drop_log)
        self.counters: dict[str, int] = dict.fromkeys(
            ("saved", "save_refused", "save_failed", "copies_admitted", "copies_refused", "landed", "demoted",
             "dropped", "blocks_dropped", "garbage", "pins", "pins_refused", "reservations", "reservations_refused",
             "reservations_expired", "reservations_shortened", "hint_blocks_refused"), 0)
        managed = [b for b in catalog.backends if not b.capabilities.shared]
        self._managed = sorted(managed, key=lambda b: TIER_ORDER.index(b.capabilities.tier))
        self._ids = {id(b) for b in self._managed}
        now = clock()
        for backend in self._managed:  # what a previous process left: no identity, dropped at the first tick
            for key in backend.keys():
                header = backend.header(key)
                if header is None:
                    continue
                blk = self._blocks.get(key)
                if blk is None:
                    blk = self._blocks[key] = _Block(key, "", header.nbytes, 0.0, now, now, 0, lease_until=now)
                blk.copies[id(backend)] = _Copy(backend, header.nbytes)

    # -- queries ----------------------------------------------------------------------------------

    def managed(self, backend: TierBackend) -> bool:
        return id(backend) in self._ids

    def backends(self) -> tuple[TierBackend, ...]:
        return tuple(self._managed)

    def holds(self, key: PayloadKey, tier: Tier) -> bool:
        with self._lock:
            blk = self._blocks.get(key)
            return blk is not None and any(c.backend.capabilities.tier is tier and not c.leaving
                                           for c in blk.copies.values())

    def keys(self, tier: Tier) -> list[PayloadKey]:
        """Every block the manager holds in ``tier``, announced or not."""
        with self._lock:
            return [k for k, blk in self._blocks.items()
                    if any(c.backend.capabilities.tier is tier for c in blk.copies.values())]

    def contents(self) -> dict[tuple[Tier, int], set[PayloadKey]]:
        """What the manager believes each tier holds and has announced: ``{(tier, group): keys}``."""
        out: dict[tuple[Tier, int], set[PayloadKey]] = {}
        with self._lock:
            for blk in self._blocks.values():
                if blk.identity is None:
                    continue
                for c in blk.copies.values():
                    out.setdefault((c.backend.capabilities.tier, blk.key.group), set()).add(blk.key)
        return out

    def audit(self) -> dict[str, tuple[int, int]]:
        """Per managed backend: (keys the ledger has but the backend lacks, keys the backend has but
        the ledger lacks). Both 0 when the ledger is true."""
        out = {}
        with self._lock:
            for b in self._managed:
                real = set(b.keys())
                mine = {k for k, blk in self._blocks.items() if id(b) in blk.copies}
                out[b.label] = (len(mine - real), len(real - mine))
        return out

    def usage(self) -> tuple[TierUsage, ...]:
        now = self.clock()
        out = []
        with self._lock:
            for b in self._managed:
                state = self._state(b, now)
                blocks = unannounced = pinned = 0
                for blk in self._blocks.values():
                    c = blk.copies.get(id(b))
                    if c is None:
                        continue
                    blocks += 1
                    unannounced += blk.identity is None
                    pu = blk.pinned_until()
                    if pu is not None and now < pu:
                        pinned += c.nbytes
                reserved = sum(h.reservation.remaining for h in self._held.values() if h.backend is b)
                landing = sum(h.reservation.remaining for h in self._held.values() if h.backend is b and h.landing)
                size = int(self._price_bytes.get(id(b)) or max(1, b.capacity_bytes // 64))
                out.append(TierUsage(
                    worker=self.worker, tier=b.capabilities.tier, backend=b.label, capacity_bytes=b.capacity_bytes,
                    used_bytes=b.used_bytes(), reserved_bytes=reserved, pinned_bytes=pinned, in_flight_bytes=landing,
                    blocks=blocks, unannounced_blocks=unannounced,
                    price_s_per_gib=displacement_price(state, size, now=now), price_bytes=size,
                    counters=dict(self.counters)))
        return tuple(out)

    def price(self, tier: Tier, nbytes: int) -> float:
        """Seconds of expected gain lost per GiB if ``nbytes`` landed in ``tier`` now."""
        now = self.clock()
        with self._lock:
            b = self._backend_of(tier)
            return 0.0 if b is None else displacement_price(self._state(b, now), nbytes, now=now)

    # -- scoring ----------------------------------------------------------------------------------

    def _gains(self, blk: _Block) -> Mapping[Tier, float]:
        """The block's EG per tier, as valued when it was admitted (with the prompt it came with)."""
        if blk.gains is None:
            blk.gains = self._block_gains(blk.key, blk.position, blk.nbytes)
        return blk.gains

    def _block_gains(self, key: PayloadKey, position: int, nbytes: int) -> Mapping[Tier, float]:
        if self.gains is None:
            return {b.capabilities.tier: 1.0 for b in self._managed}
        return self.gains(key, position, nbytes)

    def _run_gains(self, run: Sequence[tuple[PayloadKey, int, int]]) -> dict[Tier, float]:
        """The mean EG per block of a run of blocks ``(key, position, nbytes)`` saved or copied together.

        Every block of a prompt is valued alike, at the prompt's mean: a block's own EG grows with
        its depth (attention over a longer context), but a deep block is worth nothing without the
        shallow ones before it, so valuing blocks by depth would refuse a new prompt's first
        blocks — and with them the whole prompt — wherever deep blocks of older prompts sit.
        """
        total: dict[Tier, float] = {}
        for key, position, nbytes in run:
            for tier, g in self._block_gains(key, position, nbytes).items():
                total[tier] = total.get(tier, 0.0) + g
        n = max(1, len(run))
        return {tier: g / n for tier, g in total.items()}

    def _p_reuse(self, now: float) -> dict[PayloadKey, float]:
        """``P(reuse)`` of every held block; a prefix parent's is at least its likeliest child's (any
        reuse of a block reuses its prefix)."""
        out: dict[PayloadKey, float] = {}
        for blk in sorted(self._blocks.values(), key=lambda b: -b.position):
            if blk.identity is None:
                lease = blk.lease_until if blk.lease_until is not None else now
                p = 1.0 if now < lease else 0.0
            else:
                p = self.reuse.p_reuse(blk.score, blk.since, now)
            for child in blk.children:
                p = max(p, out.get(child, 0.0))
            out[blk.key] = min(1.0, max(0.0, p))
        return out

    def _resident(self, blk: _Block, copy: _Copy, now: float, entry_id: str, p: float) -> Resident:
        expires = (blk.lease_until if blk.lease_until is not None else now) if blk.identity is None else None
        return Resident(entry_id, blk.tenant, copy.nbytes, p, self._gains(blk),
                        pinned_until=blk.pinned_until(), expires_at=expires, last_used=blk.last_used,
                        busy=copy.readers > 0 or copy.leaving, anchored=bool(blk.children) and len(blk.copies) == 1)

    def _state(self, backend: TierBackend, now: float, refs: list | None = None,
               p_reuse: dict[PayloadKey, float] | None = None) -> TierState:
        p_reuse = p_reuse if p_reuse is not None else self._p_reuse(now)
        residents = []
        for blk in self._blocks.values():
            c = blk.copies.get(id(backend))
            if c is None:
                continue
            residents.append(self._resident(blk, c, now, str(len(residents)), p_reuse.get(blk.key, 0.0)))
            if refs is not None:
                refs.append(blk)
        budget = TierBudget(backend.capabilities.tier, backend.capacity_bytes,
                            max_pinned_bytes=int(backend.capacity_bytes * self.pin_fraction))
        # Bytes set aside in the backend (prefetches, copies landing, demotions), and what it counts
        # but the ledger does not yet (a commit in progress), are not free.
        used = backend.used_bytes()
        reserved = max(0, backend.capacity_bytes - used - backend.free_bytes())
        untracked = used - sum(r.nbytes for r in residents)
        return TierState(budget, tuple(residents), reserved_bytes=reserved + max(0, untracked))

    def _backend_of(self, tier: Tier) -> TierBackend | None:
        found = [b for b in self._managed if b.capabilities.tier is tier]
        if not found:
            return None
        return max(found, key=lambda b: b.free_bytes())

    def _lower(self, backend: TierBackend) -> TierBackend | None:
        order = TIER_ORDER.index(backend.capabilities.tier)
        below = [b for b in self._managed if TIER_ORDER.index(b.capabilities.tier) > order]
        if not below:
            return None
        first = below[0].capabilities.tier
        return max((b for b in below if b.capabilities.tier is first), key=lambda b: b.free_bytes())

    # -- making room ------------------------------------------------------------------------------

    def _make_room(self, backend: TierBackend, candidate: Resident | None, nbytes: int, now: float,
                   events: list[TierChange]) -> str | None:
        """Evict (demote or drop) so ``nbytes`` fit in ``backend``; None when done, else why not.

        ``candidate`` None: anything unpinned and idle may go (a planner-priced reservation).
        """
        if nbytes <= backend.free_bytes():
            return None
        refs: list[_Block] = []
        p_reuse = self._p_reuse(now)
        state = self._state(backend, now, refs, p_reuse)
        if nbytes <= state.free_bytes:
            return None
        lower_b = self._lower(backend)
        lower = None
        if lower_b is not None:
            # What the tier below could take: all but its pinned, busy and anchored state (a demotion
            # is an admission there, which may displace its cheaper residents in turn).
            below = self._state(lower_b, now, None, p_reuse)
            lower = TierState(below.budget, tuple(r for r in below.residents if not r.movable(now) or r.anchored),
                              reserved_bytes=below.reserved_bytes)
        if candidate is not None:
            decision = admit(candidate, state, now=now, lower=lower, policy=self.policy)
            if not decision.admit:
                return decision.reason
            extra = evict_for(state, nbytes - state.free_bytes + int(backend.capacity_bytes * self.slack), now=now,
                              lower=lower, policy=self.policy, candidate=candidate)
            evictions = extra if extra is not None else decision.evictions
        else:
            evictions = evict_for(state, nbytes - state.free_bytes + int(backend.capacity_bytes * self.slack),
                                  now=now, lower=lower, policy=self.policy)
            if evictions is None:
                evictions = evict_for(state, nbytes - state.free_bytes, now=now, lower=lower, policy=self.policy)
            if evictions is None:
                return (f"{backend.label}: {state.free_bytes} of {backend.capacity_bytes} bytes free and the rest "
                        f"pinned, busy or anchored; {nbytes} needed")
        for ev in evictions:
            blk = refs[int(ev.entry_id)]
            if ev.kind is EvictionKind.DEMOTE and lower_b is not None and self._demote_copy(blk, backend, lower_b,
                                                                                             events, now, p_reuse):
                continue
            if blk.children and len(blk.copies) == 1:
                continue  # a prefix parent that could not move down stays
            self._drop_copy(blk, backend, events, why=ev.reason)
        if backend.free_bytes() < nbytes:
            return f"{backend.label}: evictions did not free {nbytes} bytes ({backend.free_bytes()} free)"
        return None

    def _demote_copy(self, blk: _Block, src: TierBackend, dst: TierBackend,
                     events: list[TierChange], now: float,
                     p_reuse: dict[PayloadKey, float] | None = None) -> bool:
        """Copy ``blk`` from ``src`` to ``dst``, then delete it from ``src``; False when it could not.

        Entering ``dst`` is an admission there: the block may displace what is worth less per byte
        in ``dst`` (demoting that further down in turn).
        """
        copy = blk.copies.get(id(src))
        if copy is None:
            return False
        if id(dst) in blk.copies:  # already below: only the upper copy leaves
            self._drop_copy(blk, src, events, why="demoted (already held below)")
            return True
        copy.leaving = True
        p = (p_reuse or {}).get(blk.key)
        if p is None:
            p = self._p_reuse(now).get(blk.key, 0.0)
        candidate = Resident("demoted", blk.tenant, copy.nbytes, p, self._gains(blk), last_used=blk.last_used,
                             expires_at=blk.lease_until if blk.identity is None else None)
        why = self._make_room(dst, candidate, copy.nbytes, now, events)
        copy.leaving = False
        if why is not None:
            return False
        reservation = dst.reserve(copy.nbytes)
        if reservation is None:
            return False
        copy.leaving = True
        try:
            with reservation, src.borrow(blk.key) as lent:
                if lent is not None:
                    header, data = lent
                    dst.commit_view(header, data, reservation)
                else:
                    got = src.get(blk.key)
                    if got is None:
                        raise TierUnavailableError(f"{blk.key} vanished from {src.label}")
                    dst.put(got[0], got[1], reservation)
        except (DataPlaneError, ValueError) as exc:
            copy.leaving = False
            log.warning("demoting %s from %s to %s failed: %s", blk.key, src.label, dst.label, exc)
            return False
        blk.copies[id(dst)] = _Copy(dst, copy.nbytes, landing=copy.landing)
        if blk.identity is not None:
            events.append(TierChange("moved", dst.capabilities.tier, blk.key, blk.identity))
        self.counters["demoted"] += 1
        self._drop_copy(blk, src, events, why="demoted", demoted=True)
        return True

    def _drop_copy(self, blk: _Block, backend: TierBackend, events: list[TierChange], *,
                   why: str, demoted: bool = False) -> None:
        copy = blk.copies.pop(id(backend), None)
        if copy is None:
            return
        try:
            backend.delete(blk.key)
        except TierUnavailableError as exc:
            log.warning("deleting %s from %s failed: %s", blk.key, backend.label, exc)
        if blk.identity is not None:
            events.append(TierChange("removed", backend.capabilities.tier, blk.key, blk.identity))
        if not demoted:
            self.counters["dropped"] += 1
            if not blk.copies:
                self.counters["blocks_dropped"] += 1
                self.drops.append((self.clock(), blk.key, backend.capabilities.tier, why))
        if not blk.copies:
            self._forget(blk)

    def _forget(self, blk: _Block) -> None:
        self._blocks.pop(blk.key, None)
        if blk.parent is not None:
            parent = self._blocks.get(blk.parent)
            if parent is not None:
                parent.children.discard(blk.key)

    # -- saves ------------------------------------------------------------------------------------

    def save(self, blocks: Sequence[SaveBlock], tier: Tier, *, tenant: str) -> SaveOutcome:
        """Store ``blocks`` in this worker's ``tier`` where admission lets them in; announce them.

        Blocks are taken in order; a block whose prefix parent is neither held here nor saved in
        this call is refused (the index could not key it, and no prefix match would reach it).
        """
        now = self.clock()
        held: list[PayloadKey] = []
        reasons: list[str] = []
        saved = already = refused = failed = nbytes = 0
        events: list[TierChange] = []
        todo: list[tuple[SaveBlock, PayloadHeader, Reservation, int]] = []
        with self._lock:
            dst = self._backend_of(tier)
            if dst is None:
                return SaveOutcome(tier, len(blocks), refused=len(blocks),
                                   reasons=(f"worker {self.worker} has no managed {tier.value} tier",))
            coming: dict[PayloadKey, int] = {}  # admitted in this call -> position
            run = self._run_gains([(sb.key, sb.position or 0, int(sb.data.numel() * sb.data.element_size()))
                                   for sb in blocks])
            # A save is a use of every block in it that is held already, counted before anything is
            # scored: a chain being saved must not make room by evicting its own other blocks.
            for sb in blocks:
                blk = self._blocks.get(sb.key)
                if blk is not None:
                    self._use(blk, now)
            for sb in blocks:
                key = sb.key
                blk = self._blocks.get(key)
                if blk is not None and id(dst) in blk.copies:
                    if sb.identity is not None and blk.identity is None:
                        self._announce(blk, sb.identity, events)
                    already += 1
                    held.append(key)
                    continue
                parent_key = None
                position = sb.position
                if sb.identity is not None and sb.identity.parent is not None:
                    parent_key = PayloadKey(key.descriptor_id, sb.identity.parent, key.group)
                    parent = self._blocks.get(parent_key)
                    if parent_key not in coming and (parent is None or parent.identity is None):
                        refused += 1
                        self.counters["save_refused"] += 1
                        reasons.append(f"block {key}: its prefix parent is not held by {self.worker}")
                        continue
                    if position is None:
                        position = coming[parent_key] + 1 if parent_key in coming else parent.position + 1  # type: ignore[union-attr]
                size = int(sb.data.numel() * sb.data.element_size())
                header = PayloadHeader.for_data(key, host_view(sb.data))
                probe = blk or _Block(key, tenant, size, 1.0, now, now, position or 0)
                candidate = Resident("candidate", tenant, size, min(1.0, self.reuse.p_reuse(probe.score, probe.since,
                                                                                           now)),
                                     run, last_used=now)
                why = self._make_room(dst, candidate, size, now, events)
                reservation = dst.reserve(size) if why is None else None
                if reservation is None:
                    refused += 1
                    self.counters["save_refused"] += 1
                    reasons.append(f"block {key} refused on {tier.value}: {why or 'no room'}")
                    continue
                todo.append((sb, header, reservation, position or 0))
                coming[key] = position or 0
        self._queue(events)
        events = []
        written: list[tuple[SaveBlock, PayloadHeader, int]] = []
        # A tier that writes or sends bytes (disk, remote) writes host data where it is, all of the
        # save's blocks in one call (no staging copy; the disk tier writes them with the GIL
        # released once, not after every syscall: the saving thread runs beside an engine's step).
        views: list[tuple[SaveBlock, PayloadHeader, Reservation, int, torch.Tensor]] = []
        for sb, header, reservation, position in todo:
            data = sb.data.reshape(-1).view(torch.uint8)
            if dst.writes_from_views and data.device.type == "cpu":
                views.append((sb, header, reservation, position, data))
                continue
            try:
                with reservation:
                    dst.put(header, data, reservation)
                written.append((sb, header, position))
            except (DataPlaneError, ValueError) as exc:
                failed += 1
                self.counters["save_failed"] += 1
                reasons.append(f"block {sb.key}: {type(exc).__name__}: {exc}")
        if views:
            try:
                results: list = dst.commit_views([(header, data, res) for _, header, res, _, data in views])
            except (DataPlaneError, ValueError) as exc:
                results = [exc] * len(views)
            finally:
                for _, _, reservation, _, _ in views:
                    reservation.release()
            for (sb, header, _, position, _), result in zip(views, results):
                if isinstance(result, Exception):
                    failed += 1
                    self.counters["save_failed"] += 1
                    reasons.append(f"block {sb.key}: {type(result).__name__}: {result}")
                else:
                    written.append((sb, header, position))
            order = {id(sb): i for i, (sb, _, _, _) in enumerate(todo)}
            written.sort(key=lambda w: order[id(w[0])])  # announced in the save's order: parents first
        with self._lock:
            for sb, header, position in written:
                blk = self._blocks.get(sb.key)
                if blk is None:  # new: this save is its first use
                    blk = self._blocks[sb.key] = _Block(sb.key, tenant, header.nbytes, 1.0, now, now, position,
                                                        gains=run)
                blk.copies[id(dst)] = _Copy(dst, header.nbytes)
                if sb.identity is not None:
                    if blk.identity is None:
                        self._announce(blk, sb.identity, events, tier=dst.capabilities.tier)
                    else:
                        events.append(TierChange("moved", dst.capabilities.tier, sb.key, blk.identity))
                else:
                    blk.lease_until = now + self.lease_s
                saved += 1
                nbytes += header.nbytes
                held.append(sb.key)
                self.counters["saved"] += 1
                self._note_size(dst, header.nbytes)
        self._queue(events)
        self.flush()
        return SaveOutcome(tier, len(blocks), saved, already, refused, failed, nbytes, tuple(held),
                           tuple(dict.fromkeys(reasons)))

    def _announce(self, blk: _Block, identity: BlockIdentity, events: list[TierChange], *,
                  tier: Tier | None = None) -> None:
        """Give ``blk`` its identity: a stored event with tokens in one tier, tier events for the rest."""
        blk.identity = identity
        blk.lease_until = None
        if identity.parent is not None:
            blk.parent = PayloadKey(blk.key.descriptor_id, identity.parent, blk.key.group)
            parent = self._blocks.get(blk.parent)
            if parent is not None:
                parent.children.add(blk.key)
        tiers = [c.backend.capabilities.tier for c in blk.copies.values()]
        first = tier if tier is not None else (tiers[0] if tiers else None)
        if first is None:
            return
        events.append(TierChange("stored", first, blk.key, identity))
        for t in tiers:
            if t is not first:
                events.append(TierChange("moved", t, blk.key, identity))

    def _use(self, blk: _Block, now: float, uses: float = 1.0) -> None:
        blk.score = self.reuse.used(blk.score, blk.since, now, uses)
        blk.since = now
        blk.last_used = now

    def _note_size(self, backend: TierBackend, nbytes: int) -> None:
        prev = self._price_bytes.get(id(backend))
        self._price_bytes[id(backend)] = nbytes if prev is None else 0.9 * prev + 0.1 * nbytes

    # -- reads ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self, backend: TierBackend, keys: Sequence[PayloadKey]) -> Iterator[None]:
        """While the block runs, ``keys`` in ``backend`` are not evicted (a transfer or reader uses
        them); each counts one use."""
        if not self.managed(backend):
            yield
            return
        now = self.clock()
        taken: list[_Copy] = []
        with self._lock:
            for k in keys:
                blk = self._blocks.get(k)
                c = blk.copies.get(id(backend)) if blk is not None else None
                if c is not None:
                    c.readers += 1
                    taken.append(c)
                    self._use(blk, now)
        try:
            yield
        finally:
            with self._lock:
                for c in taken:
                    c.readers -= 1

    def touch(self, keys: Sequence[PayloadKey]) -> int:
        """Count one use of each held key (a hit served from a tier); returns how many were held."""
        now = self.clock()
        n = 0
        with self._lock:
            for k in keys:
                blk = self._blocks.get(k)
                if blk is not None:
                    self._use(blk, now)
                    n += 1
        return n

    def read(self, tier: Tier, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        """Read a held block into ``out``, verified, as a use; None when this tier does not hold it."""
        with self._lock:
            blk = self._blocks.get(key)
            copy = next((c for c in blk.copies.values() if c.backend.capabilities.tier is tier and not c.leaving),
                        None) if blk is not None else None
        if copy is None:
            return None
        with self.reading(copy.backend, [key]):
            return copy.backend.read_verified(key, out)

    # -- transfers into managed tiers -------------------------------------------------------------

    def admit_copy(self, transfer_id: str, tenant: str, backend: TierBackend, blocks: Sequence[tuple[PayloadKey, int]],
                   *, expires_at: float) -> tuple[Reservation | None, str]:
        """Room for a copy of ``blocks`` ``(key, nbytes)`` into ``backend`` before its first byte moves.

        Uses the room a prefetch hint set aside for ``transfer_id`` (topped up if short); else
        admits the blocks as state a request is about to use (``P(reuse) = 1``). Returns the
        reservation to commit from, or None and the reason.
        """
        need = sum(n for _, n in blocks)
        now = self.clock()
        events: list[TierChange] = []
        with self._lock:
            held = self._held.pop(transfer_id, None)
            if held is not None and held.backend is not backend:
                held.reservation.release()
                held = None
            have = held.reservation.remaining if held is not None else 0
            if have >= need:
                reservation = held.reservation  # type: ignore[union-attr]
            else:
                if held is not None:
                    held.reservation.release()
                run = [(key, self._blocks[key].position if key in self._blocks else i, n)
                       for i, (key, n) in enumerate(blocks)]
                gains = {t: g * len(blocks) for t, g in self._run_gains(run).items()}  # the copy as one unit
                candidate = Resident("copy", tenant, max(1, need), 1.0, gains, last_used=now)
                why = self._make_room(backend, candidate, need, now, events)
                reservation = backend.reserve(need) if why is None else None
                if reservation is None:
                    self.counters["copies_refused"] += 1
                    self._queue(events)
                    self.flush()
                    return None, why or f"{backend.label}: {backend.free_bytes()} bytes free, {need} needed"
            self._held[transfer_id] = _Held(backend, reservation, expires_at, tenant, landing=True)
            self.counters["copies_admitted"] += 1
        self._queue(events)
        self.flush()
        return reservation, "admitted"

    def landed(self, transfer_id: str, tenant: str, backend: TierBackend, keys: Sequence[PayloadKey],
               nbytes: Sequence[int], *, lease_until: float) -> None:
        """A copy committed ``keys`` into ``backend``: hold them; announce those whose identity is known."""
        now = self.clock()
        events: list[TierChange] = []
        with self._lock:
            h = self._held.pop(transfer_id, None)
            if h is not None:
                h.reservation.release()
            if not self.managed(backend):
                return
            tier = backend.capabilities.tier
            record = self._landed.setdefault(transfer_id, [])
            run = self._run_gains([(k, i, n) for i, (k, n) in enumerate(zip(keys, nbytes))])
            for key, n in zip(keys, nbytes):
                blk = self._blocks.get(key)
                if blk is None:  # new here: the copy is its first use (a held source counted its read)
                    blk = self._blocks[key] = _Block(key, tenant, n, 1.0, now, now, 0, lease_until=lease_until,
                                                     gains=run)
                if id(backend) not in blk.copies:
                    blk.copies[id(backend)] = _Copy(backend, n, landing=transfer_id)
                    if blk.identity is not None:
                        events.append(TierChange("moved", tier, key, blk.identity))
                    self._note_size(backend, n)
                elif blk.identity is None:
                    blk.lease_until = max(blk.lease_until or now, lease_until)
                record.append((key, id(backend)))
                self.counters["landed"] += 1
            while len(self._landed) > 4096:
                self._landed.pop(next(iter(self._landed)))
        self._queue(events)
        self.flush()

    def abandon_copy(self, transfer_id: str, backend: TierBackend, keys: Sequence[PayloadKey]) -> None:
        """A copy stopped short: give back its room; ``keys`` it had committed are deleted again."""
        with self._lock:
            h = self._held.pop(transfer_id, None)
            if h is not None:
                h.reservation.release()
            for key in keys:
                blk = self._blocks.get(key)
                if blk is None or id(backend) not in blk.copies:
                    try:
                        backend.delete(key)
                    except TierUnavailableError as exc:
                        log.warning("rollback of %s on %s failed: %s", key, backend.label, exc)

    # -- hints ------------------------------------------------------------------------------------

    def reserve(self, transfer_id: str, tier: Tier, nbytes: int, *, tenant: str, expires_at: float,
                share: bool = True) -> str | None:
        """Set ``nbytes`` aside in ``tier`` for a prefetch until it lands or ``expires_at`` (at most
        ``prefetch_max_s`` from now); None when done, else why not. The planner priced the displacement
        already (it charged the published price), so anything unpinned and idle may make room,
        cheapest first. ``share``: within ``prefetch_fraction`` of the tier with the room held for
        other prefetches (a hint); False for a queued copy's own room (the executor, for a command it
        will run: the copy needs that room when it runs anyway)."""
        now = self.clock()
        if expires_at <= now or nbytes <= 0:
            return "nothing to reserve: expired or empty"
        shortened = expires_at > now + self.prefetch_max_s
        if shortened:
            expires_at = now + self.prefetch_max_s  # whatever the sender asked, room is held this long at most
        events: list[TierChange] = []
        with self._lock:
            if transfer_id in self._held:
                return None
            backend = self._backend_of(tier)
            if backend is None:
                return f"worker {self.worker} has no managed {tier.value} tier"
            limit = int(backend.capacity_bytes * self.prefetch_fraction)
            held = sum(h.reservation.remaining for h in self._held.values() if h.backend is backend and not h.landing)
            if share and held + nbytes > limit:
                self.counters["reservations_refused"] += 1
                return (f"prefetch share: {nbytes} bytes more would hold {held + nbytes} of {backend.label}'s "
                        f"{backend.capacity_bytes} bytes for prefetches, beyond its {self.prefetch_fraction:.0%} "
                        f"({limit} bytes)")
            why = self._make_room(backend, None, nbytes, now, events)
            reservation = backend.reserve(nbytes) if why is None else None
            if reservation is None:
                self.counters["reservations_refused"] += 1
                result = why or f"{backend.label}: no room for {nbytes} bytes"
            else:
                self._held[transfer_id] = _Held(backend, reservation, expires_at, tenant)
                self.counters["reservations"] += 1
                self.counters["reservations_shortened"] += shortened
                result = None
        self._queue(events)
        self.flush()
        return result

    def release(self, transfer_id: str, *, tenant: str | None = None) -> bool:
        """Give back the room set aside for ``transfer_id`` (a cancelled or finished prefetch); False
        when none (or, with ``tenant``, when it is another tenant's). Room a running copy commits into
        is left to it (it gives it back when it stops)."""
        with self._lock:
            h = self._held.get(transfer_id)
            if h is None or h.landing or (tenant is not None and h.tenant != tenant):
                return False
            del self._held[transfer_id]
        h.reservation.release()
        return True

    def pin(self, owner: str, keys: Sequence[PayloadKey], *, until: float, tenant: str,
            tier: Tier | None = None) -> PinOutcome:
        """Pin the held ``keys`` (in ``tier``, or wherever held) until ``until``, all or none, within
        the tier's pinned quota and the tenant's."""
        now = self.clock()
        with self._lock:
            held = [self._blocks[k] for k in keys if k in self._blocks
                    and (tier is None or any(c.backend.capabilities.tier is tier for c in self._blocks[k].copies.values()))]
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
            for b in self._managed:
                extra = add.get(id(b), 0)
                if not extra:
                    continue
                state = self._state(b, now)
                probe = Resident("pin", tenant, extra, 1.0, {}, last_used=now)
                d = pin_decision(probe, state, until=until, now=now)
                if not d.ok:
                    self.counters["pins_refused"] += 1
                    return PinOutcome(False, 0, f"{d.reason} (pin {owner} of {len(targets)} blocks, {extra} bytes)")
            quota = self.tenant_pin_quota(tenant) if self.tenant_pin_quota is not None else None
            if quota is not None:
                mine = sum(c.nbytes for blk in self._blocks.values() if blk.tenant == tenant
                           and (blk.pinned_until() or 0) > now for c in blk.copies.values())
                if mine + sum(add.values()) > quota:
                    self.counters["pins_refused"] += 1
                    return PinOutcome(False, 0, f"tenant {tenant} would pin more than its {quota} bytes")
            for blk in targets:
                blk.pins[owner] = max(until, blk.pins.get(owner, until))
                self._use(blk, now)
            self.counters["pins"] += 1
            other = len(held) - len(targets)
            return PinOutcome(True, len(targets), f"{len(targets)} blocks pinned until {until:.3f}"
                              + (f"; tenant: {other} of another tenant not pinned" if other else ""))

    def unpin(self, owner: str, *, tenant: str | None = None) -> int:
        """End the pins ``owner`` (a hint or transfer id) holds — with ``tenant``, on that tenant's blocks
        only; returns how many blocks it pinned."""
        n = 0
        with self._lock:
            for blk in self._blocks.values():
                if owner in blk.pins and (tenant is None or blk.tenant == tenant):
                    del blk.pins[owner]
                    n += 1
        return n

    def _hint_target(self, blk: _Block, tenant: str | None, now: float, refused: dict[str, int]) -> bool:
        """Whether a demote or evict hint may act on ``blk`` at all; counts why not."""
        why = None
        if tenant is not None and blk.tenant != tenant:
            why = "tenant"
        elif (blk.pinned_until() or 0.0) > now:
            why = "pinned"
        if why is not None:
            refused[why] = refused.get(why, 0) + 1
        return why is None

    def _copy_target(self, blk: _Block, c: _Copy, refused: dict[str, int]) -> bool:
        why = "busy" if c.readers or c.leaving else "anchored" if blk.children and len(blk.copies) == 1 else None
        if why is not None:
            refused[why] = refused.get(why, 0) + 1
        return why is None

    def _effect(self, acted: int, refused: dict[str, int]) -> HintEffect:
        self.counters["hint_blocks_refused"] += sum(refused.values())
        return HintEffect(acted, dict(refused))

    def demote(self, keys: Sequence[PayloadKey], tier: Tier, to_tier: Tier, *, tenant: str | None = None) -> HintEffect:
        """Move held ``keys`` (of ``tenant``, when given) from ``tier`` down to ``to_tier`` (dropped where
        that is impossible); never a pinned, busy or anchored copy."""
        events: list[TierChange] = []
        n = 0
        refused: dict[str, int] = {}
        now = self.clock()
        with self._lock:
            dst = self._backend_of(to_tier)
            for k in self._leaves_first(keys):
                blk = self._blocks.get(k)
                if blk is None or not self._hint_target(blk, tenant, now, refused):
                    continue
                for c in list(blk.copies.values()):
                    if c.backend.capabilities.tier is not tier or c.readers or c.leaving:
                        if c.backend.capabilities.tier is tier:
                            refused["busy"] = refused.get("busy", 0) + 1
                        continue
                    if dst is None or not self._demote_copy(blk, c.backend, dst, events, now):
                        if blk.children and len(blk.copies) == 1:
                            refused["anchored"] = refused.get("anchored", 0) + 1
                            continue  # a prefix parent does not vanish
                        self._drop_copy(blk, c.backend, events, why="demote hint: no room below")
                    n += 1
        self._queue(events)
        self.flush()
        return self._effect(n, refused)

    def evict(self, keys: Sequence[PayloadKey], tier: Tier, *, tenant: str | None = None) -> HintEffect:
        """Drop held ``keys`` (of ``tenant``, when given) from ``tier``; never a pinned, busy or anchored copy."""
        events: list[TierChange] = []
        n = 0
        refused: dict[str, int] = {}
        now = self.clock()
        with self._lock:
            for k in self._leaves_first(keys):
                blk = self._blocks.get(k)
                if blk is None or not self._hint_target(blk, tenant, now, refused):
                    continue
                for c in list(blk.copies.values()):
                    if c.backend.capabilities.tier is tier and self._copy_target(blk, c, refused):
                        self._drop_copy(blk, c.backend, events, why="evict hint")
                        n += 1
        self._queue(events)
        self.flush()
        return self._effect(n, refused)

    def adopt(self, entries: Sequence[tuple[PayloadKey, BlockIdentity, int]], *, tenant: str) -> int:
        """Payloads the tiers held at start whose identities the caller's publisher re-announced
        itself (the vLLM connector's manifest): ``(key, identity, position)``; they are kept as
        announced, without events. Returns how many a managed tier holds."""
        n = 0
        now = self.clock()
        with self._lock:
            for key, identity, position in entries:
                blk = self._blocks.get(key)
                if blk is None:
                    continue
                blk.identity, blk.lease_until, blk.tenant, blk.position = identity, None, tenant, position
                blk.score, blk.since = max(blk.score, 1.0), now
                blk.parent = None if identity.parent is None else PayloadKey(key.descriptor_id, identity.parent,
                                                                             key.group)
                n += 1
            for blk in self._blocks.values():
                if blk.identity is not None and blk.parent is not None and blk.parent in self._blocks:
                    self._blocks[blk.parent].children.add(blk.key)
        return n

    def lost(self, keys: Sequence[PayloadKey], tier: Tier) -> int:
        """Payloads found missing or corrupt in ``tier`` behind the manager's back: forget them there
        (and tell the index), whatever pinned or chained them; returns how many were held."""
        changes: list[TierChange] = []
        n = 0
        with self._lock:
            for key in keys:
                blk = self._blocks.get(key)
                for c in list(blk.copies.values()) if blk is not None else ():
                    if c.backend.capabilities.tier is tier:
                        self._drop_copy(blk, c.backend, changes, why="lost: missing or corrupt")  # type: ignore[arg-type]
                        n += 1
        self._queue(changes)
        self.flush()
        return n

    def _leaves_first(self, keys: Sequence[PayloadKey]) -> list[PayloadKey]:
        """``keys``, deepest first: a prefix parent leaves only after the blocks that chain from it."""
        return sorted(keys, key=lambda k: -(self._blocks[k].position if k in self._blocks else 0))

    def landed_keys(self, transfer_id: str) -> list[PayloadKey]:
        with self._lock:
            return [k for k, _ in self._landed.get(transfer_id, [])]

    # -- time -------------------------------------------------------------------------------------

    def tick(self) -> int:
        """Expire reservations and pins; drop held blocks nobody can find (no identity, lease
        over); returns how many blocks were dropped."""
        now = self.clock()
        events: list[TierChange] = []
        dropped = 0
        with self._lock:
            for tid, h in list(self._held.items()):
                if not h.landing and now >= h.expires_at:
                    del self._held[tid]
                    h.reservation.release()
                    self.counters["reservations_expired"] += 1
            for blk in list(self._blocks.values()):
                for owner, until in list(blk.pins.items()):
                    if now >= until:
                        del blk.pins[owner]
                if blk.identity is None and (blk.lease_until is None or now >= blk.lease_until) and not blk.pins:
                    for c in list(blk.copies.values()):
                        if not c.readers and not c.leaving:
                            self._drop_copy(blk, c.backend, events, why="garbage: held, unannounced, lease over")
                            dropped += 1
            self.counters["garbage"] += dropped
        self._queue(events)
        self.flush()
        return dropped

    # -- events -----------------------------------------------------------------------------------

    def _queue(self, events: list[TierChange]) -> None:
        """Hand the changes to the fact sink, in the order they were made (under the ledger's lock)."""
        if not events:
            return
        with self._lock:
            self.facts.apply(events)

    def flush(self) -> int:
        return self.facts.flush()

    def close(self) -> None:
        with self._lock:
            for h in self._held.values():
                h.reservation.release()
            self._held.clear()
        self.flush()

