"""A replica's lag is honest: unknown (never 0) until it has fetched, and readiness means caught up
to the end offsets it found at start.

* unit: before a fetch of every partition (aiokafka's high watermark unset) ``lag()`` is
  ``(None, inf)`` and a lookup carries infinite ``lag_ms`` and at least one event behind, however
  far the apply has gone; after the fetch, the watermark decides;
* on a real Apache Kafka: a replica started on a backlog, asked through the node's sidecar and
  its health sampled while it catches up — no answer says "0 behind", and neither the health nor
  the lookup API's ``/healthz`` says ready or caught up, before it has applied the log as it was
  at start; afterwards both do.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiokafka import TopicPartition

from connectors.index_client import IndexClient
from nexuskv.identity import BlockKeyer
from streams.bus.health import Health
from streams.bus.process import free_port
from streams.index_api import make_lookup_app
from streams.index_sidecar import IndexSidecar
from streams.replica import IndexReplica, report_readiness

from tests.factories import scope
from tests.streams.index_pipeline import SECRET, encoded, names, produce, replay, topics


class _Watermarks:
    """What the replica reads of its consumer: each partition's high watermark (None: not fetched)."""

    def __init__(self, highs: dict[int, int | None]) -> None:
        self.highs = highs

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.highs[tp.partition]


def _replica(highs: dict[int, int | None], applied: dict[int, int], start: dict[int, int]) -> IndexReplica:
    replica = IndexReplica("kafka://127.0.0.1:1", topic="lag-unit", bus_secret=b"", clock=lambda: 100.0)
    replica._tps = [TopicPartition("lag-unit", p) for p in sorted(highs)]
    replica._next = dict(applied)
    replica.start_offsets = dict(start)
    replica._consumer = _Watermarks(highs)  # type: ignore[assignment]
    return replica


def test_lag_is_unknown_until_every_partition_was_fetched():
    replica = IndexReplica("kafka://127.0.0.1:1", topic="lag-unit", bus_secret=b"")
    assert replica.lag() == (None, math.inf) and not replica.caught_up()  # not started
    replica = _replica({0: None, 1: None}, {0: 0, 1: 0}, {0: 0, 1: 0})
    assert replica.lag() == (None, math.inf)  # an empty log at start, but nothing fetched yet
    assert replica.caught_up()  # readiness: applied to the end found at start (nothing)
    got = replica.lookup(scope("t-lag"), [1, 2, 3])
    assert got.lag_events == 1 and math.isinf(got.lag_ms)
    replica = _replica({0: 40, 1: None}, {0: 40, 1: 3}, {0: 30, 1: 10})
    assert replica.lag() == (None, math.inf) and not replica.caught_up() and replica.behind_start() == 7
    got = replica.lookup(scope("t-lag"), [1])
    assert got.lag_events == 7 and math.isinf(got.lag_ms)  # a lower bound: the end found at start
    replica._consumer.highs[1] = 12  # the first fetch of partition 1
    replica._last_ts_ms = {1: 99_000.0}
    assert replica.lag() == (9, 1000.0) and not replica.caught_up()
    replica._next[1] = 12
    assert replica.lag() == (0, 0.0) and replica.caught_up() and replica.behind_start() == 0
    got = replica.lookup(scope("t-lag"), [1])
    assert (got.lag_events, got.lag_ms) == (0, 0.0)


@pytest.mark.broker
async def test_a_replica_is_never_ready_or_caught_up_while_behind_the_log_found_at_start(kafka_url):
    r, batches = replay(limit=400, workers=4)
    topic, _group, dead = names()
    await topics(kafka_url, topic, dead)
    await produce(kafka_url, topic, encoded(batches))
    keyer = BlockKeyer(r.scope, 16, SECRET.encode())
    keys = [keyer.keys(r.tokens(r.blocks_of(q))) for q in r.requests[:40]]
    health = Health()
    replica = IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic, slice_s=0.0005)
    with tempfile.TemporaryDirectory(prefix="nkv-", dir="/tmp") as folder:
        path = Path(folder) / "index.sock"
        await replica.start()
        readiness = asyncio.create_task(report_readiness(replica, health=health, interval_s=0.005))
        sidecar = IndexSidecar(replica, path)
        await sidecar.start()
        runner = web.AppRunner(make_lookup_app(replica, {"t" * 24: r.scope.tenant_namespace}))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        http = aiohttp.ClientSession()
        client = IndexClient(path, budget_s=2.0, backoff_s=0.0)
        try:
            behind = answered_behind = 0
            while True:
                done = replica.caught_up()
                got = await asyncio.to_thread(client.lookup, r.scope, keys[behind % len(keys)])
                ready, why = health.ready()
                async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    status, body = resp.status, await resp.json()
                now = replica.caught_up()
                if done:
                    break
                behind += 1
                if not now:  # still behind after every sample: none may say otherwise
                    assert not ready and why.startswith("replica: catching up"), why
                    assert got.lag_events >= 1 and got.lag_ms != 0
                    assert status == 503 and body["ok"] is False and body["ready"] is False
                    assert body["caught_up"] is False and body["lag_events"] != 0
                    answered_behind += 1
            assert answered_behind >= 3, "the backlog should take several asks to apply"
            await asyncio.to_thread(client.wait_caught_up, 60)
            for _ in range(200):  # the readiness task looks every 5 ms
                if health.ready()[0]:
                    break
                await asyncio.sleep(0.01)
            assert health.ready() == (True, "ready")
            got = await asyncio.to_thread(client.lookup, r.scope, keys[0])
            assert (got.lag_events, got.lag_ms) == (0, 0.0) and got.matches
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200
                assert await resp.json() == {"ok": True, "ready": True, "caught_up": True, "lag_events": 0,
                                             "lag_ms": 0.0}
        finally:
            readiness.cancel()
            await http.close()
            await runner.cleanup()
            await sidecar.close()
            await replica.stop()
