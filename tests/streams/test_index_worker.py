"""The index pipeline on a real Apache Kafka: worker process, SIGKILL recovery, dead letters,
scale-out, replicas and the HTTP lookup endpoint.

The replay slice is the first 160 requests of the Mooncake conversation trace (hash ids expanded
to 16-token blocks; 8 workers with 2,048-block GPU and 3,072-block host LRU caches), about 400
batches and 0.5 M block operations. The reference is the simulation's own cache contents.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import aiohttp
import msgpack
import pytest
from aiohttp import web

from nexuskv.contracts import codec, keyed_events
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS
from nexuskv.edge_keys import EdgeKeyer
from nexuskv.index import GlobalIndex
from streams.bus.clients import make_consumer
from streams.bus.process import free_port
from streams.index_api import make_lookup_app
from streams.index_worker import checkpoint_path, read_checkpoint
from streams.replica import IndexReplica

from benchmarks._attack import (
    PARTITIONS,
    SECRET,
    checkpoints,
    encoded,
    end_offsets,
    names,
    produce,
    restored,
    topics,
    wait_checkpointed,
)
from benchmarks._attack import (
    replay as trace_replay,
)
from benchmarks._attack import worker as start_worker
from benchmarks.trace_events import TraceReplay

pytestmark = pytest.mark.broker


def _encoded_mixed(batches: list[KvEventBatch]) -> list[tuple[bytes, bytes]]:
    """Every other batch as kv-events version 2, keyed by its publisher's edge keyer (the others as
    version 1: old and new publishers side by side; one publisher's batches may switch)."""
    keyers: dict[str, EdgeKeyer] = {}
    out = []
    for i, b in enumerate(batches):
        keyed = keyers.setdefault(b.publisher, EdgeKeyer(SECRET.encode())).key_batch(b)
        out.append((b.publisher.encode(), codec.encode(KV_EVENTS, keyed if i % 2 == 0 else b)))
    return out


@pytest.mark.slow
async def test_replay_through_kafka_then_sigkill_mid_replay_loses_nothing(kafka_url, tmp_path):
    replay, batches = trace_replay()
    truth = replay.resident(SECRET.encode())
    # 1. A clean run.
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    worker = start_worker(kafka_url, tmp_path / "a", topic, group, dead)
    try:
        await produce(kafka_url, topic, encoded(batches))
        ends = await end_offsets(kafka_url, topic)
        index = restored(await wait_checkpointed([tmp_path / "a"], topic, group, ends, [worker]))
    finally:
        worker.stop()
    assert index.facts() == truth
    assert index.stats().unresolved_blocks == 0 and index.stats().uncertain_publishers == 0

    # 2. Again, SIGKILLed mid-replay, then restarted. The kill is placed by what the worker has
    # done, not by the clock (on a loaded machine a fixed delay came after the worker had already
    # checkpointed everything): the second half goes out in chunks, and the worker is killed once a
    # checkpoint shows it applied past the half-way point; the chunks not yet sent then go out
    # while it is dead. So it dies with work in flight whatever the machine's speed, and recovers
    # checkpointed, applied-but-not-checkpointed and never-seen records alike.
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    data = tmp_path / "b"
    worker = start_worker(kafka_url, data, topic, group, dead)
    try:
        half = len(batches) // 2
        await produce(kafka_url, topic, encoded(batches[:half]))
        halfway = await end_offsets(kafka_url, topic)
        deadline = time.monotonic() + 60
        while not checkpoints([data], topic, group) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert checkpoints([data], topic, group), worker.log_tail(40)
        rest = batches[half:]
        chunks = [rest[i:i + max(1, len(rest) // 10)] for i in range(0, len(rest), max(1, len(rest) // 10))]
        sent = 0
        for chunk in chunks[:-2]:  # at least the last two chunks are sent after the kill
            await produce(kafka_url, topic, encoded(chunk))
            sent += 1
            progress = checkpoints([data], topic, group)
            if sum(c.next_offset for c in progress.values()) > sum(halfway.values()):
                break
            await asyncio.sleep(0.2)
        os.killpg(worker.pid, signal.SIGKILL)
        at_kill = checkpoints([data], topic, group)
        worker.stop()
        for chunk in chunks[sent:]:
            await produce(kafka_url, topic, encoded(chunk))
        ends = await end_offsets(kafka_url, topic)
        assert sum(c.next_offset for c in at_kill.values()) < sum(ends.values())
        worker = start_worker(kafka_url, data, topic, group, dead)
        index = restored(await wait_checkpointed([data], topic, group, ends, [worker]))
    finally:
        worker.stop()
    got = index.facts()
    lost = sum(len(truth.get(w, set()) - got.get(w, set())) for w in truth)
    phantom = sum(len(got.get(w, set()) - truth.get(w, set())) for w in got)
    assert (lost, phantom) == (0, 0)
    assert got == truth


def _malformed(valid: bytes, i: int) -> tuple[bytes, str]:
    doc = msgpack.unpackb(valid, raw=False)
    kind = i % 5
    if kind == 0:
        return valid[: max(1, len(valid) // 3)], "truncated"
    if kind == 1:
        doc["seq"] = "seven"
    elif kind == 2:
        doc["events"] = [{"type": "exploded", "engine_hashes": [1]}]
    elif kind == 3:
        doc["events"] = [{"type": "removed", "engine_hashes": list(range(5000))}]
    else:
        doc["schema_version"] = 3
    return msgpack.packb(doc, use_bin_type=True), ("wrong type", "unknown tag", "oversized", "schema version")[kind - 1]


async def test_a_thousand_malformed_payloads_go_to_the_dead_letter_topic_and_valid_ones_apply(kafka_url, tmp_path):
    replay, batches = trace_replay(limit=40)
    truth = replay.resident(SECRET.encode())
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    valid = _encoded_mixed(batches)
    assert sum(keyed_events.is_keyed_payload(v) for _k, v in valid) == (len(valid) + 1) // 2
    templates = [v for _k, v in valid]
    items, bad = [], []
    for i in range(1000):
        payload, _kind = _malformed(templates[i % len(templates)], i)
        bad.append(payload)
        items.append((b"mangled", payload))
        if i % 4 == 0 and valid:
            items.append(valid.pop(0))
    items.extend(valid)
    worker = start_worker(kafka_url, tmp_path, topic, group, dead)
    try:
        await produce(kafka_url, topic, items)
        ends = await end_offsets(kafka_url, topic)
        index = restored(await wait_checkpointed([tmp_path], topic, group, ends, [worker]))
        assert worker.alive()
    finally:
        worker.stop()
    assert index.facts() == truth  # every valid batch applied, in its publisher's order
    letters = []
    consumer = make_consumer(kafka_url, DEAD_LETTER.__class__(dead, "", DeadLetter, "json", ""), client_id="dl-test",
                             group_id=f"dl-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    try:
        deadline = time.monotonic() + 30
        while len(letters) < 1000 and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                letters.extend(DeadLetter.model_validate_json(r.value) for r in records)
    finally:
        await consumer.stop()
    assert len(letters) == 1000
    assert sorted(le.payload for le in letters) == sorted(bad)
    assert all(le.reason and le.source_topic == topic and le.service == "index-worker" for le in letters)
    reasons = " ".join(le.reason for le in letters)
    for word in ("undecodable", "seq", "schema_version", "events"):
        assert word in reasons


@pytest.mark.slow
async def test_two_workers_in_one_group_split_partitions_and_together_answer_as_one(kafka_url, tmp_path):
    replay, batches = trace_replay(limit=100)
    truth = replay.resident(SECRET.encode())
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    dirs = [tmp_path / "w1", tmp_path / "w2"]
    workers = [start_worker(kafka_url, d, topic, group, dead) for d in dirs]
    try:
        await asyncio.sleep(6)  # both join the group before the events arrive
        await produce(kafka_url, topic, encoded(batches))
        ends = await end_offsets(kafka_url, topic)
        best = await wait_checkpointed(dirs, topic, group, ends, workers)
    finally:
        for w in workers:
            w.stop()
    owners = [sum(1 for p in range(PARTITIONS) if read_checkpoint(checkpoint_path(d / "index" / group, topic, p)))
              for d in dirs]
    assert all(owners), f"one worker got no partition: {owners}"
    together = restored(best)
    one = GlobalIndex(secret=SECRET.encode())
    for b in batches:
        one.apply(b)
    assert together.facts() == one.facts() == truth
    scope = replay.scope
    for request in replay.requests[:50]:
        blocks = replay.blocks_of(request)
        tokens = replay.tokens(blocks)
        assert together.lookup_tokens(scope, tokens, 16) == one.lookup_tokens(scope, tokens, 16)


async def test_replica_reads_every_partition_and_serves_the_authenticated_tenant_scoped_endpoint(kafka_url):
    replay, batches = trace_replay(limit=40)
    topic, _group, dead = names()
    await topics(kafka_url, topic, dead)
    await produce(kafka_url, topic, encoded(batches))
    reference = GlobalIndex(secret=SECRET.encode())
    for b in batches:
        reference.apply(b)
    scope = replay.scope
    request = replay.requests[3]
    tokens = replay.tokens(replay.blocks_of(request)).tolist()
    async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic) as replica:
        await replica.wait_caught_up()
        assert replica.index.facts() == reference.facts()
        got = replica.lookup_tokens(scope, tokens, 16)
        assert got == reference.lookup_tokens(scope, tokens, 16) and got.matches
        assert (got.lag_events, got.lag_ms) == (0, 0.0) and replica.lag() == (0, 0.0)

        tok_a, tok_b = "a" * 20, "b" * 20
        port = free_port()
        runner = web.AppRunner(make_lookup_app(replica, {tok_a: scope.tenant_namespace, tok_b: "other-tenant"}))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        closed_port = free_port()
        closed = web.AppRunner(make_lookup_app(replica, {}))
        await closed.setup()
        await web.TCPSite(closed, "127.0.0.1", closed_port).start()
        body = {"scope": {k: getattr(scope, k) for k in ("model", "model_revision", "tokenizer_revision",
                                                          "descriptor_id")}, "token_ids": tokens, "block_size": 16}
        url = f"http://127.0.0.1:{port}/v1/lookup"
        try:
            async with aiohttp.ClientSession() as http:
                for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": tok_a}):
                    async with http.post(url, json=body, headers=headers) as r:
                        assert r.status == 401
                async with http.post(f"http://127.0.0.1:{closed_port}/v1/lookup", json=body,
                                     headers={"Authorization": f"Bearer {tok_a}"}) as r:
                    assert r.status == 401  # no tokens configured: nobody gets an answer
                async with http.post(url, json=body, headers={"Authorization": f"Bearer {tok_a}"}) as r:
                    assert r.status == 200
                    answer = await r.json()
                assert [(m["worker"], m["tier"], m["prefix_blocks"]) for m in answer["matches"]] == [
                    (m.location.worker, m.location.tier.value, m.prefix_blocks) for m in got.matches]
                keys = [format(k, "032x") for k in replay_keys(replay, tokens)]
                async with http.post(url, json={"scope": body["scope"], "keys": keys},
                                     headers={"Authorization": f"Bearer {tok_a}"}) as r:
                    assert (await r.json())["matches"] == answer["matches"]
                # Another tenant's token sees nothing of it, even with the right keys.
                async with http.post(url, json={"scope": body["scope"], "keys": keys},
                                     headers={"Authorization": f"Bearer {tok_b}"}) as r:
                    assert r.status == 200 and (await r.json())["matches"] == []
                forged = {**body, "scope": {**body["scope"], "tenant_namespace": scope.tenant_namespace}}
                async with http.post(url, json=forged, headers={"Authorization": f"Bearer {tok_b}"}) as r:
                    assert r.status == 403
                async with http.post(url, json={"scope": {}}, headers={"Authorization": f"Bearer {tok_a}"}) as r:
                    assert r.status == 400
        finally:
            await runner.cleanup()
            await closed.cleanup()


def replay_keys(replay: TraceReplay, tokens: list[int]) -> list[int]:
    from nexuskv.identity import BlockKeyer

    return BlockKeyer(replay.scope, 16, SECRET.encode()).keys(tokens)
