"""Transfers and prefetches in flight: deadlines, completion, abandonment, budgets, backpressure.

Every transfer the planner orders becomes a :class:`Ticket` and moves through::

    IN_FLIGHT --result: completed, before the deadline--> READY
    IN_FLIGHT --result: failed/cancelled/..., before----> FAILED     (request recomputes)
    IN_FLIGHT --deadline passes------------------------> ABANDONED  (request recomputes;
                                                                     cancel, or let it finish)
    ABANDONED --result: completed----------------------> LATE       (demote, evict or keep the copy)

Timeout is a planning outcome, not an error (whitepaper §7.3): when state is not ready by its
consume deadline, the request falls back to recompute (a superseding decision, revision + 1) and
the copy is cancelled or, if it lands anyway, demoted. One request's transfers (one per KV group)
fall back together.

Budgets (the execution policy's ``budgets`` and per-tenant quotas) cover two things, counted
apart. *In flight*: transfers, their bytes and planned bandwidth (each transfer claims its bytes
over the time to its deadline, the rate it needs rather than its link's peak), held until the
bytes stop moving — the executor's result says so, whatever the status; a cancelled transfer keeps
its budget until its ``cancelled`` result arrives (``lost_result_s`` later without one, the budget
is released and counted in ``lost_results``: the executor is gone). *Pinned*: the bytes of the
plan's ``pin`` hints — a transfer's source until the transfer stops (then an ``unpin`` hint ends
it at the tier manager), a reused prefix until the request has consumed it (its ``expires_at``).
:meth:`PrefetchScheduler.headroom` is the snapshot the planner checks, so a full budget makes the
planner refuse movement (backpressure) instead of queueing it.

The scheduler holds state but reads no clock: ``now`` is always passed in. Its effects are frozen
records; :func:`effect_hint` turns them into placement hints for the bus.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from nexuskv.contracts.decisions import Decision
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.transfers import TransferCommand, TransferKind, TransferResult, TransferStatus, result_mismatch
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError
from nexuskv.planner.plan import Plan
from nexuskv.planner.query import Headroom
from nexuskv.planner.records import fallback_decision
from nexuskv.policy import ExecutionPolicy

__all__ = ["TicketState", "Ticket", "Cancel", "Demote", "Evict", "Unpin", "PrefetchFallback", "Effect",
           "PrefetchScheduler", "effect_hint"]


class TicketState(StrEnum):
    IN_FLIGHT = "in_flight"
    READY = "ready"
    FAILED = "failed"
    ABANDONED = "abandoned"
    LATE = "late"


_OPEN = (TicketState.IN_FLIGHT,)


@dataclass(frozen=True, slots=True)
class Ticket:
    command: TransferCommand
    rate_bytes_per_s: float  # bandwidth it needs: bytes over the time to its deadline (or its predicted time)
    state: TicketState = TicketState.IN_FLIGHT
    holds_budget: bool = True
    changed_at: float = 0.0

    @property
    def transfer_id(self) -> str:
        return self.command.transfer_id

    @property
    def request_id(self) -> str:
        return self.command.request_id

    @property
    def tenant(self) -> str:
        return self.command.tenant_namespace


@dataclass(frozen=True, slots=True)
class Cancel:
    ticket: Ticket
    reason: str


@dataclass(frozen=True, slots=True)
class Demote:
    ticket: Ticket
    to_tier: Tier
    reason: str


@dataclass(frozen=True, slots=True)
class Evict:
    ticket: Ticket
    reason: str


@dataclass(frozen=True, slots=True)
class Unpin:
    """The transfer stopped moving bytes: its source pin at ``hint``'s worker and tier can end."""

    ticket: Ticket
    hint: PlacementHint  # the pin it ends
    reason: str


@dataclass(frozen=True, slots=True)
class _Pin:
    tenant: str
    nbytes: int
    expires_at: float
    transfer_id: str | None
    hint: PlacementHint


@dataclass(frozen=True, slots=True)
class PrefetchFallback:
    request_id: str
    decision: Decision  # the superseding recompute record
    reason: str


Effect = Cancel | Demote | Evict | Unpin | PrefetchFallback


class PrefetchScheduler:
    """Tickets of one planner process, and the budgets they hold."""

    def __init__(self, policy: ExecutionPolicy, *, lost_result_s: float = 60.0) -> None:
        self._policy = policy
        self._tickets: dict[str, Ticket] = {}
        self._decisions: dict[str, Decision] = {}  # request id -> the decision its tickets carry out
        self._fell_back: set[str] = set()
        self.lost_result_s = lost_result_s
        self.transfers = 0
        self.rate = 0.0
        self.in_flight_bytes = 0
        self.pinned = 0
        self.lost_results = 0
        self._by_tenant: dict[str, list[int]] = {}  # tenant -> [transfers, bytes in flight, pinned bytes]
        self._pins: dict[str, _Pin] = {}  # hint id -> a pin the plans asked for

    # -- snapshots --------------------------------------------------------------------------------

    @property
    def policy(self) -> ExecutionPolicy:
        return self._policy

    def update_policy(self, policy: ExecutionPolicy) -> None:
        """New budgets apply to what starts next; tickets in flight keep what they hold."""
        self._policy = policy

    def ticket(self, transfer_id: str) -> Ticket | None:
        return self._tickets.get(transfer_id)

    def open_tickets(self) -> tuple[Ticket, ...]:
        return tuple(t for t in self._tickets.values() if t.state in _OPEN)

    def headroom(self, tenant: str) -> Headroom:
        b = self._policy.budgets
        q = self._policy.quota_for(tenant)
        used_t, used_b, used_p = self._by_tenant.get(tenant, (0, 0, 0))
        return Headroom(
            transfers=b.max_transfers_in_flight - self.transfers,
            bytes_per_s=b.max_transfer_bytes_per_s - self.rate,
            pinned_bytes=b.max_pinned_bytes - self.pinned,
            tenant_transfers=None if q.max_transfers_in_flight is None else q.max_transfers_in_flight - used_t,
            tenant_bytes=None if q.max_transfer_bytes_in_flight is None else q.max_transfer_bytes_in_flight - used_b,
            tenant_pinned_bytes=None if q.max_pinned_bytes is None else q.max_pinned_bytes - used_p,
        )

    def pins(self) -> tuple[PlacementHint, ...]:
        """The pin hints whose bytes are counted now."""
        return tuple(p.hint for p in self._pins.values())

    # -- transitions ------------------------------------------------------------------------------

    def track(self, plan: Plan, *, now: float) -> tuple[Ticket, ...]:
        """Take the plan's transfers in flight, holding their budget, and count its pins."""
        self.track_pins(plan.hints)
        if not plan.transfers:
            return ()
        # As the planner's Headroom.refusal: the rate needed to land by the deadline.
        window = max(plan.chosen.terms.transfer_s, (plan.chosen.deadline_at or now) - now, 1e-9)
        tickets = []
        for cmd in plan.transfers:
            if cmd.transfer_id in self._tickets:
                raise ValueError(f"transfer {cmd.transfer_id} is already tracked")
            ticket = Ticket(cmd, rate_bytes_per_s=cmd.bytes / window, changed_at=now)
            self._tickets[cmd.transfer_id] = ticket
            self._hold(ticket, +1)
            tickets.append(ticket)
        self._decisions[plan.decision.request_id] = plan.decision
        return tuple(tickets)

    def track_pins(self, hints: Iterable[PlacementHint]) -> None:
        """Count the bytes of a plan's ``pin`` hints until they end (see the module docstring)."""
        for h in hints:
            if h.kind is not HintKind.PIN or h.hint_id in self._pins or h.bytes <= 0:
                continue
            until = h.expires_at if h.expires_at is not None else h.issued_at
            self._pins[h.hint_id] = _Pin(h.tenant_namespace, h.bytes, until, h.transfer_id, h)
            self._pin(h.tenant_namespace, h.bytes)

    def check(self, result: TransferResult) -> None:
        """Raise ContractError when ``result`` names a transfer of ours but not as we ordered it
        (another request, source or destination): it changes nothing and is dead-lettered."""
        ticket = self._tickets.get(result.transfer_id)
        why = None if ticket is None else result_mismatch(ticket.command, result)
        if why is not None:
            raise ContractError(f"mismatch: {why}")

    def complete(self, result: TransferResult, *, now: float) -> list[Effect]:
        """Apply an executor's result. Unknown transfers (another planner's, or forgotten) do nothing;
        one that does not match its command raises ContractError (:meth:`check`)."""
        self.check(result)
        ticket = self._tickets.get(result.transfer_id)
        if ticket is None:
            return []
        if ticket.state is TicketState.IN_FLIGHT:
            unpins = self._release(ticket, "the transfer stopped")
            if result.status is TransferStatus.COMPLETED and result.finished_at <= ticket.command.deadline_at:
                self._set(ticket, TicketState.READY, now)
                return unpins
            if result.status is TransferStatus.COMPLETED:
                late = self._set(ticket, TicketState.LATE, now)
                return unpins + self._fall_back(ticket, "transfer completed after its deadline", now) + self._late(late)
            self._set(ticket, TicketState.FAILED, now)
            why = f"transfer {result.status.value}: {result.error}"
            return unpins + self._fall_back(ticket, why, now) + self._cancel_siblings(ticket, why, now)
        if ticket.state is TicketState.ABANDONED:
            unpins = self._release(ticket, f"the abandoned transfer stopped ({result.status.value})")
            if result.status is TransferStatus.COMPLETED:
                return unpins + self._late(self._set(ticket, TicketState.LATE, now))
            self._set(ticket, TicketState.FAILED, now)
            return unpins
        return []

    def tick(self, *, now: float) -> list[Effect]:
        """Abandon every in-flight ticket whose deadline has passed (the request recomputes)."""
        effects: list[Effect] = []
        for ticket in list(self._tickets.values()):
            if ticket.state is TicketState.IN_FLIGHT and now >= ticket.command.deadline_at:
                effects.extend(self._abandon(ticket, now, "missed its deadline"))
            elif ticket.state is TicketState.ABANDONED and ticket.holds_budget \
                    and now - ticket.changed_at >= self.lost_result_s:
                # No result since it was abandoned: the executor is gone, and so is the copy.
                self.lost_results += 1
                effects.extend(self._release(ticket, f"no result {self.lost_result_s:.0f}s after it was abandoned"))
        for hint_id, p in list(self._pins.items()):
            if now >= p.expires_at:
                del self._pins[hint_id]
                self._pin(p.tenant, -p.nbytes)
        return effects

    def forget(self, *, before: float) -> int:
        """Drop closed tickets last changed before ``before`` (bounded memory); returns how many."""
        gone = [k for k, t in self._tickets.items() if t.state not in _OPEN and t.changed_at < before
                and not (t.state is TicketState.ABANDONED and t.holds_budget)]
        for k in gone:
            del self._tickets[k]
        live = {t.request_id for t in self._tickets.values()}
        for rid in [r for r in self._decisions if r not in live]:
            del self._decisions[rid]
            self._fell_back.discard(rid)
        return len(gone)

    # -- internals --------------------------------------------------------------------------------

    def _set(self, ticket: Ticket, state: TicketState, now: float) -> Ticket:
        current = self._tickets[ticket.transfer_id]
        updated = replace(current, state=state, changed_at=now)
        self._tickets[ticket.transfer_id] = updated
        return updated

    def _hold(self, ticket: Ticket, sign: int) -> None:
        cmd = ticket.command
        self.transfers += sign
        self.rate += sign * ticket.rate_bytes_per_s
        self.in_flight_bytes += sign * cmd.bytes
        used = self._by_tenant.setdefault(ticket.tenant, [0, 0, 0])
        used[0] += sign
        used[1] += sign * cmd.bytes
        if self.transfers == 0:
            self.rate = 0.0  # no float residue once nothing is in flight

    def _pin(self, tenant: str, nbytes: int) -> None:
        self.pinned += nbytes
        self._by_tenant.setdefault(tenant, [0, 0, 0])[2] += nbytes

    def _release(self, ticket: Ticket, why: str) -> list[Effect]:
        """The ticket's bytes stopped moving: free its budget and end its source pins."""
        current = self._tickets[ticket.transfer_id]
        if not current.holds_budget:
            return []
        self._hold(current, -1)
        self._tickets[ticket.transfer_id] = current = replace(current, holds_budget=False)
        out: list[Effect] = []
        for hint_id, p in list(self._pins.items()):
            if p.transfer_id == ticket.transfer_id:
                del self._pins[hint_id]
                self._pin(p.tenant, -p.nbytes)
                out.append(Unpin(current, p.hint, why))
        return out

    def _abandon(self, ticket: Ticket, now: float, why: str) -> list[Effect]:
        cancel = self._policy.fallback.in_flight_at_deadline == "cancel"
        self._set(ticket, TicketState.ABANDONED, now)
        effects: list[Effect] = list(self._fall_back(ticket, f"{ticket.command.kind.value} {why}", now))
        if cancel:
            # The budget stays held until the executor's result says the bytes stopped moving.
            effects.append(Cancel(self._tickets[ticket.transfer_id], f"{why}; the request recomputes"))
        effects.extend(self._cancel_siblings(ticket, why, now))
        return effects

    def _cancel_siblings(self, ticket: Ticket, why: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        for other in list(self._tickets.values()):
            if other.request_id == ticket.request_id and other.transfer_id != ticket.transfer_id \
                    and other.state is TicketState.IN_FLIGHT:
                out.extend(self._abandon(other, now, f"a sibling transfer {why}"))
        return out

    def _fall_back(self, ticket: Ticket, why: str, now: float) -> list[Effect]:
        rid = ticket.request_id
        if rid in self._fell_back:
            return []
        self._fell_back.add(rid)
        original = self._decisions.get(rid)
        if original is None:
            return []
        decision = fallback_decision(original, why, now=now)
        return [PrefetchFallback(rid, decision, why)]

    def _late(self, ticket: Ticket) -> list[Effect]:
        mode = self._policy.fallback.late_transfer
        why = "arrived after its deadline; the request already recomputed"
        if mode == "demote":
            return [Demote(ticket, self._policy.fallback.demote_to, why)]
        if mode == "evict":
            return [Evict(ticket, why)]
        return []


def effect_hint(effect: Cancel | Demote | Evict | Unpin, *, now: float) -> PlacementHint:
    """The placement hint an executor or tier manager acts on for one effect."""
    cmd = effect.ticket.command
    kind = {Cancel: HintKind.CANCEL, Demote: HintKind.DEMOTE, Evict: HintKind.EVICT, Unpin: HintKind.UNPIN}[type(effect)]
    what = f"{'prefetch' if cmd.kind is TransferKind.PREFETCH else 'transfer'} {cmd.transfer_id}: {effect.reason}"
    if isinstance(effect, Unpin):  # to the tier manager of the pinned source
        pin = effect.hint
        return PlacementHint(
            hint_id=f"{pin.hint_id}/unpin", request_id=cmd.request_id, tenant_namespace=cmd.tenant_namespace,
            prefix_root=pin.prefix_root, kind=kind, worker=pin.worker, tier=pin.tier, group=pin.group,
            first_block=pin.first_block, blocks=pin.blocks, keys=pin.keys, bytes=pin.bytes,
            descriptor_id=pin.descriptor_id, transfer_id=cmd.transfer_id, issued_at=now, reason=what)
    # A cancel goes to the executor moving the copy; a demote or evict to the tier now holding it.
    where = cmd.destination
    return PlacementHint(
        hint_id=f"{cmd.transfer_id}/{kind.value}", request_id=cmd.request_id, tenant_namespace=cmd.tenant_namespace,
        prefix_root=cmd.keys[0], kind=kind, worker=where.worker, tier=where.tier, group=where.group,
        blocks=len(cmd.keys), keys=cmd.keys if kind is not HintKind.CANCEL else (), bytes=cmd.bytes,
        descriptor_id=cmd.descriptor_id, transfer_id=cmd.transfer_id,
        to_tier=effect.to_tier if isinstance(effect, Demote) else None, issued_at=now, reason=what)
