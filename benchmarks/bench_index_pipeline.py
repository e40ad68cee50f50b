"""``index_ingest_pipeline``: block operations per second through Kafka into the index, one worker.

A real Apache Kafka (``streams.bus.broker.ApacheKafkaBroker``) holds the Mooncake replay's batches
(``benchmarks/trace_events.py``, first ``--requests`` requests, 16-token blocks, 8 workers) on a
4-partition topic before either consumer starts. Then, in this process:

* ours: :class:`streams.index_worker.IndexWorker` (Faust agent, msgpack + contract decode, whole
  batches applied to the GlobalIndex, checkpoints every 30 s) — rate from its first record to
  its last;
* baseline: a Faust agent that decodes the same batches and writes one Faust table row per block
  operation (``table[publisher:hash] = tier`` for a store, ``del`` for a removal), the naive
  design the issue rules out — rate over its first ``--baseline-seconds`` seconds.

Run: ``python -m benchmarks.bench_index_pipeline [--requests 200] [--runs 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from nexuskv.contracts import codec
from nexuskv.contracts.kv_events import BlockRemoved, BlockStored
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS
from streams.bus.broker import ApacheKafkaBroker
from streams.bus.clients import make_producer
from streams.bus.topics import ensure_topics
from streams.faust_app import make_faust_app
from streams.index_worker import IndexWorker

from benchmarks._result import Run, write_result
from benchmarks.trace_events import TraceReplay, load_trace

PARTITIONS = 4


async def produce(url, topic: str, batches) -> None:
    producer = make_producer(url, client_id="bench-pipeline")
    await producer.start()
    try:
        futs = [await producer.send(topic, codec.encode(KV_EVENTS, b), key=b.publisher.encode()) for b in batches]
        await asyncio.gather(*futs)
    finally:
        await producer.stop()


async def run_ours(url, topic: str, records: int, ops: int, data: Path) -> float:
    worker = IndexWorker(url, data_dir=data, max_memberships=16_000_000, secret=b"bench", checkpoint_interval_s=30.0,
                         partitions=PARTITIONS, topic=topic, group=f"bench-index-{uuid.uuid4().hex[:6]}",
                         dead_letter_topic=DEAD_LETTER.name)
    seen: list[float] = []
    handle = worker.handle

    async def timed(partition, offset, record):
        if not seen:
            seen.append(time.perf_counter())
        await handle(partition, offset, record)

    worker.handle = timed  # type: ignore[method-assign]
    await worker.app.start()
    try:
        while worker.records < records:
            await asyncio.sleep(0.05)
        end = time.perf_counter()
        assert worker.index.stats().unresolved_blocks == 0
    finally:
        await worker.app.stop()
        await worker.stop()
    return ops / (end - seen[0])


async def run_faust_table(url, topic: str, seconds: float, data: Path) -> float:
    app = make_faust_app(f"bench-table-{uuid.uuid4().hex[:6]}", url, data_dir=data, topic_partitions=PARTITIONS)
    table = app.Table("blocks", default=str, partitions=PARTITIONS)
    source = app.topic(topic, key_type=bytes, value_type=bytes)
    state = {"ops": 0, "t0": None}
    kv = dataclasses.replace(KV_EVENTS, name=topic)

    @app.agent(source)
    async def per_block(stream):
        async for value in stream:
            if state["t0"] is None:
                state["t0"] = time.perf_counter()
            batch = codec.decode(kv, value)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    for h in ev.engine_hashes:
                        table[f"{batch.publisher}:{h}"] = ev.tier.value
                        state["ops"] += 1
                elif isinstance(ev, BlockRemoved):
                    for h in ev.engine_hashes:
                        table.pop(f"{batch.publisher}:{h}", None)
                        state["ops"] += 1

    await app.start()
    try:
        while state["t0"] is None:
            await asyncio.sleep(0.05)
        await asyncio.sleep(seconds)
        rate = state["ops"] / (time.perf_counter() - state["t0"])
    finally:
        await app.stop()
    return rate


async def amain(args) -> None:
    replay = TraceReplay(load_trace(limit=args.requests), workers=8, gpu_blocks=4096, host_blocks=8192)
    batches = list(replay.batches())
    with ApacheKafkaBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        url = broker.url
        topic = f"bench.kv-events.{uuid.uuid4().hex[:6]}"
        await ensure_topics(url, partitions=PARTITIONS, topics=(dataclasses.replace(KV_EVENTS, name=topic),))
        await produce(url, topic, batches)
        ours, base = [], []
        for i in range(args.runs):
            ours.append(await run_ours(url, topic, len(batches), replay.block_ops, Path(tmp) / f"o{i}"))
            base.append(await run_faust_table(url, topic, args.baseline_seconds, Path(tmp) / f"b{i}"))
            print(f"run {i}: index worker {ours[-1]:,.0f} block ops/s, per-block Faust table {base[-1]:,.0f}")
    o, b = statistics.median(ours), statistics.median(base)
    print(f"index_ingest_pipeline: {o:,.0f} block ops/s per worker; per-block Faust table {b:,.0f}; ratio {o / b:.1f}")
    if not args.no_write:
        write_result("index_ingest_pipeline", "block operations per second through Kafka into the index, one worker", "ops/s", [Run(x, y) for x, y in zip(ours, base)], "Faust agent writing one table row per block", f"python -m benchmarks.bench_index_pipeline --requests {args.requests} --runs {args.runs}"
                     + (f" --baseline-seconds {args.baseline_seconds:g}" if args.baseline_seconds != 10.0 else ""), details={"runs": ours, "baseline_runs": base, "block_ops": replay.block_ops,
                              "batches": len(batches), "partitions": PARTITIONS, "goal": 100_000,
                              "load_average": os.getloadavg()})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_index_pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="Mooncake trace requests produced once (default 200)")
    ap.add_argument("--repeats", "--runs", dest="runs", type=int, default=3,
                    help="repeats, each the index worker then the per-block Faust table on the same topic; one run "
                         "each (default 3)")
    ap.add_argument("--baseline-seconds", type=float, default=10.0, help="how long the Faust table is timed (default 10)")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    asyncio.run(amain(build_parser().parse_args()))


if __name__ == "__main__":
    main()
