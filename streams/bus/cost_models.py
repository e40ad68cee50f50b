"""Reading ``nexuskv.cost-models``: once at start (the calibration agent), or as a live replica (planners).

Every record on the topic is a complete posterior of one entry, keyed by entry id, so the latest
record per key is all anyone needs (the topic is compacted where the broker compacts).

* :func:`read_cost_models` reads the topic from the beginning to the end offsets it finds at start
  and returns the latest entry per key. On Tansu, whose ListOffsets(latest) is wrong after batched
  produce (``../shared/reference/stack.md`` §2.3), it may stop early: a calibration worker then
  resumes fewer fits and starts the rest from the shipped prior.
* :class:`CostModelReplica` follows the topic without a consumer group (every planner needs every
  entry) and folds each record into its :class:`~nexuskv.cost.CostModel` snapshot with
  :func:`nexuskv.calibration.apply_entry`; a record that does not decode goes to the dead-letter
  topic with the reason, is counted (``nexuskv_events_rejected``) and changes no fit. Its
  :meth:`~CostModelReplica.start` returns only once it has applied the topic up to the end
  offsets it found (or its timeout passed: :attr:`~CostModelReplica.caught_up` says which), so an
  engine or planner that restarts prices its first request with the last published fits instead
  of the shipped priors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from nexuskv.calibration import apply_entry
from nexuskv.config import BrokerUrl
from nexuskv.contracts import codec
from nexuskv.contracts.cost_models import CostModelEntry
from nexuskv.contracts.topics import COST_MODELS
from nexuskv.cost import CostModel
from nexuskv.errors import BrokerError, ContractError
from streams.bus.clients import dead_letter_for, make_consumer, retry_transient, send_dead_letter
from streams.bus.metrics import METRICS

__all__ = ["read_cost_models", "CostModelReplica"]

log = logging.getLogger(__name__)


async def _assign_all(consumer: AIOKafkaConsumer, timeout_s: float) -> list[TopicPartition]:
    """Wait for a group-less consumer of the topic to hold every partition, from the beginning."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not consumer.assignment():
        if asyncio.get_running_loop().time() > deadline:
            return []
        await asyncio.sleep(0.05)
    tps = sorted(consumer.assignment())
    await consumer.seek_to_beginning(*tps)
    return tps


async def read_cost_models(url: BrokerUrl, *, timeout_s: float = 30.0) -> dict[str, CostModelEntry]:
    """The latest entry per key, reading the topic up to its end offsets at call time."""
    # Without a group id, a subscribed consumer is assigned every partition (nothing is committed).
    consumer = make_consumer(url, COST_MODELS, client_id="nexuskv-cost-models-reader")
    await consumer.start()
    latest: dict[str, CostModelEntry] = {}
    try:
        tps = await _assign_all(consumer, timeout_s)
        if not tps:
            return latest
        ends = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if ends[tp] > 0}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while pending and asyncio.get_running_loop().time() < deadline:
            batches = await consumer.getmany(*pending, timeout_ms=200)
            for tp, records in batches.items():
                for rec in records:
                    try:
                        entry = codec.decode(COST_MODELS, rec.value)
                    except ContractError:
                        continue  # the replica dead-letters it; a reader at start skips it
                    latest[entry.key] = entry  # type: ignore[attr-defined]
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    return latest


class CostModelReplica:
    """A planner's in-process copy of the cost model, fed by ``nexuskv.cost-models``."""

    def __init__(self, url: BrokerUrl, base: CostModel, *, service: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.model = base
        self.service = service
        self.clock = clock
        self.applied = 0
        self.rejected = 0
        self.caught_up = False  # start() applied every record published before it began
        self._consumer: AIOKafkaConsumer | None = None
        self._rejected_at_start: list[tuple[ConsumerRecord, ContractError]] = []

    async def start(self, *, timeout_s: float = 30.0) -> None:
        """Subscribe from the beginning and apply every record up to the end offsets found now."""
        self._consumer = make_consumer(self.url, COST_MODELS, client_id=f"{self.service}-cost-models",
                                       fetch_max_wait_ms=50)
        await self._consumer.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s  # one budget for both steps: callers wait timeout_s, not twice that
        tps = await _assign_all(self._consumer, timeout_s)
        if tps:
            self.caught_up = await self._catch_up(tps, max(deadline - loop.time(), 0.5))
        log.info("%s: cost model %s at start (%d entries applied%s)", self.service, self.model.version, self.applied,
                 "" if self.caught_up else "; the topic's end was not reached in time")

    async def _catch_up(self, tps: list[TopicPartition], timeout_s: float) -> bool:
        consumer = self._consumer
        assert consumer is not None
        ends = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if ends[tp] > 0}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while pending and loop.time() < deadline:
            batches = await consumer.getmany(*pending, timeout_ms=200)
            for records in batches.values():
                for rec in records:
                    try:
                        self.apply(rec.value)
                    except ContractError as exc:
                        self._rejected(rec, exc)
                        self._rejected_at_start.append((rec, exc))  # dead-lettered once run() has a producer
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
        return not pending

    def _rejected(self, rec: ConsumerRecord, exc: ContractError) -> None:
        self.rejected += 1
        METRICS.events_rejected.labels(self.service, COST_MODELS.name).inc()
        log.warning("%s: cost-model record at %s/%d rejected: %s", self.service, rec.topic, rec.offset, exc)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def _dead_letter(self, producer: AIOKafkaProducer, rec: ConsumerRecord, exc: ContractError) -> None:
        letter = dead_letter_for(COST_MODELS.name, rec, exc, service=self.service, now=self.clock())
        await retry_transient(lambda: send_dead_letter(producer, letter),
                              what=f"{self.service}: dead-lettering a cost-model entry")

    def apply(self, raw: bytes) -> CostModelEntry:
        """Fold one record into the snapshot (raises ContractError for a bad one)."""
        entry = codec.decode(COST_MODELS, raw)
        self.model = apply_entry(self.model, entry)  # type: ignore[arg-type]
        self.applied += 1
        return entry  # type: ignore[return-value]

    async def run(self, producer: AIOKafkaProducer) -> None:
        """Follow the topic until cancelled; bad records go to the dead-letter topic."""
        if self._consumer is None:
            raise BrokerError("CostModelReplica.run: start() first")
        while self._rejected_at_start:
            rec, exc = self._rejected_at_start.pop(0)
            await self._dead_letter(producer, rec, exc)
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for rec in records:
                    try:
                        entry = self.apply(rec.value)
                    except ContractError as exc:
                        self._rejected(rec, exc)
                        await self._dead_letter(producer, rec, exc)
                        continue
                    log.info("cost model %s: %s v%d (%d observations)", self.model.version, entry.key,
                             entry.version, entry.observations)
