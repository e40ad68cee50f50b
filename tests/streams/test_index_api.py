"""The HTTP lookup endpoint attacked, on a replica fed by a real Apache Kafka: hostile bodies get a
4xx (never a 500), caller-chosen block sizes cost nothing lasting, and no tenant sees another's
blocks."""

from __future__ import annotations

import gc

import aiohttp
import pytest
from aiohttp import web

from nexuskv.identity import BlockKeyer
from streams.bus.process import free_port
from streams.index_api import make_lookup_app
from streams.replica import KEYER_CACHE, IndexReplica

from tests.streams.index_pipeline import SECRET, encoded, names, produce, replay, topics

pytestmark = pytest.mark.broker
TOKEN_A, TOKEN_B = "a" * 24, "b" * 24


class _Endpoint:
    def __init__(self, replica, tokens):
        self.replica, self.tokens = replica, tokens

    async def __aenter__(self):
        self.runner = web.AppRunner(make_lookup_app(self.replica, self.tokens))
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.http.close()
        await self.runner.cleanup()

    async def post(self, body: bytes | dict, token: str = TOKEN_A) -> tuple[int, dict]:
        kw = {"json": body} if isinstance(body, dict) else {"data": body, "headers": {"Content-Type": "application/json"}}
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        async with self.http.post(f"http://127.0.0.1:{self.port}/v1/lookup", headers=headers, **kw) as r:
            try:
                return r.status, await r.json()
            except (aiohttp.ContentTypeError, ValueError):
                return r.status, {}


async def _replica_with_trace(kafka_url):
    r, batches = replay(limit=30, workers=2)
    topic, _g, dead = names()
    await topics(kafka_url, topic, dead)
    await produce(kafka_url, topic, encoded(batches))
    replica = IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic)
    await replica.start()
    await replica.wait_caught_up()
    return r, replica


def _scope_body(scope) -> dict:
    return {k: getattr(scope, k) for k in ("model", "model_revision", "tokenizer_revision", "descriptor_id")}


async def test_hostile_bodies_get_a_4xx_never_a_500(kafka_url):
    # Defect 9 and its relatives: nothing a caller sends makes the endpoint fail.
    r, replica = await _replica_with_trace(kafka_url)
    scope = _scope_body(r.scope)
    hostile: list[bytes | dict] = [
        b"[" * 100_000,                                        # nested deeper than the parser recurses
        b'{"scope": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_001,
        b'{"scope": {}, "keys": ' + b"[" * 50 + b"]" * 50 + b"}",  # valid JSON, nested beyond any body
        b"\xff\xfe not json", b"", b"null", b"[]", b'"scope"',
        {"scope": "acme"}, {"scope": scope}, {"scope": scope, "keys": "00"}, {"scope": scope, "keys": [1, 2]},
        {"scope": scope, "keys": ["zz" * 16]}, {"scope": scope, "keys": [["00"]]},
        {"scope": scope, "token_ids": [1, 2], "block_size": True},
        {"scope": scope, "token_ids": [1, 2], "block_size": 1 << 40},
        {"scope": scope, "token_ids": [1, 2], "block_size": -3},
        {"scope": scope, "token_ids": ["x"] * 32, "block_size": 16},
        {"scope": scope, "token_ids": [-1] * 32, "block_size": 16},
        {"scope": scope, "token_ids": [1 << 40] * 32, "block_size": 16},
        {"scope": {**scope, "lora": ["x"]}, "token_ids": [1] * 32, "block_size": 16},
        {"scope": {**scope, "model": ""}, "token_ids": [1] * 32, "block_size": 16},
    ]
    try:
        async with _Endpoint(replica, {TOKEN_A: r.scope.tenant_namespace}) as api:
            statuses = [(await api.post(body))[0] for body in hostile]
            status, _ = await api.post({"scope": scope, "token_ids": [1] * 32, "block_size": 16})
    finally:
        await replica.stop()
    assert status == 200
    assert [s for s in statuses if s >= 500] == [], statuses
    assert all(400 <= s < 500 for s in statuses), statuses


async def test_distinct_block_sizes_cost_nothing_lasting_and_tenants_stay_apart(kafka_url):
    # Defect 10, the endpoint's side: every request names a block size of its own.
    r, replica = await _replica_with_trace(kafka_url)
    request = r.requests[2]
    tokens = r.tokens(r.blocks_of(request)).tolist()
    keys = [format(k, "032x") for k in BlockKeyer(r.scope, 16, SECRET.encode()).keys(tokens)]
    scope = _scope_body(r.scope)
    try:
        async with _Endpoint(replica, {TOKEN_A: r.scope.tenant_namespace, TOKEN_B: "another-tenant"}) as api:
            status, mine = await api.post({"scope": scope, "token_ids": tokens, "block_size": 16})
            assert status == 200 and mine["matches"]
            gc.collect()
            before = sum(type(o) is BlockKeyer for o in gc.get_objects())
            for size in range(17, 17 + 3000):
                status, _ = await api.post({"scope": scope, "token_ids": tokens[:size], "block_size": size})
                assert status == 200
            gc.collect()
            after = sum(type(o) is BlockKeyer for o in gc.get_objects())
            # Another tenant's token, with the first tenant's token ids or its very keys: nothing.
            cross = [await api.post({"scope": scope, "token_ids": tokens, "block_size": 16}, TOKEN_B),
                     await api.post({"scope": scope, "keys": keys}, TOKEN_B)]
    finally:
        await replica.stop()
    assert after - before <= KEYER_CACHE, f"{after - before} keyers kept after 3,000 block sizes"
    assert [(s, body["matches"]) for s, body in cross] == [(200, []), (200, [])]
