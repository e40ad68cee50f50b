"""aiokafka producers and consumers that speak NexusKV's topic contracts.

Every record on a NexusKV topic is a versioned contract encoded by :mod:`nexuskv.contracts.codec`;
keys are UTF-8 strings; headers carry the sender's trace context (:mod:`streams.telemetry`). A consumer that cannot decode a record builds a :class:`DeadLetter` for
it (:func:`dead_letter_for`) instead of dropping or crashing.

Client settings that decide start-up and rebalance latency live in :mod:`streams.tuning`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, RecordMetadata

from nexuskv.config import BrokerUrl
from nexuskv.contracts import codec
from nexuskv.contracts.base import Contract
from nexuskv.contracts.dead_letter import MAX_PAYLOAD, DeadLetter
from nexuskv.contracts.topics import DEAD_LETTER, Topic
from nexuskv.errors import NexusKVError
from streams import tuning
from streams.telemetry import carrier_headers

__all__ = ["make_producer", "make_consumer", "send", "decode_record", "dead_letter_for", "send_dead_letter"]

Headers = Sequence[tuple[str, bytes]]


def make_producer(url: BrokerUrl, *, client_id: str, **overrides: Any) -> AIOKafkaProducer:
    """A producer (not started). Idempotence stays off: the embedded broker rejects it."""
    settings = dict(tuning.PRODUCER)
    settings.update(overrides)
    return AIOKafkaProducer(bootstrap_servers=url.bootstrap_servers, client_id=client_id, **settings)


def make_consumer(url: BrokerUrl, *topics: Topic, client_id: str, group_id: str | None = None,
                  **overrides: Any) -> AIOKafkaConsumer:
    """A consumer (not started) of ``topics``; in a group when ``group_id`` is given."""
    settings = dict(tuning.CONSUMER)
    settings.update(overrides)
    return AIOKafkaConsumer(*(t.name for t in topics), bootstrap_servers=url.bootstrap_servers,
                            client_id=client_id, group_id=group_id, **settings)


async def send(producer: AIOKafkaProducer, topic: Topic, key: str, value: Contract,
               headers: Headers | None = None) -> RecordMetadata:
    """Encode and send, carrying the current trace context; returns once the broker acknowledged."""
    fut = await producer.send(topic.name, codec.encode(topic, value), key=key.encode("utf-8"),
                              headers=carrier_headers(headers) or None)
    return await fut


def decode_record(topic: Topic, record: ConsumerRecord) -> Contract:
    """The record's value as ``topic``'s contract; raises ContractError with the reason."""
    return codec.decode(topic, record.value)


def dead_letter_for(topic_name: str, record: ConsumerRecord | None, error: BaseException, *, service: str,
                    now: float, payload: bytes | None = None, key: bytes | None = None) -> DeadLetter:
    """A dead-letter record for a rejected input, keeping up to MAX_PAYLOAD bytes of it."""
    raw = payload if payload is not None else (record.value if record is not None else b"") or b""
    raw_key = key if key is not None else (record.key if record is not None else None)
    reason = str(error) or type(error).__name__
    return DeadLetter(
        source_topic=topic_name,
        partition=record.partition if record is not None else -1,
        offset=record.offset if record is not None else -1,
        key=bytes(raw_key) if raw_key is not None else None,
        payload=bytes(raw[:MAX_PAYLOAD]),
        payload_size=len(raw),
        reason=reason[:4096],
        error_type=type(error).__name__ if isinstance(error, NexusKVError) else f"unexpected:{type(error).__name__}",
        service=service,
        rejected_at=now,
    )


async def send_dead_letter(producer: AIOKafkaProducer, letter: DeadLetter) -> RecordMetadata:
    return await send(producer, DEAD_LETTER, letter.source_topic, letter)
