"""The tier manager's mover: the only code that acts on the backends of a worker's managed tiers.

Part of :class:`~nexuskv.dataplane.tiers.TierManager` (the in-engine adapter's tier manager; the
service is :mod:`streams.tier_manager`). The :class:`~nexuskv.dataplane.tier_ledger.TierLedger`
says what is where; the mover does what a decision needs done to the bytes and records it there:
it makes room by utility (:func:`nexuskv.admission.admit` / :func:`~nexuskv.admission.evict_for`:
victims demoted to the next tier down when still worth keeping and it has room, dropped
otherwise), copies a demoted block down, deletes what leaves, writes a save's blocks, reads, and
lists what a backend holds (a previous process's leftovers, the audit). It owns no lock: the
facade holds its ledger lock around every eviction, demotion and drop, as the tier manager always
did, and runs a save's writes and a read's copy outside it (into room reserved for them, on copies
marked as being read).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from nexuskv.admission import EvictionKind, EvictionPolicy, Resident, TierState, admit, evict_for
from nexuskv.dataplane.backend import Reservation, TierBackend
from nexuskv.dataplane.catalog import TIER_ORDER
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.tier_facts import TierChange
from nexuskv.dataplane.tier_ledger import LedgerBlock, Room, TierLedger
from nexuskv.descriptor import Tier
from nexuskv.errors import DataPlaneError, TierUnavailableError

__all__ = ["TierMover"]

log = logging.getLogger("nexuskv.tiers")


class TierMover:
    """Evictions, demotions, deletes, saves' writes and reads on the managed ``backends``."""

    def __init__(self, ledger: TierLedger, backends: Sequence[TierBackend], *, policy: EvictionPolicy,
                 slack: float) -> None:
        self.ledger = ledger
        self.backends = tuple(backends)
        self.policy = policy
        self.slack = slack

    # -- what the backends count ------------------------------------------------------------------

    @staticmethod
    def room(backend: TierBackend) -> Room:
        return Room(backend.capacity_bytes, backend.used_bytes(), backend.free_bytes())

    def rooms(self) -> dict[int, Room]:
        return {id(b): self.room(b) for b in self.backends}

    def state(self, backend: TierBackend, now: float, refs: list | None = None,
              p_reuse: dict[PayloadKey, float] | None = None) -> TierState:
        return self.ledger.state(backend, self.room(backend), now, refs, p_reuse)

    def backend_of(self, tier: Tier) -> TierBackend | None:
        found = [b for b in self.backends if b.capabilities.tier is tier]
        if not found:
            return None
        return max(found, key=lambda b: b.free_bytes())

    def lower(self, backend: TierBackend) -> TierBackend | None:
        order = TIER_ORDER.index(backend.capabilities.tier)
        below = [b for b in self.backends if TIER_ORDER.index(b.capabilities.tier) > order]
        if not below:
            return None
        first = below[0].capabilities.tier
        return max((b for b in below if b.capabilities.tier is first), key=lambda b: b.free_bytes())

    def leftovers(self, now: float) -> None:
        """Record what a previous process left in the tiers (no identity: dropped at the first tick)."""
        for backend in self.backends:
            for key in backend.keys():
                header = backend.header(key)
                if header is not None:
                    self.ledger.found(backend, key, header.nbytes, now)

    def audit(self) -> dict[str, tuple[int, int]]:
        out = {}
        for b in self.backends:
            real = set(b.keys())
            mine = self.ledger.keys_in(b)
            out[b.label] = (len(mine - real), len(real - mine))
        return out

    # -- making room ------------------------------------------------------------------------------

    def make_room(self, backend: TierBackend, candidate: Resident | None, nbytes: int, now: float,
                  events: list[TierChange]) -> str | None:
        """Evict (demote or drop) so ``nbytes`` fit in ``backend``; None when done, else why not.

        ``candidate`` None: anything unpinned and idle may go (a planner-priced reservation).
        """
        if nbytes <= backend.free_bytes():
            return None
        refs: list[LedgerBlock] = []
        p_reuse = self.ledger.p_reuse(now)
        state = self.state(backend, now, refs, p_reuse)
        if nbytes <= state.free_bytes:
            return None
        lower_b = self.lower(backend)
        lower = None
        if lower_b is not None:
            # What the tier below could take: all but its pinned, busy and anchored state (a demotion
            # is an admission there, which may displace its cheaper residents in turn).
            below = self.state(lower_b, now, None, p_reuse)
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
            if ev.kind is EvictionKind.DEMOTE and lower_b is not None and self.demote(blk, backend, lower_b,
                                                                                       events, now, p_reuse):
                continue
            if blk.children and len(blk.copies) == 1:
                continue  # a prefix parent that could not move down stays
            self.drop(blk, backend, events, why=ev.reason, now=now)
        if backend.free_bytes() < nbytes:
            return f"{backend.label}: evictions did not free {nbytes} bytes ({backend.free_bytes()} free)"
        return None

    def demote(self, blk: LedgerBlock, src: TierBackend, dst: TierBackend, events: list[TierChange], now: float,
               p_reuse: dict[PayloadKey, float] | None = None) -> bool:
        """Copy ``blk`` from ``src`` to ``dst``, then delete it from ``src``; False when it could not.

        Entering ``dst`` is an admission there: the block may displace what is worth less per byte
        in ``dst`` (demoting that further down in turn).
        """
        copy = blk.copies.get(id(src))
        if copy is None:
            return False
        if id(dst) in blk.copies:  # already below: only the upper copy leaves
            self.drop(blk, src, events, why="demoted (already held below)", now=now)
            return True
        copy.leaving = True
        p = (p_reuse or {}).get(blk.key)
        if p is None:
            p = self.ledger.p_reuse(now).get(blk.key, 0.0)
        candidate = Resident("demoted", blk.tenant, copy.nbytes, p, self.ledger.gains_of(blk), last_used=blk.last_used,
                             expires_at=blk.lease_until if blk.identity is None else None)
        why = self.make_room(dst, candidate, copy.nbytes, now, events)
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
        self.ledger.moved(blk, src, dst, events)
        self.drop(blk, src, events, why="demoted", now=now, demoted=True)
        return True

    def drop(self, blk: LedgerBlock, backend: TierBackend, events: list[TierChange], *, why: str, now: float,
             demoted: bool = False) -> None:
        """``blk`` leaves ``backend``: deleted there and out of the ledger."""
        if self.ledger.remove_copy(blk, backend, events, why=why, now=now, demoted=demoted) is None:
            return
        self.delete(backend, blk.key, what="deleting")

    @staticmethod
    def delete(backend: TierBackend, key: PayloadKey, *, what: str) -> None:
        try:
            backend.delete(key)
        except TierUnavailableError as exc:
            log.warning("%s %s on %s failed: %s", what, key, backend.label, exc)

    # -- writes and reads -------------------------------------------------------------------------

    @staticmethod
    def write(backend: TierBackend, header: PayloadHeader, data: torch.Tensor, reservation: Reservation) -> str | None:
        """One save's block into the room reserved for it (released after); None, or why it failed."""
        try:
            with reservation:
                backend.put(header, data.reshape(-1).view(torch.uint8), reservation)
        except (DataPlaneError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    @staticmethod
    def batched(backend: TierBackend, data: torch.Tensor) -> bool:
        """Whether ``data`` goes to ``backend`` in :meth:`write_all` (a tier that writes or sends host
        bytes, disk or remote: no staging copy, one call per save) rather than :meth:`write`."""
        return bool(getattr(backend, "writes_from_views", False)) and data.device.type == "cpu"

    @staticmethod
    def write_all(backend: TierBackend, blocks: Sequence[tuple[PayloadHeader, torch.Tensor, Reservation]]
                  ) -> list[str | None]:
        """A save's blocks written from their host bytes in one call (the disk tier writes them with
        the GIL released once, not after every syscall: the saving thread runs beside an engine's
        step); each reservation is released after. Per block: None, or why it failed."""
        try:
            results: list = backend.commit_views([(h, d.reshape(-1).view(torch.uint8), r) for h, d, r in blocks])
        except (DataPlaneError, ValueError) as exc:
            results = [exc] * len(blocks)
        finally:
            for _, _, reservation in blocks:
                reservation.release()
        return [f"{type(r).__name__}: {r}" if isinstance(r, Exception) else None for r in results]

    @staticmethod
    def read(backend: Any, key: PayloadKey, out: torch.Tensor) -> PayloadHeader:
        return backend.read_verified(key, out)
