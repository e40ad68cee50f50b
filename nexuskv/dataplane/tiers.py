"""A worker's tiers under one capacity authority: the tier manager an engine adapter builds in-process.

Names: :class:`TierManager` is the **in-engine adapter's** object — the vLLM connector's worker
side, the SGLang storage backend and the service each build one in their own process over the
tiers they write; the **service** is :mod:`streams.tier_manager` (``python -m
streams.tier_manager``, one process per worker), which runs one of these beside the transfer
executor and connects it to the bus (:class:`streams.tier_manager.TierBus`).

The manager is a thin facade over three parts, wired here under one lock:

* the **ledger** (:mod:`.tier_ledger`, pure: no I/O, no clock reads, no threads) — what is where,
  pins, reservations, leases, the counters and the drop log;
* the **mover** (:mod:`.tier_mover`) — the only code doing I/O on the backends: evictions,
  demotion copies, deletes, a save's writes, reads;
* the **announcer** (:mod:`.tier_announcer`) — the kv-events of every change, in order, and the
  tier-state facts (usage and price).

The facade decides the order (admission, then the writes, then the record), holds the lock and
passes the clock's time to the ledger. A managed disk tier's folder is locked by its one
authority (:mod:`.folder_lock`): a second manager over the same folder fails at start with
:class:`~nexuskv.errors.TierLockedError`, naming the folder and the holder's pid;
:meth:`TierManager.close` (or the process's exit) lets it go.

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

Thread-safe: one lock over the ledger; drops and demotions run under it, a save's own writes and a
read's copy outside it (into bytes reserved for them, on copies marked as being read).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from nexuskv.admission import ByUtility, EvictionPolicy, Resident, ReuseModel, displacement_price
from nexuskv.dataplane.backend import Reservation, TierBackend, host_view
from nexuskv.dataplane.catalog import TIER_ORDER, BackendCatalog
from nexuskv.dataplane.folder_lock import FolderLock
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.tier_announcer import TierAnnouncer, TierUsage
from nexuskv.dataplane.tier_facts import BlockIdentity, FactSink, TierChange, TierFacts
from nexuskv.dataplane.tier_ledger import GainFn, Held, HintEffect, LedgerBlock, PinOutcome, TierLedger
from nexuskv.dataplane.tier_mover import TierMover
from nexuskv.descriptor import Tier

__all__ = ["SaveBlock", "SaveOutcome", "TierUsage", "PinOutcome", "HintEffect", "GainFn", "TierManager"]


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


class TierManager:
    """The capacity authority of one worker's tiers, in the process that writes them (see the module
    docstring): the facade over its ledger, mover and announcer."""

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
        self.clock = clock
        self._lock = threading.RLock()
        managed = [b for b in catalog.backends if not b.capabilities.shared]
        self._managed = sorted(managed, key=lambda b: TIER_ORDER.index(b.capabilities.tier))
        self._ids = {id(b) for b in self._managed}
        # One authority per tier folder: a second manager over one of these fails here, naming it.
        self._locks: list[FolderLock] = []
        try:
            for b in self._managed:
                folder = getattr(b, "folder", None)
                if folder is not None:
                    self._locks.append(FolderLock(folder, holder=f"tier manager of worker {self.worker} ({b.label})"))
        except BaseException:
            self._unlock()
            raise
        self.ledger = TierLedger(self._managed, reuse=reuse or ReuseModel(), gains=gains, pin_fraction=pin_fraction,
                                 tenant_pin_quota=tenant_pin_quota, lease_s=lease_s, drop_log=drop_log)
        self.mover = TierMover(self.ledger, self._managed, policy=self.policy, slack=slack)
        self.announcer = TierAnnouncer(self.facts, worker=self.worker)
        self.mover.leftovers(clock())

    # The ledger's settings and records, as the manager always exposed them.
    reuse = property(lambda self: self.ledger.reuse)
    gains = property(lambda self: self.ledger.gains)
    pin_fraction = property(lambda self: self.ledger.pin_fraction)
    tenant_pin_quota = property(lambda self: self.ledger.tenant_pin_quota)
    lease_s = property(lambda self: self.ledger.lease_s)
    slack = property(lambda self: self.mover.slack)
    counters = property(lambda self: self.ledger.counters)
    drops = property(lambda self: self.ledger.drops)
    _held = property(lambda self: self.ledger.held)

    # -- queries ----------------------------------------------------------------------------------

    def managed(self, backend: TierBackend) -> bool:
        return id(backend) in self._ids

    def backends(self) -> tuple[TierBackend, ...]:
        return tuple(self._managed)

    def holds(self, key: PayloadKey, tier: Tier) -> bool:
        with self._lock:
            return self.ledger.holds(key, tier)

    def keys(self, tier: Tier) -> list[PayloadKey]:
        """Every block the manager holds in ``tier``, announced or not."""
        with self._lock:
            return self.ledger.keys(tier)

    def contents(self) -> dict[tuple[Tier, int], set[PayloadKey]]:
        """What the manager believes each tier holds and has announced: ``{(tier, group): keys}``."""
        with self._lock:
            return self.ledger.contents()

    def audit(self) -> dict[str, tuple[int, int]]:
        """Per managed backend: (keys the ledger has but the backend lacks, keys the backend has but
        the ledger lacks). Both 0 when the ledger is true."""
        with self._lock:
            return self.mover.audit()

    def usage(self) -> tuple[TierUsage, ...]:
        now = self.clock()
        with self._lock:
            return self.announcer.usage(self.ledger, self.mover, now)

    def price(self, tier: Tier, nbytes: int) -> float:
        """Seconds of expected gain lost per GiB if ``nbytes`` landed in ``tier`` now."""
        now = self.clock()
        with self._lock:
            b = self.mover.backend_of(tier)
            return 0.0 if b is None else displacement_price(self.mover.state(b, now), nbytes, now=now)

    def landed_keys(self, transfer_id: str) -> list[PayloadKey]:
        with self._lock:
            return self.ledger.landed_keys(transfer_id)

    # -- saves ------------------------------------------------------------------------------------

    def save(self, blocks: Sequence[SaveBlock], tier: Tier, *, tenant: str) -> SaveOutcome:
        """Store ``blocks`` in this worker's ``tier`` where admission lets them in; announce them.

        Blocks are taken in order; a block whose prefix parent is neither held here nor saved in
        this call is refused (the index could not key it, and no prefix match would reach it).
        """
        now = self.clock()
        ledger = self.ledger
        held: list[PayloadKey] = []
        reasons: list[str] = []
        saved = already = refused = failed = nbytes = 0
        events: list[TierChange] = []
        todo: list[tuple[SaveBlock, PayloadHeader, Reservation, int]] = []
        with self._lock:
            dst = self.mover.backend_of(tier)
            if dst is None:
                return SaveOutcome(tier, len(blocks), refused=len(blocks),
                                   reasons=(f"worker {self.worker} has no managed {tier.value} tier",))
            coming: dict[PayloadKey, int] = {}  # admitted in this call -> position
            run = ledger.run_gains([(sb.key, sb.position or 0, int(sb.data.numel() * sb.data.element_size()))
                                    for sb in blocks])
            # A save is a use of every block in it that is held already, counted before anything is
            # scored: a chain being saved must not make room by evicting its own other blocks.
            ledger.touch([sb.key for sb in blocks], now)
            for sb in blocks:
                key = sb.key
                blk = ledger.blocks.get(key)
                if blk is not None and id(dst) in blk.copies:
                    if sb.identity is not None and blk.identity is None:
                        ledger.announce(blk, sb.identity, events)
                    already += 1
                    held.append(key)
                    continue
                position = sb.position
                if sb.identity is not None and sb.identity.parent is not None:
                    parent_key = PayloadKey(key.descriptor_id, sb.identity.parent, key.group)
                    parent = ledger.blocks.get(parent_key)
                    if parent_key not in coming and (parent is None or parent.identity is None):
                        refused += 1
                        ledger.counters["save_refused"] += 1
                        reasons.append(f"block {key}: its prefix parent is not held by {self.worker}")
                        continue
                    if position is None:
                        position = coming[parent_key] + 1 if parent_key in coming else parent.position + 1  # type: ignore[union-attr]
                size = int(sb.data.numel() * sb.data.element_size())
                header = PayloadHeader.for_data(key, host_view(sb.data))
                probe = blk or LedgerBlock(key, tenant, size, 1.0, now, now, position or 0)
                p = min(1.0, ledger.reuse.p_reuse(probe.score, probe.since, now))
                candidate = Resident("candidate", tenant, size, p, run, last_used=now)
                why = self.mover.make_room(dst, candidate, size, now, events)
                reservation = dst.reserve(size) if why is None else None
                if reservation is None:
                    refused += 1
                    ledger.counters["save_refused"] += 1
                    reasons.append(f"block {key} refused on {tier.value}: {why or 'no room'}")
                    continue
                todo.append((sb, header, reservation, position or 0))
                coming[key] = position or 0
            self.announcer.queue(events)
        events = []
        # Outside the lock, into the room reserved: one call for a tier that writes host bytes as they
        # are (disk, remote: TierMover.batched), one per block for the others; in the save's order.
        batch = [t for t in todo if self.mover.batched(dst, t[0].data)]
        errs = dict(zip((id(t[0]) for t in batch),
                        self.mover.write_all(dst, [(h, sb.data, res) for sb, h, res, _ in batch]) if batch else ()))
        written: list[tuple[SaveBlock, PayloadHeader, int]] = []
        for sb, header, reservation, position in todo:
            err = errs[id(sb)] if id(sb) in errs else self.mover.write(dst, header, sb.data, reservation)
            if err is None:
                written.append((sb, header, position))
            else:
                failed += 1
                with self._lock:
                    ledger.counters["save_failed"] += 1
                reasons.append(f"block {sb.key}: {err}")
        with self._lock:
            for sb, header, position in written:
                ledger.saved(dst, (sb.key, sb.identity, position, header.nbytes), tenant=tenant, gains=run, now=now,
                             events=events)
                saved += 1
                nbytes += header.nbytes
                held.append(sb.key)
            self.announcer.queue(events)
        self.flush()
        return SaveOutcome(tier, len(blocks), saved, already, refused, failed, nbytes, tuple(held),
                           tuple(dict.fromkeys(reasons)))

    # -- reads ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self, backend: TierBackend, keys: Sequence[PayloadKey]) -> Iterator[None]:
        """While the block runs, ``keys`` in ``backend`` are not evicted (a transfer or reader uses
        them); each counts one use."""
        if not self.managed(backend):
            yield
            return
        now = self.clock()
        with self._lock:
            taken = self.ledger.take_readers(backend, keys, now)
        try:
            yield
        finally:
            with self._lock:
                self.ledger.give_readers(taken)

    def touch(self, keys: Sequence[PayloadKey]) -> int:
        """Count one use of each held key (a hit served from a tier); returns how many were held."""
        now = self.clock()
        with self._lock:
            return self.ledger.touch(keys, now)

    def read(self, tier: Tier, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        """Read a held block into ``out``, verified, as a use; None when this tier does not hold it."""
        with self._lock:
            copy = self.ledger.readable(key, tier)
        if copy is None:
            return None
        with self.reading(copy.backend, [key]):
            return self.mover.read(copy.backend, key, out)

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
        ledger = self.ledger
        with self._lock:
            held = ledger.take(transfer_id)
            if held is not None and held.backend is not backend:
                held.reservation.release()
                held = None
            have = held.reservation.remaining if held is not None else 0
            if have >= need:
                reservation = held.reservation  # type: ignore[union-attr]
            else:
                if held is not None:
                    held.reservation.release()
                run = [(key, ledger.blocks[key].position if key in ledger.blocks else i, n)
                       for i, (key, n) in enumerate(blocks)]
                gains = {t: g * len(blocks) for t, g in ledger.run_gains(run).items()}  # the copy as one unit
                candidate = Resident("copy", tenant, max(1, need), 1.0, gains, last_used=now)
                why = self.mover.make_room(backend, candidate, need, now, events)
                reservation = backend.reserve(need) if why is None else None
                if reservation is None:
                    ledger.counters["copies_refused"] += 1
                    self.announcer.queue(events)
                    self.flush()
                    return None, why or f"{backend.label}: {backend.free_bytes()} bytes free, {need} needed"
            ledger.hold(transfer_id, Held(backend, reservation, expires_at, tenant, landing=True))
            ledger.counters["copies_admitted"] += 1
            self.announcer.queue(events)
        self.flush()
        return reservation, "admitted"

    def landed(self, transfer_id: str, tenant: str, backend: TierBackend, keys: Sequence[PayloadKey],
               nbytes: Sequence[int], *, lease_until: float) -> None:
        """A copy committed ``keys`` into ``backend``: hold them; announce those whose identity is known."""
        now = self.clock()
        events: list[TierChange] = []
        with self._lock:
            h = self.ledger.take(transfer_id)
            if h is not None:
                h.reservation.release()
            if not self.managed(backend):
                return
            self.ledger.land(transfer_id, tenant, backend, keys, nbytes, lease_until=lease_until, now=now,
                             events=events)
            self.announcer.queue(events)
        self.flush()

    def abandon_copy(self, transfer_id: str, backend: TierBackend, keys: Sequence[PayloadKey]) -> None:
        """A copy stopped short: give back its room; ``keys`` it had committed are deleted again."""
        with self._lock:
            h = self.ledger.take(transfer_id)
            if h is not None:
                h.reservation.release()
            for key in keys:
                blk = self.ledger.blocks.get(key)
                if blk is None or id(backend) not in blk.copies:
                    self.mover.delete(backend, key, what="rollback of")

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
        counters = self.ledger.counters
        with self._lock:
            if transfer_id in self.ledger.held:
                return None
            backend = self.mover.backend_of(tier)
            if backend is None:
                return f"worker {self.worker} has no managed {tier.value} tier"
            limit = int(backend.capacity_bytes * self.prefetch_fraction)
            held = self.ledger.prefetch_held(backend)
            if share and held + nbytes > limit:
                counters["reservations_refused"] += 1
                return (f"prefetch share: {nbytes} bytes more would hold {held + nbytes} of {backend.label}'s "
                        f"{backend.capacity_bytes} bytes for prefetches, beyond its {self.prefetch_fraction:.0%} "
                        f"({limit} bytes)")
            why = self.mover.make_room(backend, None, nbytes, now, events)
            reservation = backend.reserve(nbytes) if why is None else None
            if reservation is None:
                counters["reservations_refused"] += 1
                result = why or f"{backend.label}: no room for {nbytes} bytes"
            else:
                self.ledger.hold(transfer_id, Held(backend, reservation, expires_at, tenant))
                counters["reservations"] += 1
                counters["reservations_shortened"] += shortened
                result = None
            self.announcer.queue(events)
        self.flush()
        return result

    def release(self, transfer_id: str, *, tenant: str | None = None) -> bool:
        """Give back the room set aside for ``transfer_id`` (a cancelled or finished prefetch); False
        when none (or, with ``tenant``, when it is another tenant's). Room a running copy commits into
        is left to it (it gives it back when it stops)."""
        with self._lock:
            h = self.ledger.cancel(transfer_id, tenant)
        if h is None:
            return False
        h.reservation.release()
        return True

    def pin(self, owner: str, keys: Sequence[PayloadKey], *, until: float, tenant: str,
            tier: Tier | None = None) -> PinOutcome:
        """Pin the held ``keys`` (in ``tier``, or wherever held) until ``until``, all or none, within
        the tier's pinned quota and the tenant's."""
        now = self.clock()
        with self._lock:
            return self.ledger.pin(owner, keys, until=until, tenant=tenant, tier=tier, now=now,
                                   rooms=self.mover.rooms())

    def unpin(self, owner: str, *, tenant: str | None = None) -> int:
        """End the pins ``owner`` (a hint or transfer id) holds — with ``tenant``, on that tenant's blocks
        only; returns how many blocks it pinned."""
        with self._lock:
            return self.ledger.unpin(owner, tenant=tenant)

    def demote(self, keys: Sequence[PayloadKey], tier: Tier, to_tier: Tier, *, tenant: str | None = None) -> HintEffect:
        """Move held ``keys`` (of ``tenant``, when given) from ``tier`` down to ``to_tier`` (dropped where
        that is impossible); never a pinned, busy or anchored copy."""
        events: list[TierChange] = []
        n = 0
        refused: dict[str, int] = {}
        now = self.clock()
        ledger, mover = self.ledger, self.mover
        with self._lock:
            dst = mover.backend_of(to_tier)
            for k in ledger.leaves_first(keys):
                blk = ledger.blocks.get(k)
                if blk is None or not ledger.hint_target(blk, tenant, now, refused):
                    continue
                for c in list(blk.copies.values()):
                    if c.backend.capabilities.tier is not tier or c.readers or c.leaving:
                        if c.backend.capabilities.tier is tier:
                            refused["busy"] = refused.get("busy", 0) + 1
                        continue
                    if dst is None or not mover.demote(blk, c.backend, dst, events, now):
                        if blk.children and len(blk.copies) == 1:
                            refused["anchored"] = refused.get("anchored", 0) + 1
                            continue  # a prefix parent does not vanish
                        mover.drop(blk, c.backend, events, why="demote hint: no room below", now=now)
                    n += 1
            self.announcer.queue(events)
            effect = ledger.effect(n, refused)
        self.flush()
        return effect

    def evict(self, keys: Sequence[PayloadKey], tier: Tier, *, tenant: str | None = None) -> HintEffect:
        """Drop held ``keys`` (of ``tenant``, when given) from ``tier``; never a pinned, busy or anchored copy."""
        events: list[TierChange] = []
        n = 0
        refused: dict[str, int] = {}
        now = self.clock()
        ledger = self.ledger
        with self._lock:
            for k in ledger.leaves_first(keys):
                blk = ledger.blocks.get(k)
                if blk is None or not ledger.hint_target(blk, tenant, now, refused):
                    continue
                for c in list(blk.copies.values()):
                    if c.backend.capabilities.tier is tier and ledger.copy_target(blk, c, refused):
                        self.mover.drop(blk, c.backend, events, why="evict hint", now=now)
                        n += 1
            self.announcer.queue(events)
            effect = ledger.effect(n, refused)
        self.flush()
        return effect

    def adopt(self, entries: Sequence[tuple[PayloadKey, BlockIdentity, int]], *, tenant: str) -> int:
        """Payloads the tiers held at start whose identities the caller's publisher re-announced
        itself (the vLLM connector's manifest): ``(key, identity, position)``; they are kept as
        announced, without events. Returns how many a managed tier holds."""
        now = self.clock()
        with self._lock:
            return self.ledger.adopt(entries, tenant=tenant, now=now)

    def lost(self, keys: Sequence[PayloadKey], tier: Tier) -> int:
        """Payloads found missing or corrupt in ``tier`` behind the manager's back: forget them there
        (and tell the index), whatever pinned or chained them; returns how many were held."""
        changes: list[TierChange] = []
        n = 0
        now = self.clock()
        with self._lock:
            for key in keys:
                blk = self.ledger.blocks.get(key)
                for c in list(blk.copies.values()) if blk is not None else ():
                    if c.backend.capabilities.tier is tier:
                        self.mover.drop(blk, c.backend, changes, why="lost: missing or corrupt", now=now)  # type: ignore[arg-type]
                        n += 1
            self.announcer.queue(changes)
        self.flush()
        return n

    # -- time -------------------------------------------------------------------------------------

    def tick(self) -> int:
        """Expire reservations and pins; drop held blocks nobody can find (no identity, lease
        over); returns how many blocks were dropped."""
        now = self.clock()
        events: list[TierChange] = []
        with self._lock:
            expired, garbage = self.ledger.expire(now)
            for h in expired:
                h.reservation.release()
            for blk, backend in garbage:
                self.mover.drop(blk, backend, events, why="garbage: held, unannounced, lease over", now=now)
            self.ledger.counters["garbage"] += len(garbage)
            self.announcer.queue(events)
        self.flush()
        return len(garbage)

    # -- facts ------------------------------------------------------------------------------------

    def flush(self) -> int:
        return self.announcer.flush()

    def close(self) -> None:
        """Give back the room held, send what is queued, and let the tier folders go."""
        with self._lock:
            for h in self.ledger.take_all():
                h.reservation.release()
        self.flush()
        self._unlock()

    def _unlock(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []
