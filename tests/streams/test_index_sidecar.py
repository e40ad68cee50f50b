"""The node's index sidecar on a real Apache Kafka: events -> the sidecar's replica -> an engine's ask.

* in process, on a topic of its own: a trace's kv-events published, the sidecar's replica caught
  up, and every engine-side answer (:class:`connectors.index_client.IndexClient` over the Unix
  socket) equal, match for match, to an index that applied the same batches in this process —
  while more batches are still being applied;
* the service as ``nexuskv up`` runs it (``python -m streams.index_sidecar``, the session's
  ``index_sidecar``): ``/livez`` and ``/readyz``, a batch published on ``nexuskv.kv-events``
  answered to engines' asks from many threads; a SIGKILLed sidecar failing the ask closed, fast,
  and a new one on its socket path answering the same client again;
* the service attacked (slowloris connections, a connection flood, oversized frames, asks beyond
  the cap) while an engine keeps asking: every engine ask answered within its budget, every
  refusal on ``/metrics`` by reason, the process alive and ready throughout.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from connectors.index_client import IndexClient
from nexuskv.contracts.kv_events import BlockStored, KvEventBatch, PublisherIdentity
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import known_model
from streams.index_sidecar import IndexSidecar
from streams.replica import IndexReplica

from tests.streams.index_pipeline import SECRET, encoded, names, produce, reference, replay, topics

pytestmark = pytest.mark.broker


async def test_an_engines_ask_answers_what_the_replica_applied_match_for_match(kafka_url):
    r, batches = replay(limit=60, workers=4)
    topic, _group, dead = names()
    await topics(kafka_url, topic, dead)
    first, rest = batches[: len(batches) // 2], batches[len(batches) // 2:]
    await produce(kafka_url, topic, encoded(first))
    with tempfile.TemporaryDirectory(prefix="nkv-", dir="/tmp") as folder:
        path = Path(folder) / "index.sock"
        async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic) as replica:
            sidecar = IndexSidecar(replica, path)
            await sidecar.start()
            try:
                client = IndexClient(path, budget_s=2.0)
                await asyncio.to_thread(client.wait_caught_up, 60)
                one = reference(first)
                queries = [(r.scope, r.tokens(r.blocks_of(q))) for q in r.requests[:60]]
                keyer = BlockKeyer(r.scope, 16, SECRET.encode())
                asked = 0
                for scope, tokens in queries:
                    keys = keyer.keys(tokens)
                    got = await asyncio.to_thread(client.lookup, scope, keys)
                    want = one.lookup(scope, keys)
                    assert got.matches == want.matches and got.num_blocks == len(keys)
                    assert got.lag_ms == 0 and got.lag_events == 0
                    asked += bool(want.matches)
                assert asked >= 10, "the trace's requests should find most of their prefixes"
                # More batches arrive while engines ask: every answer stays valid (no timeout, no
                # malformed answer), and once caught up they equal the full reference again.
                producing = asyncio.create_task(produce(kafka_url, topic, encoded(rest)))
                answered = 0
                while not producing.done():
                    scope, tokens = queries[answered % len(queries)]
                    got = await asyncio.to_thread(client.lookup, scope, keyer.keys(tokens))
                    assert math.isfinite(got.lag_ms)
                    answered += 1
                await producing
                await asyncio.to_thread(client.wait_caught_up, 60)
                full = reference(batches)
                for scope, tokens in queries:
                    keys = keyer.keys(tokens)
                    assert (await asyncio.to_thread(client.lookup, scope, keys)).matches == full.lookup(scope,
                                                                                                         keys).matches
                assert client.stats["timeouts"] == client.stats["malformed"] == client.stats["unavailable"] == 0
                assert sidecar.lookups == client.stats["answered"] and answered > 0
            finally:
                await sidecar.close()


def _batch(tenant: str, tokens: list[int]) -> tuple[KvEventBatch, IdentityScope]:
    d = known_model("meta-llama/Llama-3.1-8B", tenant_namespace=tenant)
    identity = PublisherIdentity(tenant_namespace=d.tenant_namespace, model=d.model, model_revision=d.model_revision,
                                 tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id)
    batch = KvEventBatch(publisher=f"vllm/{tenant}/dp0", incarnation=1, seq=0, ts=time.time(), identity=identity,
                         events=(BlockStored(engine_hashes=tuple(range(1, len(tokens) // 16 + 1)), parent=None,
                                             token_ids=tuple(tokens), block_size=16),))
    return batch, IdentityScope.of(d)


async def test_the_sidecar_service_is_ready_and_answers_many_engine_threads(kafka_url, index_sidecar):
    status, body = index_sidecar.readyz()
    assert status == 200, body
    tenant = f"sidecar-{uuid.uuid4().hex[:8]}"
    tokens = [(i * 31) % 50_000 for i in range(16 * 8)]
    batch, scope = _batch(tenant, tokens)
    await produce(kafka_url, KV_EVENTS.name, encoded([batch]))
    client = IndexClient(index_sidecar.socket, budget_s=1.0, backoff_s=0.0)
    await asyncio.to_thread(client.wait_caught_up, 60)
    keys = BlockKeyer(scope, 16).keys(tokens)
    got = await asyncio.to_thread(client.lookup, scope, keys)
    assert [(m.publisher, m.prefix_blocks, m.certain) for m in got.matches] == [(batch.publisher, 8, True)]
    # Many engine processes' threads at once: all answered.
    results: list = []

    def ask() -> None:
        mine = IndexClient(index_sidecar.socket, budget_s=1.0)
        results.extend(mine.lookup(scope, keys) for _ in range(25))
        mine.close()

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        await asyncio.to_thread(t.join)
    assert len(results) == 100 and all(r.matches == got.matches for r in results)


def test_the_service_bounds_hostile_clients_while_an_engine_keeps_asking(kafka_url, tmp_path):
    import socket
    import struct
    import urllib.request

    from nexuskv.contracts.lookup_wire import OP_LOOKUP, VERSION, Ask, encode_ask, wire_scope

    from tests.sidecar import start_sidecar

    asyncio.run(topics_default(kafka_url))
    sidecar = start_sidecar(kafka_url, tmp_path / "attacked", env={
        "NEXUSKV_INDEX_MAX_CONNECTIONS": "24", "NEXUSKV_INDEX_FRAME_DEADLINE_MS": "300",
        "NEXUSKV_INDEX_MAX_ASK_KEYS": "1024"})
    try:
        tenant = f"sidecar-attack-{uuid.uuid4().hex[:8]}"
        tokens = [(i * 13) % 50_000 for i in range(16 * 6)]
        batch, scope = _batch(tenant, tokens)
        asyncio.run(produce(kafka_url, KV_EVENTS.name, encoded([batch])))
        client = IndexClient(sidecar.socket, budget_s=0.5, backoff_s=0.0, max_keys=1024)
        client.wait_caught_up(60)
        keys = BlockKeyer(scope, 16).keys(tokens)
        want = client.lookup(scope, keys).matches
        assert want

        def connect() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sidecar.socket))
            return s

        slow = [connect() for _ in range(10)]
        for s in slow:  # a frame begun and never finished
            s.sendall(encode_ask(Ask(VERSION, OP_LOOKUP, 1, wire_scope(scope), bytes(16 * 512)))[:100])
        big = connect()
        big.sendall(struct.pack(">I", 4 << 20))  # an ask's frame far beyond 1,024 keys
        over = connect()
        over.sendall(encode_ask(Ask(VERSION, OP_LOOKUP, 5, wire_scope(scope), bytes(16 * 1025))))
        flood = []
        for _ in range(40):  # more connections than the cap
            try:
                flood.append(connect())
            except OSError:
                break
        answers = [client.lookup(scope, keys) for _ in range(50)]
        time.sleep(0.5)  # past the frame deadline
        answers += [client.lookup(scope, keys) for _ in range(50)]
        assert all(a.matches == want for a in answers), client.stats
        assert client.stats["timeouts"] == client.stats["refused"] == client.stats["unavailable"] == 0
        assert client.lookup(scope, bytes(16 * 2000)).num_blocks == 2000 and client.stats["trimmed"] == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()

        def refused(reason: str) -> float:
            line = next((x for x in metrics.splitlines()
                         if x.startswith(f'nexuskv_index_ask_refusals_total{{reason="{reason}"}}')), None)
            return float(line.split()[-1]) if line else 0.0

        assert refused("frame_deadline") >= 10 and refused("connections") >= 1
        assert refused("frame_size") == 1 and refused("too_many_keys") == 1
        assert sidecar.process.alive() and sidecar.readyz()[0] == 200
        for s in slow + flood + [big, over]:
            s.close()
    finally:
        sidecar.stop()


@pytest.mark.slow
def test_a_killed_sidecar_fails_the_ask_closed_and_its_restart_answers_again(kafka_url, tmp_path):
    from tests.sidecar import start_sidecar

    asyncio.run(topics_default(kafka_url))
    sidecar = start_sidecar(kafka_url, tmp_path / "a")
    client = IndexClient(sidecar.socket, budget_s=0.5, backoff_s=0.0)
    tenant = f"sidecar-kill-{uuid.uuid4().hex[:8]}"
    tokens = [(i * 17) % 50_000 for i in range(16 * 4)]
    batch, scope = _batch(tenant, tokens)
    asyncio.run(produce(kafka_url, KV_EVENTS.name, encoded([batch])))
    client.wait_caught_up(60)
    keys = BlockKeyer(scope, 16).keys(tokens)
    assert client.lookup(scope, keys).matches
    import os
    import signal

    os.kill(sidecar.process.pid, signal.SIGKILL)
    time.sleep(0.3)
    began = time.perf_counter()
    got = client.lookup(scope, keys)
    assert got.matches == () and math.isinf(got.lag_ms) and time.perf_counter() - began < 0.5
    assert client.stats["unavailable"] == 1
    folder = Path(tempfile.mkdtemp(prefix="nkv-", dir="/tmp"))
    again = start_sidecar(kafka_url, tmp_path / "b", socket=folder / "index.sock")
    try:
        # The killed one's socket file is still there: a new sidecar on its path takes it over.
        sidecar.process.stop()
        old = sidecar.socket
        again.stop()
        again = start_sidecar(kafka_url, tmp_path / "c", socket=old)
        client.wait_caught_up(60)
        assert client.lookup(scope, keys).matches  # the same client, a new connection
        assert client.stats["answered"] == 2
    finally:
        again.stop()
        sidecar.stop()


async def topics_default(url) -> None:
    from streams.bus.topics import ensure_topics

    await ensure_topics(url, partitions=8)
