"""vLLM's scheduler gauges as the replay's router reads them (:mod:`connectors.engine_load`).

The scrapes are written by prometheus_client — the exposition encoder vLLM's server uses — with
vLLM's metric names and labels (``vllm/v1/metrics/loggers.py``); the real engine's ``/metrics`` is
read in ``tests/engines/vllm/test_replay_skewed.py``.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from connectors.engine_load import EngineLoad, EngineLoadPoller, parse_vllm_metrics
from nexuskv.errors import ContractError
from streams.app.replay.routing import Loads


def _scrape(ranks: list[tuple[int, int, float]], *, stats: bool = True) -> str:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                    registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                    registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=registry)
    Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry).labels(
        "m", "0").inc(1234)
    if stats:
        for rank, (r, w, u) in enumerate(ranks):
            running.labels("m", str(rank)).set(r)
            waiting.labels("m", str(rank)).set(w)
            usage.labels("m", str(rank)).set(u)
    return generate_latest(registry).decode()


def test_the_gauges_of_every_rank_are_read_and_summed():
    report = parse_vllm_metrics(_scrape([(3, 1, 0.25), (2, 4, 0.5)]), at=7.0)
    assert report == EngineLoad(running=5, waiting=5, kv_usage=0.5, at=7.0)


def test_a_scrape_without_the_scheduler_gauges_is_refused_not_read_as_idle():
    with pytest.raises(ContractError, match="vllm:num_requests_running: absent"):
        parse_vllm_metrics(_scrape([], stats=False), at=0.0)
    with pytest.raises(ContractError, match="not a number"):
        parse_vllm_metrics('vllm:num_requests_running{engine="0"} many\nvllm:num_requests_waiting 0\n', at=0.0)
    with pytest.raises(ContractError, match="no gauge value"):
        parse_vllm_metrics("vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n", at=0.0)


def test_the_engines_report_adds_what_the_router_cannot_see():
    loads = Loads.of(2)
    loads.sent(0, "a", 1000)
    loads.engine_blocks = 100
    reports = [EngineLoad(running=3, waiting=2, kv_usage=0.6, at=0.0), None]
    loads.reported = reports.__getitem__
    w = loads.worker_load(0, "w0", None, loads_own_tiers=True)
    # the router's one prefill, one more waiting in the engine (priced like it), two decoding
    assert (w.queued_prefill_requests, w.queued_prefill_tokens, w.queued_prefill_token_products) == (2, 2000, 2_000_000)
    assert w.active_requests == 5 and w.decode_blocks == round(0.6 * 100 * 2 / 3)
    bare = loads.worker_load(1, "w1", None, loads_own_tiers=True)  # unreported: the router's count alone
    assert (bare.queued_prefill_requests, bare.active_requests, bare.decode_blocks) == (0, 0, 0)


async def test_the_poller_keeps_each_engines_latest_report_and_drops_a_stale_or_failing_one():
    now = [100.0]
    pages = {"/e0/metrics": _scrape([(1, 2, 0.1)]), "/e1/metrics": "no gauges here\n"}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=pages[request.path])

    app = web.Application()
    app.router.add_get("/{engine}/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            poller = EngineLoadPoller([f"http://127.0.0.1:{port}/e0", f"http://127.0.0.1:{port}/e1",
                                       "http://127.0.0.1:9/e2"], session, interval_s=0.01, clock=lambda: now[0])
            poller.start()
            for _ in range(200):
                if poller.stats["scrapes"] >= 9:
                    break
                await asyncio.sleep(0.01)
            await poller.stop()
            assert poller.latest(0) == EngineLoad(running=1, waiting=2, kv_usage=0.1, at=100.0)
            assert poller.latest(1) is None and poller.latest(2) is None  # no gauges; nothing listening
            assert poller.stats["failed"] >= 2 * poller.stats["scrapes"] // 3 - 2
            now[0] += 1.0  # older than max_age_s
            assert poller.latest(0) is None
    finally:
        await runner.cleanup()
