"""The decision sink: ``nexuskv.decisions``, ``nexuskv.transfer-results`` and ``nexuskv.observations``
into DuckDB, in batches, exactly once in effect.

One consumer (group ``nexuskv-decision-sink``) reads the three topics; records are decoded with
their contracts, buffered, and written when ``batch_records`` are waiting or ``flush_interval_s``
has passed — then, and only then, are the offsets committed. A crash re-delivers at most the
unflushed tail, and the store's primary keys (request id, transfer id, topic/partition/offset)
drop the duplicates. Malformed records go to ``nexuskv.dead-letter`` with the reason.

Transfer results are control records: under a bus secret (or ``NEXUSKV_PUBLISHER_KEYS``) one is
written only when it is signed by the executor of its destination worker (``executor/<worker>``),
so the store's transfer outcomes, which Effective Gain analysis joins to decisions, are the
executors' own. An unsigned, forged, planner- or engine-signed result, or one signed by another
worker's executor, is dead-lettered with the reason and written nowhere. The sink checks the
signature and the producer only, not the replay window: it acts on nothing, a replayed result is
dropped by the transfer id's key, and a sink catching up after downtime must still record the
results it finds older than the window.

DuckDB I/O never runs on the event loop (``stack.md`` §1.8: a blocked loop stalls heartbeats):
flushes run in a worker thread. Dead letters are sent in batches and acknowledged before the
offsets past their records are committed. A broker outage is waited out; a failure (DuckDB) ends
the service with a non-zero exit status; readiness (partitions assigned) and
liveness are on ``/readyz`` and ``/livez``.

Run: ``python -m streams.sink`` (``NEXUSKV_BROKER``, ``NEXUSKV_DECISION_DB``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from analytics.store import DecisionStore
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.control_signature import ControlVerifier
from nexuskv.contracts.decisions import Decision
from nexuskv.contracts.observations import ObservationRecord
from nexuskv.contracts.topics import DECISIONS, OBSERVATIONS, TRANSFER_RESULTS, Topic
from nexuskv.contracts.transfers import TransferResult, executor_of
from nexuskv.errors import NexusKVError, UnauthenticatedError
from streams.bus.health import HEALTH
from streams.bus.metrics import METRICS
from streams.bus.tracing import span_from_record
from streams.supervisor import Supervisor, run_service
from streams.telemetry import init_service

__all__ = ["DecisionSink", "SinkStats"]

log = logging.getLogger(__name__)

_TOPICS: dict[str, Topic] = {t.name: t for t in (DECISIONS, TRANSFER_RESULTS, OBSERVATIONS)}


@dataclass(slots=True)
class SinkStats:
    consumed: int = 0
    written: dict[str, int] = field(default_factory=lambda: {"decisions": 0, "transfer_results": 0,
                                                             "observations": 0})
    dead_lettered: int = 0
    flushes: int = 0


class DecisionSink:
    """Consumes the three topics into one :class:`DecisionStore`."""

    def __init__(self, url: BrokerUrl, store: DecisionStore, *, group_id: str = "nexuskv-decision-sink",
                 batch_records: int = 5000, flush_interval_s: float = 0.5, snapshot_path: Path | None = None,
                 snapshot_interval_s: float = 30.0, verifier: ControlVerifier | None = None,
                 clock=time.time) -> None:
        from streams.bus.clients import control_verifier

        self.url = url
        self.verifier = verifier if verifier is not None else control_verifier(Settings.from_env())
        self.clock = clock
        self.store = store
        self.group_id = group_id
        self.batch_records = batch_records
        self.flush_interval_s = flush_interval_s
        self.snapshot_path = snapshot_path
        self.snapshot_interval_s = snapshot_interval_s
        self.stats = SinkStats()
        self._decisions: list[Decision] = []
        self._results: list[TransferResult] = []
        self._observations: list[tuple[ObservationRecord, str]] = []
        self._offsets: dict[TopicPartition, int] = {}
        self._letters = None

    async def run(self, stop: asyncio.Event) -> None:
        from streams.bus.clients import DeadLetterQueue, make_consumer, make_producer

        consumer = make_consumer(self.url, *_TOPICS.values(), client_id="decision-sink", group_id=self.group_id)
        producer = make_producer(self.url, client_id="decision-sink-dlq")
        await consumer.start()
        await producer.start()
        self._letters = DeadLetterQueue(producer)
        supervisor = Supervisor("decision-sink")
        last_flush = last_snapshot = time.monotonic()
        try:
            while not stop.is_set():
                if supervisor.failure is not None:
                    raise supervisor.failure
                batches = await consumer.getmany(timeout_ms=int(self.flush_interval_s * 1000), max_records=2000)
                if consumer.assignment():
                    HEALTH.set_ready("partitions", True)
                for tp, records in batches.items():
                    for record in records:
                        await self._take(record)
                        self._offsets[tp] = record.offset + 1
                    high = consumer.highwater(tp)
                    if high is not None:
                        METRICS.consumer_lag.labels("decision-sink", tp.topic).set(max(0, high - records[-1].offset - 1))
                now = time.monotonic()
                pending = len(self._decisions) + len(self._results) + len(self._observations)
                if pending >= self.batch_records or (self._offsets and now - last_flush >= self.flush_interval_s):
                    await self._flush(consumer)
                    last_flush = now
                if self.snapshot_path and now - last_snapshot >= self.snapshot_interval_s:
                    await asyncio.to_thread(self.store.snapshot, self.snapshot_path)
                    last_snapshot = now
            await self._flush(consumer)
            if self.snapshot_path:
                await asyncio.to_thread(self.store.snapshot, self.snapshot_path)
        finally:
            await supervisor.stop()
            await consumer.stop()
            await producer.stop()

    async def _take(self, record: ConsumerRecord) -> None:
        from streams.bus.clients import check_control, dead_letter_for, decode_record

        self.stats.consumed += 1
        topic = _TOPICS[record.topic]
        try:
            with span_from_record("decision-sink", "record." + record.topic.removeprefix("nexuskv."),
                                  record.headers, {"kafka.partition": record.partition,
                                                   "kafka.offset": record.offset}):
                if topic is TRANSFER_RESULTS:
                    env = check_control(self.verifier, topic, record, now=self.clock(), service="decision-sink",
                                        admit=False)
                value = decode_record(topic, record)
                if topic is TRANSFER_RESULTS and env is not None:
                    owner = executor_of(value.destination.worker)
                    if env.producer != owner:
                        METRICS.records_refused.labels("decision-sink", record.topic, "not_owner").inc()
                        raise UnauthenticatedError(f"not_owner: {env.producer[:80]!r} reports a transfer to worker "
                                                   f"{value.destination.worker!r}; only {owner!r} may")
        except NexusKVError as exc:
            METRICS.events_rejected.labels("decision-sink", record.topic).inc()
            assert self._letters is not None
            await self._letters.put(dead_letter_for(record.topic, record, exc, service="decision-sink", now=self.clock()))
            self.stats.dead_lettered += 1
            return
        if isinstance(value, Decision):
            self._decisions.append(value)
        elif isinstance(value, TransferResult):
            self._results.append(value)
        elif isinstance(value, ObservationRecord):
            self._observations.append((value, f"{record.topic}/{record.partition}/{record.offset}"))

    async def _flush(self, consumer: AIOKafkaConsumer) -> None:
        if not self._offsets:
            return
        decisions, results, observations = self._decisions, self._results, self._observations
        self._decisions, self._results, self._observations = [], [], []
        written = await asyncio.to_thread(self.store.write_all, decisions, results, observations)
        for table, n in written.items():
            self.stats.written[table] += n
        if self._letters is not None:
            await self._letters.flush()
        offsets = {tp: OffsetAndMetadata(off, "") for tp, off in self._offsets.items()}
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # written but not committed: a restart re-delivers them, the keys drop the repeats
            log.warning("decision sink: offset commit failed (%s: %s)", type(exc).__name__, exc)
        self._offsets.clear()
        self.stats.flushes += 1


async def _serve(settings: Settings, url: BrokerUrl, stop: asyncio.Event) -> None:
    db = settings.decision_db or Path(settings.data_dir) / "decisions.duckdb"
    store = DecisionStore(db)
    sink = DecisionSink(url, store, snapshot_path=db.with_name(db.stem + "-snapshot.duckdb"))
    try:
        await sink.run(stop)
    finally:
        store.close()
        log.info("decision sink stopped: %s", sink.stats)


def main() -> int:
    settings = Settings.from_env()
    init_service("decision-sink", settings)
    from streams.bus.broker import open_bus

    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        return run_service("decision-sink", lambda stop: _serve(settings, url, stop))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
