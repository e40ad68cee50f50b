"""Reading ``nexuskv.tier-state`` as a live replica: each worker's displacement price, for planners.

A tier manager publishes each managed tier's state every few seconds (compacted, keyed by worker
and tier). :class:`TierPriceReplica` follows the topic without a consumer group (every planner
needs every worker) and keeps the latest record per key; :meth:`TierPriceReplica.prices` is the
``pollution_s_per_gib`` mapping :func:`nexuskv.planner.plan` takes: per worker, the price of
displacing state in its GPU tier (where a prefetch lands). A record older than ``stale_s`` is
left out (that worker's tier manager is gone or stuck: the policy's default price applies), and
a price is capped at ``cap_s_per_gib`` (infinite means pinned state leaves no room at all; the
planner's prefetch arithmetic needs a finite number, and the cap is already prohibitive).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from nexuskv.config import BrokerUrl
from nexuskv.contracts import codec
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import TIER_STATE
from nexuskv.descriptor import Tier
from nexuskv.errors import BrokerError, ContractError
from streams.bus.clients import dead_letter_for, make_consumer, send_dead_letter
from streams.bus.cost_models import _assign_all

__all__ = ["TierPriceReplica"]

log = logging.getLogger(__name__)


class TierPriceReplica:
    """The latest ``nexuskv.tier-state`` record per worker and tier."""

    def __init__(self, url: BrokerUrl, *, service: str, stale_s: float = 30.0, cap_s_per_gib: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.service = service
        self.stale_s = stale_s
        self.cap_s_per_gib = cap_s_per_gib
        self.clock = clock
        self.states: dict[str, TierStateRecord] = {}
        self.applied = 0
        self.rejected = 0
        self._consumer: AIOKafkaConsumer | None = None

    def apply(self, raw: bytes) -> TierStateRecord:
        record = codec.decode(TIER_STATE, raw)
        assert isinstance(record, TierStateRecord)
        prior = self.states.get(record.key)
        if prior is None or record.published_at >= prior.published_at:
            self.states[record.key] = record
        self.applied += 1
        return record

    def prices(self, tier: Tier = Tier.GPU) -> dict[str, float]:
        """Worker -> seconds of expected gain lost per GiB a prefetch would displace in its ``tier``."""
        now = self.clock()
        out = {}
        for r in self.states.values():
            if r.tier is tier and now - r.published_at <= self.stale_s:
                out[r.worker] = min(r.price_s_per_gib, self.cap_s_per_gib)
        return out

    async def start(self, *, timeout_s: float = 30.0) -> None:
        self._consumer = make_consumer(self.url, TIER_STATE, client_id=f"{self.service}-tier-state",
                                       fetch_max_wait_ms=100)
        await self._consumer.start()
        await _assign_all(self._consumer, timeout_s)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def run(self, producer: AIOKafkaProducer) -> None:
        """Follow the topic until cancelled; bad records go to the dead-letter topic."""
        if self._consumer is None:
            raise BrokerError("TierPriceReplica.run: start() first")
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for rec in records:
                    try:
                        self.apply(rec.value)
                    except ContractError as exc:
                        self.rejected += 1
                        await send_dead_letter(producer, dead_letter_for(TIER_STATE.name, rec, exc,
                                                                         service=self.service, now=self.clock()))
