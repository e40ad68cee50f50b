"""Live: a publisher process on real ZMQ sockets, a deliberate gap repaired through replay, a restart
detected, everything forwarded through Apache Kafka."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

from connectors.zmq_events import KvEventSubscriber
from nexuskv.contracts.keyed_events import Cleared, KeyedBatch, KeyedStored, Removed, TierStored, unpack_hashes
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.errors import ContractError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.index import GlobalIndex
from streams.bridge import BridgeConfig, EventBridge
from streams.bus.clients import decode_record, make_consumer, make_producer
from streams.bus.process import free_port
from streams.bus.topics import ensure_topics

from tests.factories import publisher_identity

BLOCK = 4


def _stored(hashes, parent, first_token):
    return {"type": "stored", "hashes": hashes, "parent": parent, "block_size": BLOCK,
            "tokens": list(range(first_token, first_token + BLOCK * len(hashes)))}


SCRIPT_A = [  # seq 0..5; 2 and 3 are buffered but never sent live
    {"events": [_stored([1, 2], None, 0)], "ts": 1.0},
    {"events": [_stored([3], 2, 8)], "ts": 2.0},
    {"events": [_stored([4], 3, 12)], "ts": 3.0, "skip": True},
    {"events": [{"type": "removed", "hashes": [1]}], "ts": 4.0, "skip": True},
    {"events": [_stored([5], 4, 16)], "ts": 5.0},
    {"events": [{"type": "removed", "hashes": [5]}, _stored([6], None, 100)], "ts": 6.0},
]
SCRIPT_B = [  # the restarted engine: seq 0..1
    {"events": [_stored([7, 8], None, 200)], "ts": 10.0},
    {"events": [{"type": "removed", "hashes": [8]}], "ts": 11.0},
]


def _publisher(tmp_path, script, name, endpoints, topic, fmt):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in script))
    pub, replay = endpoints
    proc = subprocess.Popen([sys.executable, "-m", "connectors.zmq_publisher", str(path), "--endpoint", pub,
                             "--replay-endpoint", replay, "--topic", topic, "--format", fmt],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = proc.stdout.readline().split()
    assert ready[0] == "READY", ready
    return proc


def _fold(batches: list[KeyedBatch]) -> dict[tuple[int, str], set[int]]:
    """(incarnation, tier) -> engine hashes present, as a consumer of the topic reconstructs them."""
    state: dict[tuple[int, str], set[int]] = {}
    for b in batches:
        for e in b.events:
            if isinstance(e, Cleared):
                for key in [k for k in state if k[0] == b.incarnation]:
                    state[key].clear()
            elif isinstance(e, (KeyedStored, TierStored)):
                state.setdefault((b.incarnation, e.tier.value), set()).update(unpack_hashes(e.engine_hashes))
            elif isinstance(e, Removed):
                state.setdefault((b.incarnation, e.tier.value), set()).difference_update(unpack_hashes(e.engine_hashes))
    return state


@pytest.mark.broker
@pytest.mark.parametrize("fmt", ["vllm-0.23", "sglang-0.5.23"])  # replies without / with the topic frame
async def test_gap_repaired_restart_detected_through_kafka(kafka_url, tmp_path, fmt):
    engine = fmt.split("-")[0]
    topic = f"kv@pod-{uuid.uuid4().hex[:8]}@sim-model"
    await ensure_topics(kafka_url, partitions=8)
    endpoints = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    bridge = EventBridge(BridgeConfig(engine=engine, identity=publisher_identity(), default_block_size=BLOCK))
    subscriber = KvEventSubscriber(endpoints[0], replay_endpoint=endpoints[1], topic_prefix=topic)
    producer = make_producer(kafka_url, client_id="bridge-test")
    await producer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(subscriber, producer, stop=stop))
    procs = []
    try:
        for name, script in (("a", SCRIPT_A), ("b", SCRIPT_B)):
            proc = _publisher(tmp_path, script, name, endpoints, topic, fmt)
            procs.append(proc)
            await asyncio.sleep(0.5)  # let the SUB connection settle before the first PUB send
            proc.stdin.write("go\n")
            proc.stdin.flush()
            done = await asyncio.to_thread(proc.stdout.readline)
            assert done.startswith("DONE"), done
            expected = sum(1 for _ in script) + (len(SCRIPT_A) if name == "b" else 0)
            for _ in range(100):
                if bridge.stats["forwarded"] >= expected:
                    break
                await asyncio.sleep(0.1)
            proc.stdin.close()
            proc.wait(10)
        assert bridge.stats == {"forwarded": 8, "dead_lettered": 0, "restarts": 1, "block_ops": 11, "unresolved_blocks": 0}
        assert subscriber.stats["gaps"] == 1 and subscriber.stats["replayed"] == 2
        assert subscriber.stats["unrepaired"] == 0 and subscriber.stats["restarts"] == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        subscriber.close()
        await producer.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    consumer = make_consumer(kafka_url, KV_EVENTS, client_id="bridge-test-reader", group_id=f"g-{uuid.uuid4().hex}")
    await consumer.start()
    mine: list[KeyedBatch] = []
    try:
        while len(mine) < 8:
            records = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
            for recs in records.values():
                for record in recs:
                    try:
                        batch = decode_record(KV_EVENTS, record)
                    except ContractError:
                        continue  # malformed records other tests put on the shared topic on purpose
                    if batch.publisher == f"{engine}/{topic.split('@')[1]}/dp0":
                        mine.append(batch)
    finally:
        await consumer.stop()
    incarnations = sorted({b.incarnation for b in mine})
    assert len(incarnations) == 2
    first = [b.seq for b in mine if b.incarnation == incarnations[0]]
    second = [b.seq for b in mine if b.incarnation == incarnations[1]]
    assert first == [0, 1, 2, 3, 4, 5] and second == [0, 1]  # in order, the gap filled by replay
    assert isinstance(next(b for b in mine if b.incarnation == incarnations[1]).events[0], Cleared)
    state = _fold(mine)
    # The publisher's truth: engine A ended with {2, 3, 4, 6}; after the restart only B's {7} exists.
    assert state[(incarnations[0], "gpu")] == {2, 3, 4, 6}
    assert state[(incarnations[1], "gpu")] == {7}

    # The global index fed with the same records equals the restarted engine's truth: its one
    # block, certain; engine A's facts were dropped by the new incarnation's clear.
    index = GlobalIndex()
    for batch in mine:
        index.apply(batch)
    identity = publisher_identity()
    scope = IdentityScope(tenant_namespace=identity.tenant_namespace, model=identity.model,
                          model_revision=identity.model_revision, tokenizer_revision=identity.tokenizer_revision,
                          descriptor_id=identity.descriptor_id)
    truth = {(scope, k) for k in BlockKeyer(scope, BLOCK).keys(list(range(200, 204)))}
    publisher = mine[0].publisher
    assert index.facts() == {(publisher, Tier.GPU, 0): truth}
    assert index.publisher_status(publisher).certain
    hit = index.lookup(scope, BlockKeyer(scope, BLOCK).keys(list(range(200, 208))))
    assert [(m.location.worker, m.prefix_blocks, m.certain) for m in hit.matches] == [(publisher, 1, True)]
