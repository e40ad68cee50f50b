"""The sink through Apache Kafka: batches in, rows out, once; bad records to the dead-letter topic."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from analytics.store import DecisionStore
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.topics import DEAD_LETTER, DECISIONS, OBSERVATIONS, TRANSFER_RESULTS
from nexuskv.contracts.transfers import TransferResult
from streams.bus.clients import decode_record, make_consumer, make_producer, send
from streams.bus.topics import ensure_topics
from streams.sink import DecisionSink

from tests.analytics.test_store import DISK, GPU, decision, prefill


async def _run_sink(url, store, group, until, max_s: float = 30.0) -> DecisionSink:
    sink = DecisionSink(url, store, group_id=group, flush_interval_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(sink.run(stop))
    for _ in range(int(max_s * 10)):
        if until(sink):
            break
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, 30)
    return sink


@pytest.mark.broker
async def test_sink_writes_each_record_once_and_dead_letters_bad_ones(kafka_url, tmp_path):
    await ensure_topics(kafka_url, partitions=8)
    tag = uuid.uuid4().hex[:8]
    producer = make_producer(kafka_url, client_id="sink-test")
    await producer.start()
    try:
        for i in range(20):
            d = decision(i, Action.TRANSFER if i % 2 else Action.RECOMPUTE, reused=256 * (i % 2), eg=0.1 * (i % 2))
            d = d.model_copy(update={"request_id": f"{tag}-{i}"})
            await send(producer, DECISIONS, d.request_id, d)
            obs, _ = prefill(i, 0.2)
            await send(producer, OBSERVATIONS, "m", obs.model_copy(update={"request_id": d.request_id}))
        result = TransferResult(transfer_id=f"{tag}-x", request_id=f"{tag}-1", status="completed", source=DISK,
                                destination=GPU, started_at=1.0, finished_at=1.2)
        await send(producer, TRANSFER_RESULTS, result.request_id, result)
        await (await producer.send(DECISIONS.name, b'{"schema_version": 1, "request_id": 5}', key=b"bad"))
    finally:
        await producer.stop()

    group = f"sink-{tag}"
    store = DecisionStore(tmp_path / "d.duckdb")
    try:
        first = await _run_sink(kafka_url, store, group,
                                lambda s: s.stats.written["decisions"] >= 20 and s.stats.dead_lettered >= 1)
        mine = f"SELECT count(*) FROM decisions WHERE request_id LIKE '{tag}-%'"
        assert store.query(mine) == [(20,)]
        assert first.stats.dead_lettered >= 1  # ours, and any other test's malformed records on the shared topic
        assert store.query(f"SELECT count(*) FROM request_outcomes WHERE request_id LIKE '{tag}-%' "
                           "AND observed_ttft_s IS NOT NULL") == [(20,)]
        # A second sink in the same group starts after the committed offsets: nothing is written twice.
        second = await _run_sink(kafka_url, store, group, lambda s: s.stats.consumed > 0, max_s=5.0)
        assert store.query(mine) == [(20,)]
        assert second.stats.written["decisions"] == 0
        # A sink in a new group re-reads everything; the primary keys absorb the re-delivery.
        await _run_sink(kafka_url, store, f"{group}-again", lambda s: s.stats.consumed >= 42)
        assert store.query(mine) == [(20,)]
    finally:
        store.close()

    consumer = make_consumer(kafka_url, DEAD_LETTER, client_id="dlq-reader", group_id=f"dlq-{tag}")
    await consumer.start()
    try:
        found = None
        for _ in range(30):
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for rec in recs:
                    letter = decode_record(DEAD_LETTER, rec)
                    assert isinstance(letter, DeadLetter)
                    if letter.source_topic == DECISIONS.name and letter.key == b"bad":
                        found = letter
            if found:
                break
    finally:
        await consumer.stop()
    assert found is not None and "request_id" in found.reason and found.service == "decision-sink"


@pytest.mark.broker
async def test_under_a_bus_secret_the_sink_records_only_the_destination_executors_own_results(kafka_url, tmp_path):
    """The store's transfer outcomes (what Effective Gain analysis joins to decisions) are the
    executors' own: an unsigned, forged, planner-signed result, or one signed by another worker's
    executor, is dead-lettered with its reason and written nowhere; the genuine one is written once."""
    from nexuskv.contracts.control_signature import ControlVerifier

    from tests.streams.test_control_topics import BUS, _codes, _letters, _record, _send, _signer

    await ensure_topics(kafka_url, partitions=8)
    tag = uuid.uuid4().hex[:8]
    rid = f"{tag}-r"

    def result(tid: str) -> TransferResult:
        return TransferResult(transfer_id=f"{tag}-{tid}", request_id=rid, status="completed", source=DISK,
                              destination=GPU, blocks_moved=2, bytes_moved=64, started_at=1.0, finished_at=1.2)

    producer = make_producer(kafka_url, client_id="sink-signed-test")
    await producer.start()
    try:
        await _send(producer, [
            _record(TRANSFER_RESULTS, rid, result("unsigned"), None),
            _record(TRANSFER_RESULTS, rid, result("forged"), _signer("executor/w1", b"y" * 32)),
            _record(TRANSFER_RESULTS, rid, result("planner"), _signer("planner/p")),
            _record(TRANSFER_RESULTS, rid, result("other"), _signer("executor/w2")),  # w2 never ran a w1 transfer
            _record(TRANSFER_RESULTS, rid, result("genuine"), _signer("executor/w1")),
        ])
    finally:
        await producer.stop()

    store = DecisionStore(tmp_path / "d.duckdb")
    try:
        sink = DecisionSink(kafka_url, store, group_id=f"sink-{tag}", flush_interval_s=0.2,
                            verifier=ControlVerifier(BUS))
        stop = asyncio.Event()
        task = asyncio.create_task(sink.run(stop))
        ours = f"SELECT transfer_id FROM transfer_results WHERE transfer_id LIKE '{tag}-%'"
        for _ in range(300):
            if store.query(ours):
                break
            await asyncio.sleep(0.1)
        letters = await _letters(kafka_url, TRANSFER_RESULTS.name, rid.encode(), 4)
        stop.set()
        await asyncio.wait_for(task, 30)
        assert store.query(ours) == [(f"{tag}-genuine",)]
    finally:
        store.close()
    assert _codes(letters) == ["unsigned", "forged", "not_entitled", "not_owner"], [le.reason for le in letters]
    assert all(le.service == "decision-sink" for le in letters)
