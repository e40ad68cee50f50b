"""A process for ``bench_planner_bus``: the planner service on the scenario, or a raw aiokafka echo.

``python -m benchmarks._planner_bus_probe planner kafka://...`` runs a PlannerService whose index
answers every lookup with the benchmark scenario (a reuse wins: no transfer is ordered).
``python -m benchmarks._planner_bus_probe echo kafka://...`` consumes ``bench.echo-requests`` and
produces each value unchanged, with its key, to ``bench.echo-replies``: the same clients and
settings (``streams.bus.tuning.LOW_LATENCY_*``) with no decoding, planning or encoding, the floor of a
request/response round trip on this bus. Both print ``ready`` once they hold their partitions.
"""

from __future__ import annotations

import asyncio
import sys

from nexuskv.config import parse_broker_url
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.topics import Topic
from streams.bus import tuning
from streams.bus.clients import make_consumer, make_producer
from streams.bus.process import stop_on_signals
from streams.planner_service import PlannerService

from benchmarks._planner_scenario import ScenarioIndex

ECHO_REQUESTS = Topic("bench.echo-requests", "request id", DeadLetter, "json", "echo benchmark requests")
ECHO_REPLIES = Topic("bench.echo-replies", "request id", DeadLetter, "json", "echo benchmark replies")


async def _until_signalled() -> None:
    stop = stop_on_signals()
    await stop.wait()


async def planner(url) -> None:
    service = PlannerService(url, ScenarioIndex(reuse_wins=True), group_id="bench-planner")
    await service.start()
    print("ready", flush=True)
    try:
        await _until_signalled()
    finally:
        await service.stop()


async def echo(url) -> None:
    producer = make_producer(url, client_id="bench-echo", **tuning.LOW_LATENCY_PRODUCER)
    consumer = make_consumer(url, ECHO_REQUESTS, client_id="bench-echo", group_id="bench-echo",
                             **tuning.LOW_LATENCY_CONSUMER)
    await producer.start()
    await consumer.start()
    while not consumer.assignment():
        await asyncio.sleep(0.02)
    print("ready", flush=True)

    acked: dict = {}

    async def serve() -> None:  # as the planner service: commit acked offsets in the background
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=512)
            futures = [await producer.send(ECHO_REPLIES.name, rec.value, key=rec.key)
                       for records in batches.values() for rec in records]
            if futures:
                await asyncio.gather(*futures)
                acked.update({tp: records[-1].offset + 1 for tp, records in batches.items()})

    async def commit() -> None:
        while True:
            await asyncio.sleep(0.1)
            if acked:
                offsets = dict(acked)
                acked.clear()
                await consumer.commit(offsets)

    tasks = [asyncio.create_task(serve()), asyncio.create_task(commit())]
    try:
        await _until_signalled()
    finally:
        for task in tasks:
            task.cancel()
        await consumer.stop()
        await producer.stop()


if __name__ == "__main__":
    mode, raw_url = sys.argv[1], sys.argv[2]
    asyncio.run({"planner": planner, "echo": echo}[mode](parse_broker_url(raw_url)))
