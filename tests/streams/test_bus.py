"""The bus end to end: a kv-events batch produced and consumed through a real broker."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import KV_EVENTS, TOPICS
from streams.bus.broker import TansuBroker
from streams.bus.clients import decode_record, make_consumer, make_producer, send
from streams.bus.topics import ensure_topics, list_topics

from tests.factories import kv_batch


async def _round_trip(url) -> KvEventBatch:
    states = await ensure_topics(url, partitions=2)
    assert {s.name for s in states} == {t.name for t in TOPICS}
    assert all(s.partitions >= 1 for s in states)
    again = await ensure_topics(url, partitions=2)  # idempotent
    assert not any(s.created for s in again)
    assert {t.name for t in TOPICS} <= set(await list_topics(url))

    batch = kv_batch(seq=0, publisher=f"pub-{uuid.uuid4().hex[:6]}")
    producer = make_producer(url, client_id="test-producer")
    await producer.start()
    try:
        meta = await send(producer, KV_EVENTS, batch.publisher, batch)
    finally:
        await producer.stop()
    consumer = make_consumer(url, KV_EVENTS, client_id="test-consumer", group_id=f"g-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    try:
        async def first_match():
            async for record in consumer:
                if record.partition == meta.partition and record.offset == meta.offset:
                    return record
        record = await asyncio.wait_for(first_match(), 30)
    finally:
        await consumer.stop()
    assert record.key == batch.publisher.encode()
    return decode_record(KV_EVENTS, record)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.tansu
async def test_embedded_broker_round_trip_and_clean_stop():
    broker = TansuBroker().start()
    pid = broker.pid
    try:
        assert _alive(pid)
        got = await _round_trip(broker.url)
    finally:
        broker.stop()
    assert got.publisher.startswith("pub-") and got.events == kv_batch().events
    assert not _alive(pid), "the embedded broker outlived stop()"
    assert not broker.work_dir.exists()


@pytest.mark.broker
async def test_apache_kafka_round_trip(kafka_url):
    got = await _round_trip(kafka_url)
    assert got.events == kv_batch().events and got.block_operations == 4
