"""The bus side of the reference engine's publisher seam.

:class:`~nexuskv.reference_engine.engine.ReferenceEngine` is synchronous and imports no Kafka; it calls
``publisher(record)``. :class:`BusPublisher` is that callable: it keeps the records in order and
:meth:`BusPublisher.flush` sends them (``nexuskv.kv-events`` and ``nexuskv.observations``, keyed
by :func:`streams.bus.topic_keys.route`), returning once the broker acknowledged each. Flush after each
engine step, as an engine's event publisher drains its queue.
"""

from __future__ import annotations

import threading

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from nexuskv.reference_engine.events import Record
from streams.bus.clients import send
from streams.bus.topic_keys import route

__all__ = ["BusPublisher"]


class BusPublisher:
    """Collects a runtime's records; ``await flush()`` publishes them in order."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._pending: list[Record] = []
        self._lock = threading.Lock()
        self.sent = 0

    def __call__(self, record: Record) -> None:
        route(record)  # an unroutable record fails here, in the runtime's call, not later
        with self._lock:
            self._pending.append(record)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    async def flush(self) -> list[RecordMetadata]:
        with self._lock:
            records, self._pending = self._pending, []
        acks = []
        for i, record in enumerate(records):
            topic, key = route(record)
            try:
                acks.append(await send(self.producer, topic, key, record))
            except BaseException:
                with self._lock:  # keep what was not sent, in order, for the next flush
                    self._pending[:0] = records[i:]
                raise
        self.sent += len(acks)
        return acks
