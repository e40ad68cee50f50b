"""A broker outage under the planner and the index worker: both must still be running when the
broker is back, and every plan request the broker accepted must be decided.

A local Apache Kafka (always started here: the script stops and restarts it) serves the planner
service (``python -m streams.planner_service``, its in-process index replica included) and the
index worker (``python -m streams.index_worker``), both real processes. Plan requests go out
twice a second; after ``--before`` seconds the broker process is stopped (SIGTERM, then SIGKILL
after 15 s) for ``--outage`` seconds and started again on the same port and log folder; requests
keep going out for ``--after`` seconds. A request the producer could not hand to the broker (it
was down) is counted as not accepted; every accepted one must get its decision. Kv-events batches
flow meanwhile too, and the index worker's checkpoints must cover them all at the end.

Run: ``python -m benchmarks.attack_broker_outage [--outage 30] [--before 10] [--after 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka.errors import KafkaError

from nexuskv.contracts import decode, encode
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.topics import DECISIONS, PLAN_REQUESTS
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import known_model
from streams.bus.broker import ApacheKafkaBroker
from streams.bus.clients import make_consumer, make_producer
from streams.bus.process import ManagedProcess, wait_for_kafka
from streams.bus.topics import ensure_topics

from benchmarks._attack import ROOT, SECRET, encoded, end_offsets, names, replay, topics, wait_checkpointed, worker
from benchmarks._result import Run, write_result

SCOPE = IdentityScope.of(known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme"))


def _request(i: int, tag: str) -> PlanRequest:
    tokens = [(i * 7919 + j * 31) % 50_000 for j in range(512)]
    return PlanRequest(request_id=f"outage-{tag}-{i}", scope=SCOPE, block_size=16, prompt_tokens=512,
                       keys=tuple(BlockKeyer(SCOPE, 16, SECRET.encode()).keys(tokens)), arrival_at=time.time(),
                       candidates=(WorkerLoad(worker="w-a", profile="h200x1-rdma4x200"),))


def _restart(broker: ApacheKafkaBroker) -> None:
    """Start the stopped broker again: same properties, port and log folder (no new format)."""
    broker.process = ManagedProcess(broker._argv(), name=broker.name,  # noqa: SLF001 - restart on its own files
                                    log_path=broker.work_dir / f"{broker.name}.log")
    broker.process.start()
    wait_for_kafka(broker.host, broker.port, timeout_s=120, process=broker.process, what="apache-kafka (restart)")


async def run(broker: ApacheKafkaBroker, *, before: float, outage: float, after: float, folder: Path) -> dict:
    url = broker.url
    await ensure_topics(url, partitions=4)
    topic, group, dead = names()
    await topics(url, topic, dead)
    env = dict(os.environ, NEXUSKV_BROKER=str(url), NEXUSKV_DATA_DIR=str(folder), NEXUSKV_IDENTITY_SECRET=SECRET,
               NEXUSKV_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    planner = ManagedProcess([sys.executable, "-m", "streams.planner_service"], name="planner",
                             log_path=folder / "planner.log", env=env, cwd=ROOT)
    planner.start()
    index = worker(url, folder, topic, group, dead)
    _r, batches = replay(limit=60)
    kv = encoded(batches)
    tag = uuid.uuid4().hex[:6]
    producer = make_producer(url, client_id="outage-requests", linger_ms=0, request_timeout_ms=5000)
    await producer.start()
    decisions = make_consumer(url, DECISIONS, client_id="outage-decisions", group_id=f"outage-{tag}")
    await decisions.start()
    accepted, refused, decided = {}, 0, {}
    phases = {"before": 0, "outage": 0, "after": 0}
    down_at = up_at = None

    async def collect() -> None:
        while True:
            try:
                got = await decisions.getmany(timeout_ms=200)
            except KafkaError:
                await asyncio.sleep(0.5)
                continue
            for records in got.values():
                for rec in records:
                    d = decode(DECISIONS, rec.value)
                    if d.request_id in accepted:
                        decided.setdefault(d.request_id, time.monotonic())

    collector = asyncio.create_task(collect())
    try:
        await asyncio.sleep(5)  # the planner joined its group
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < before + outage + after:
            now = time.monotonic() - start
            phase = "before" if now < before else ("outage" if now < before + outage else "after")
            if phase == "outage" and down_at is None:
                down_at = time.monotonic()
                await asyncio.to_thread(broker.process.stop)
            if phase == "after" and up_at is None:
                await asyncio.to_thread(_restart, broker)
                up_at = time.monotonic()
            req = _request(i, tag)
            i += 1
            try:
                await asyncio.wait_for(producer.send_and_wait(PLAN_REQUESTS.name, encode(PLAN_REQUESTS, req),
                                                              key=req.request_id.encode()), 2.0)
                accepted[req.request_id] = (phase, time.monotonic())
                phases[phase] += 1
            except (KafkaError, asyncio.TimeoutError):
                refused += 1
            if kv and phase != "outage":
                key, value, *_ = kv.pop(0)
                try:
                    await asyncio.wait_for(producer.send_and_wait(topic, value, key=key), 5.0)
                except (KafkaError, asyncio.TimeoutError):
                    kv.insert(0, (key, value))
            await asyncio.sleep(0.5)
        while kv:
            key, value, *_ = kv.pop(0)
            await producer.send_and_wait(topic, value, key=key)
        deadline = time.monotonic() + 120
        while len(decided) < len(accepted) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        ends = await end_offsets(url, topic)
        await wait_checkpointed([folder], topic, group, ends, [index], timeout_s=120)
        alive = {"planner": planner.alive(), "index-worker": index.alive()}
    finally:
        collector.cancel()
        await decisions.stop()
        await producer.stop()
        index.stop()
        planner.stop()
    first_after = min((t for rid, t in decided.items() if accepted[rid][0] == "after"), default=None)
    return {"outage_s": round(up_at - down_at, 1) if up_at and down_at else None, "accepted": len(accepted),
            "accepted_by_phase": phases, "not_accepted": refused, "decided": len(decided),
            "undecided": len(accepted) - len(decided), "services_alive_after": alive,
            "first_decision_after_restart_s": round(first_after - up_at, 2) if first_after and up_at else None,
            "kv_batches": len(batches), "index_checkpoints_complete": True}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attack_broker_outage", description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=float, default=10.0)
    ap.add_argument("--outage", type=float, default=30.0)
    ap.add_argument("--after", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="whole attacks, each on a fresh broker; one run each (default 1: a run takes over a minute)")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    outs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="nexuskv-outage-") as tmp:
            (Path(tmp) / "kafka").mkdir()
            with ApacheKafkaBroker(work_dir=Path(tmp) / "kafka") as broker:
                outs.append(asyncio.run(run(broker, before=args.before, outage=args.outage, after=args.after,
                                            folder=Path(tmp))))
    out = {**sorted(outs, key=lambda o: o["undecided"])[len(outs) // 2], "load_average": os.getloadavg()}
    if len(outs) > 1:
        out["per_run"] = outs
    print(f"broker down {out['outage_s']} s: {out['accepted']} requests accepted ({out['accepted_by_phase']}), "
          f"{out['not_accepted']} not accepted while it was down; {out['decided']} decided, {out['undecided']} "
          f"undecided; first decision {out['first_decision_after_restart_s']} s after the restart; "
          f"alive afterwards: {out['services_alive_after']}")
    if not args.no_write:
        write_result("reliability_broker_outage", "plan requests accepted but never decided across a broker outage", "requests", [Run(o["undecided"], 0) for o in outs], "every accepted request decided", f"python -m benchmarks.attack_broker_outage --outage {args.outage:g} --before {args.before:g} "
                     f"--after {args.after:g}" + (f" --repeats {args.repeats}" if args.repeats != 1 else ""), details=out)


if __name__ == "__main__":
    main()
