"""The router on the real bus: an index replica of nexuskv.kv-events, route hints of nexuskv.placement,
and its HTTP endpoint."""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import pytest

from connectors.descriptors import publisher_identity
from nexuskv.contracts.kv_events import BlockStored, KvEventBatch
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.topics import KV_EVENTS, PLACEMENT
from nexuskv.models import known_model
from streams.bus.clients import make_producer, send
from streams.bus.process import free_port
from streams.bus.topics import ensure_topics
from streams.router_service import RouterService

pytestmark = pytest.mark.broker


async def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_routes_to_state_and_follows_route_hints(kafka_url):
    await ensure_topics(kafka_url, partitions=8)
    tenant = f"router-{uuid.uuid4().hex[:8]}"
    descriptor = known_model("meta-llama/Llama-3.1-8B", tenant_namespace=tenant)
    a, b = f"vllm/{tenant}-a/dp0", f"vllm/{tenant}-b/dp0"
    tokens = [(i * 37) % 32_000 for i in range(2048)]
    port = free_port()
    service = RouterService(kafka_url, descriptor, policy="nexuskv", port=port, workers=[a, b])
    await service.start()
    producer = make_producer(kafka_url, client_id="router-test")
    await producer.start()
    try:
        stored = BlockStored(engine_hashes=tuple(range(1, 129)), token_ids=tuple(tokens), block_size=16)
        batch = KvEventBatch(publisher=a, incarnation=1, seq=0, ts=time.time(), identity=publisher_identity(descriptor),
                             events=(stored,))
        await send(producer, KV_EVENTS, a, batch)
        hint = PlacementHint(hint_id="r-hinted/h0", request_id="r-hinted", tenant_namespace=tenant,
                             kind=HintKind.ROUTE, worker=b, issued_at=time.time(), reason="the planner service chose b")
        await send(producer, PLACEMENT, f"{tenant}/0", hint)
        await service.replica.wait_caught_up()
        await _until(lambda: len(service.hints) >= 1)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/route", json={"request_id": "r-1", "token_ids": tokens}) as resp:
                assert resp.status == 200
                body = await resp.json()
            assert body["worker"] == a and body["source"] == "policy" and body["policy"] == "nexuskv"
            assert body["action"] in ("full_reuse", "partial_reuse") and body["reused_tokens"] >= 2032
            assert body["local_tokens"] == 2048 and body["predicted_ttft_s"] > 0
            async with http.post(f"{url}/v1/route", json={
                    "request_id": "r-hinted", "token_ids": tokens,
                    "candidates": [{"worker": a}, {"worker": b, "queued_prefill_tokens": 100}]}) as resp:
                body = await resp.json()
            assert body["worker"] == b and body["source"] == "placement" and body["local_tokens"] == 0
            async with http.post(f"{url}/v1/route", json={"request_id": "r-2"}) as resp:
                assert resp.status == 400 and "token_ids" in (await resp.json())["error"]
            async with http.get(f"{url}/healthz") as resp:
                health = await resp.json()
            assert health["ok"] and health["route_hints"] >= 1
    finally:
        await producer.stop()
        await service.stop()
