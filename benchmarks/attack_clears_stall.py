"""The largest valid kv-events record (65,536 clears, 0.9 MB) into an index replica that a planner
service shares its event loop with: how long is the loop held, and how slow do decisions get?

The replica (every partition of a fresh kv-events topic) first applies the Mooncake slice
(``--requests``, 4 simulated workers); a planner service on the same event loop decides against
it. Then one publisher's batch of 65,536 ``cleared`` events goes out, and plan requests are sent
every 250 ms while the replica applies it. A 1 ms sleeper on the loop records, between two
wake-ups, the wall time and the loop thread's CPU time: the CPU time is how long the loop was
*held* by work on it; the wall time adds whatever the OS gave other processes (a loaded machine).

Run: ``python -m benchmarks.attack_clears_stall [--requests 40]`` (``NEXUSKV_BROKER`` to use a
running broker; otherwise a local Apache Kafka is started).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
import uuid

import msgpack
from aiokafka import TopicPartition

from nexuskv.contracts import decode, encode
from nexuskv.contracts.kv_events import AllCleared, KvEventBatch
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.topics import DECISIONS, PLAN_REQUESTS, TRANSFER_RESULTS
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import known_model
from streams.bus.clients import make_consumer, make_producer
from streams.bus.process import freeze_startup_heap
from streams.bus.topics import ensure_topics
from streams.planner_service import PlannerService
from streams.replica import IndexReplica

from benchmarks._attack import SECRET, encoded, names, produce, reference, replay, topics
from benchmarks._attack_broker import attack_broker
from benchmarks._result import Run, write_result

SCOPE = IdentityScope.of(known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme"))


async def _group_at_end(url, group: str) -> None:
    consumer = make_consumer(url, client_id="stall-offsets", group_id=group)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001 - aiokafka has no public refresh
        tps = [TopicPartition(n, p) for n in (PLAN_REQUESTS.name, TRANSFER_RESULTS.name)
               for p in sorted(consumer.partitions_for_topic(n) or ())]
        consumer.assign(tps)
        await consumer.commit(dict(await consumer.end_offsets(tps)))
    finally:
        await consumer.stop()


def _request(i: int) -> PlanRequest:
    tokens = [(i * 7919 + j * 31) % 50_000 for j in range(1024)]
    return PlanRequest(request_id=f"stall-{uuid.uuid4().hex[:8]}-{i}", scope=SCOPE, block_size=16, prompt_tokens=1024,
                       keys=tuple(BlockKeyer(SCOPE, 16, SECRET.encode()).keys(tokens)), arrival_at=time.time(),
                       candidates=(WorkerLoad(worker="w-a", profile="h200x1-rdma4x200"),))


async def run(url, *, requests: int) -> dict:
    _r, batches = replay(limit=requests, workers=4)
    topic, _group, dead = names()
    await topics(url, topic, dead)
    await ensure_topics(url, partitions=4)
    await produce(url, topic, encoded(batches))
    victim = batches[-1]
    seq = max(b.seq for b in batches if b.publisher == victim.publisher) + 1
    clears = KvEventBatch(publisher=victim.publisher, incarnation=victim.incarnation, seq=seq, ts=time.time(),
                          identity=victim.identity, events=(AllCleared(),))
    doc = clears.model_dump(mode="json")
    doc["events"] = [{"type": "cleared"}] * 65536
    hostile = msgpack.packb(doc, use_bin_type=True)
    group = f"planner-stall-{uuid.uuid4().hex[:6]}"
    await _group_at_end(url, group)
    async with IndexReplica(url, secret=SECRET.encode(), topic=topic, bus_secret=b"") as replica:
        await replica.wait_caught_up()
        blocks = replica.index.stats().blocks
        service = PlannerService(url, replica, group_id=group)
        await service.start()
        out = make_consumer(url, client_id="stall-decisions", fetch_max_wait_ms=10)
        await out.start()
        producer = make_producer(url, client_id="stall-requests", linger_ms=0)
        await producer.start()
        gaps: list[tuple[float, float]] = []
        stop = asyncio.Event()

        async def probe() -> None:
            while not stop.is_set():
                t, cpu = time.perf_counter(), time.thread_time()
                await asyncio.sleep(0.001)
                gaps.append((time.perf_counter() - t, time.thread_time() - cpu))

        freeze_startup_heap()  # as the planner's main does once it has started
        prober = asyncio.create_task(probe())
        sent, latency = {}, {}

        async def drain(timeout_ms: int) -> None:
            for records in (await out.getmany(timeout_ms=timeout_ms)).values():
                for rec in records:
                    d = decode(DECISIONS, rec.value)
                    if d.request_id in sent and d.request_id not in latency:
                        latency[d.request_id] = time.perf_counter() - sent[d.request_id]

        try:
            await out._client.force_metadata_update()  # noqa: SLF001
            tps = [TopicPartition(DECISIONS.name, p) for p in sorted(out.partitions_for_topic(DECISIONS.name))]
            out.assign(tps)
            await out.seek_to_end(*tps)
            await produce(url, topic, [(victim.publisher.encode(), hostile)])
            began = time.perf_counter()
            i = 0
            while replica.lag()[0] != 0 or i < 4:
                req = _request(i)
                i += 1
                sent[req.request_id] = time.perf_counter()
                await producer.send_and_wait(PLAN_REQUESTS.name, encode(PLAN_REQUESTS, req), key=req.request_id.encode())
                end = time.perf_counter() + 0.25
                while time.perf_counter() < end:
                    await drain(20)
                if time.perf_counter() - began > 600:
                    break
            await replica.wait_caught_up(timeout_s=600)
            applied_s = time.perf_counter() - began
            while len(latency) < len(sent) and time.perf_counter() - began < applied_s + 30:
                await drain(100)
        finally:
            gc.unfreeze()
            stop.set()
            await prober
            await producer.stop()
            await out.stop()
            await service.stop()
        truth = reference([*batches, clears]).facts()
        exact = replica.index.facts() == truth
    lat = sorted(latency.values())
    return {"blocks": blocks, "record_bytes": len(hostile), "applied_s": round(applied_s, 2),
            "victim_blocks_left": sum(1 for k in truth if k[0] == victim.publisher), "requests_sent": len(sent),
            "loop_held_max_ms": round(max(c for _w, c in gaps) * 1000, 1),
            "loop_gap_max_ms": round(max(w for w, _c in gaps) * 1000, 1),
            "decisions": len(lat), "decision_p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
            "decision_max_ms": round(lat[-1] * 1000, 1) if lat else None, "replica_exact": exact}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attack_clears_stall", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3,
                    help="attacks, each on fresh topics of one broker; one run each (default 3)")
    ap.add_argument("--baseline-ms", type=float, default=0.0,
                    help="loop held on commit 30ffd34 (from its test run), for the result file: the baseline of "
                         "every run, given, not measured here")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    with attack_broker() as url:
        outs = [asyncio.run(run(url, requests=args.requests)) for _ in range(args.repeats)]
    out = {**sorted(outs, key=lambda o: o["loop_held_max_ms"])[len(outs) // 2], "load_average": os.getloadavg(),
           "baseline_source": "given with --baseline-ms (commit 30ffd34's test run), not measured in this run"}
    if len(outs) > 1:
        out["per_run"] = outs
    print(f"65,536 clears ({out['record_bytes']} bytes) into a replica of {out['blocks']} blocks: applied in "
          f"{out['applied_s']} s; loop held at most {out['loop_held_max_ms']} ms of CPU (longest wall-clock gap "
          f"{out['loop_gap_max_ms']} ms); {out['decisions']} decisions meanwhile, p50 {out['decision_p50_ms']} ms, "
          f"max {out['decision_max_ms']} ms; replica exact {out['replica_exact']}")
    if not args.no_write:
        write_result("reliability_clears_loop_held", "longest the replica's event loop is held by one 65,536-clear batch", "ms", [Run(o["loop_held_max_ms"], args.baseline_ms) for o in outs], "commit 30ffd34 (the whole batch in one go)", f"python -m benchmarks.attack_clears_stall --requests {args.requests} --repeats {args.repeats} --baseline-ms {args.baseline_ms:g}", details=out)


if __name__ == "__main__":
    main()
