"""The bridge's pipelined sends (``streams.bridge``: a bounded window, the idempotent producer), with
SGLang 0.5.23's own publisher and Apache Kafka: a burst arrives once each, in order, with records
in flight; a full window waits (counted); the state file keeps only acknowledged progress, which a
restarted bridge resumes from. Gap repair through the window: ``test_events_bridge.py``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from nexuskv.contracts.keyed_events import Cleared, KeyedStored, unpack_hashes
from streams.bridge import BridgeConfig, EventBridge

from tests.connectors.sglang_real.events import Line

pytestmark = pytest.mark.broker
PAGE = 4


def _batch(kv, rng: random.Random):
    hashes = [rng.randrange(0, 1 << 63) for _ in range(rng.randint(1, 4))]
    return [kv.BlockStored(block_hashes=hashes, parent_block_hash=None,
                           token_ids=[rng.randrange(1, 150_000) for _ in range(PAGE * len(hashes))],
                           block_size=PAGE, lora_id=None, medium="GPU")]


async def _burst(line: Line, n: int, seed: int) -> list[list]:
    from sglang.srt.disaggregation import kv_events as kv

    publisher = line.publisher()
    rng = random.Random(seed)
    sent = []
    try:
        await line.start_bridge()
        await asyncio.sleep(0.3)
        for _ in range(n):
            events = _batch(kv, rng)
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
            sent.append(events)
        await line.wait_forwarded(n, timeout=120)
        await line.stop_bridge()
    finally:
        publisher.shutdown()
    return sent


async def test_a_burst_goes_out_pipelined_once_each_in_order(kafka_url, tmp_path):
    line = Line(kafka_url, tmp_path, page=PAGE, window=16)
    try:
        sent = await _burst(line, 1500, seed=1)
        assert line.bridge.stats["forwarded"] == 1500 and line.bridge.stats["dead_lettered"] == 0
        stats = line.bridge.window_stats
        assert 1 < stats["in_flight_max"] <= 16, stats  # records were in flight together, never more than the window
        assert stats["window_full"] > 0, stats  # the burst outran the acknowledgements: the bridge waited
        assert line._producer._txn_manager is not None  # the idempotent producer (Kafka gave it a producer id)
        assert line._producer._txn_manager.producer_id >= 0
        received = await line.read(1500)
        assert [b.seq for b in received] == list(range(1500))  # once each, in order on the publisher's partition
        assert len({b.incarnation for b in received}) == 1 and isinstance(received[0].events[0], Cleared)
        for batch, events in zip(received, sent):
            stored = [e for e in batch.events if isinstance(e, KeyedStored)]
            assert [unpack_hashes(e.engine_hashes) for e in stored] == [list(events[0].block_hashes)]

        # The state file holds what the broker acknowledged; a restarted bridge resumes there.
        state = json.loads(line.state_file.read_text())["publishers"][line.topic]
        assert state == {"next_seq": 1500, "incarnation": received[0].incarnation}
        assert line.bridge.acknowledged_points() == line.bridge.resume_points() == {line.topic: 1500}
        again = EventBridge(BridgeConfig(engine="sglang", identity=line.identity, name=line.pod,
                                         default_block_size=PAGE, state_file=line.state_file))
        assert again.resume_points() == {line.topic: 1500}
    finally:
        await line.close()


async def test_window_one_is_one_acknowledgement_at_a_time(kafka_url, tmp_path):
    """The former send (the benchmark's baseline): every record acknowledged before the next is sent."""
    line = Line(kafka_url, tmp_path, page=PAGE, window=1)
    try:
        await _burst(line, 200, seed=2)
        assert line.bridge.stats["forwarded"] == 200
        stats = line.bridge.window_stats
        assert stats["in_flight_max"] == 1 and stats["window_full"] == 0, stats
        assert [b.seq for b in await line.read(200)] == list(range(200))
    finally:
        await line.close()


async def test_a_stop_during_a_repair_is_prompt_and_loses_nothing(kafka_url, tmp_path):
    """A repair hands the bridge hundreds of batches at once; a stop takes effect between two of
    them (not after the whole repair), and the next run sends the rest, in order."""
    from sglang.srt.disaggregation import kv_events as kv

    line = Line(kafka_url, tmp_path, page=PAGE, window=1)
    publisher = line.publisher()
    rng = random.Random(3)
    try:
        for _ in range(600):  # before the bridge listens: SGLang buffers them for replay
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=_batch(kv, rng)))
        await asyncio.sleep(1.0)
        await line.start_bridge()
        await asyncio.sleep(0.5)
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=_batch(kv, rng)))  # the repair starts
        await line.wait_forwarded(20)
        started = time.monotonic()
        line._stop.set()  # the bridge stops; its subscriber stays (as in a restart of run())
        await asyncio.wait_for(line._task, 30)
        assert time.monotonic() - started < 5
        assert line.bridge.stats["forwarded"] < 601 and line.bridge.in_flight == 0
        state = json.loads(line.state_file.read_text())["publishers"][line.topic]
        assert state["next_seq"] == line.bridge.stats["forwarded"]  # acknowledged progress only
        line._stop = asyncio.Event()
        line._task = asyncio.create_task(line.bridge.run(line.subscriber, line._producer, stop=line._stop))
        await line.wait_forwarded(601, timeout=120)
        assert [b.seq for b in await line.read(601)] == list(range(601))
    finally:
        publisher.shutdown()
        await line.close()


async def test_a_batch_that_cannot_be_keyed_goes_to_the_dead_letter_topic_through_the_window(kafka_url, tmp_path):
    """A batch with a medium the bridge cannot map is dead-lettered with its reason, in the same
    window as the batches around it; they arrive in order, its number missing (the index sees the gap)."""
    import uuid

    from sglang.srt.disaggregation import kv_events as kv

    from nexuskv.contracts.dead_letter import DeadLetter
    from nexuskv.contracts.topics import DEAD_LETTER
    from streams.bus.clients import decode_record, make_consumer

    line = Line(kafka_url, tmp_path, page=PAGE, window=8)
    publisher = line.publisher()
    rng = random.Random(4)
    try:
        await line.start_bridge()
        await asyncio.sleep(0.3)
        for i in range(40):
            events = _batch(kv, rng)
            if i == 17:
                events[0].medium = "NVME-OF"
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        await line.wait_forwarded(40)
        assert line.bridge.stats["forwarded"] == 39 and line.bridge.stats["dead_lettered"] == 1
        assert [b.seq for b in await line.read(39)] == [s for s in range(40) if s != 17]
        consumer = make_consumer(kafka_url, DEAD_LETTER, client_id="dl-reader", group_id=f"g-{uuid.uuid4().hex}")
        await consumer.start()
        try:
            mine: list[DeadLetter] = []
            deadline = time.monotonic() + 30
            while not mine and time.monotonic() < deadline:
                for recs in (await consumer.getmany(timeout_ms=500)).values():
                    for record in recs:
                        letter = decode_record(DEAD_LETTER, record)
                        if letter.source_topic == f"zmq:{line.topic}":
                            mine.append(letter)
            assert len(mine) == 1 and "unknown medium 'NVME-OF'" in mine[0].reason and mine[0].service == "kv-bridge"
        finally:
            await consumer.stop()
    finally:
        publisher.shutdown()
        await line.close()
