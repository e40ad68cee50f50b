"""The tier manager's announcer: what the rest of the deployment learns of a worker's tiers.

Part of :class:`~nexuskv.dataplane.tiers.TierManager` (the in-engine adapter's tier manager; the
service is :mod:`streams.tier_manager`). Two kinds of facts leave it:

* **kv-events** — every change the ledger records (:class:`~nexuskv.dataplane.tier_facts.TierChange`:
  a block stored, moved, removed) goes to the manager's fact sink (a
  :class:`~nexuskv.dataplane.tier_facts.TierFacts`, which numbers the batches of the manager's
  publisher and hands them to its ``publish``: the service's queues them on the bus layer's
  kv-events outbox, :class:`streams.bus.outbox.EventOutbox`; an engine adapter passes its own
  publisher), in the order the changes were made: :meth:`TierAnnouncer.queue` is called under the
  facade's ledger lock, :meth:`TierAnnouncer.flush` after it.
* **tier state** — :meth:`TierAnnouncer.usage`: per managed tier its usage, reserved, pinned and
  in-flight bytes and its displacement price (:func:`nexuskv.admission.displacement_price`) for a
  typical copy, which the service publishes as ``nexuskv.tier-state`` records and planners charge a
  prefetch as ``C_pollution``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nexuskv.admission import displacement_price
from nexuskv.dataplane.tier_facts import FactSink, TierChange
from nexuskv.dataplane.tier_ledger import TierLedger
from nexuskv.dataplane.tier_mover import TierMover
from nexuskv.descriptor import Tier

__all__ = ["TierUsage", "TierAnnouncer"]


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


class TierAnnouncer:
    """The manager's kv-events (through ``facts``) and tier-state facts (see the module docstring)."""

    def __init__(self, facts: FactSink, *, worker: str) -> None:
        self.facts = facts
        self.worker = worker

    def queue(self, changes: Sequence[TierChange]) -> None:
        """Hand ``changes`` to the fact sink; the caller holds the ledger lock, so their order is the
        ledger's."""
        if changes:
            self.facts.apply(changes)

    def flush(self) -> int:
        return self.facts.flush()

    def usage(self, ledger: TierLedger, mover: TierMover, now: float) -> tuple[TierUsage, ...]:
        """Every managed tier's state now (the caller holds the ledger lock)."""
        out = []
        for b in mover.backends:
            state = mover.state(b, now)
            blocks, unannounced, pinned, reserved, landing = ledger.counts(b, now)
            size = ledger.price_size(b, b.capacity_bytes)
            out.append(TierUsage(
                worker=self.worker, tier=b.capabilities.tier, backend=b.label, capacity_bytes=b.capacity_bytes,
                used_bytes=b.used_bytes(), reserved_bytes=reserved, pinned_bytes=pinned, in_flight_bytes=landing,
                blocks=blocks, unannounced_blocks=unannounced,
                price_s_per_gib=displacement_price(state, size, now=now), price_bytes=size,
                counters=dict(ledger.counters)))
        return tuple(out)
