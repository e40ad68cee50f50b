"""Request -> decision over the bus on loopback, against a raw aiokafka echo round trip.

A client sends plan requests (the benchmark scenario: 8K tokens, 4 candidates, 5 locations, a
reuse wins) one at a time to ``nexuskv.plan-requests`` and waits for the decision keyed by that
request on ``nexuskv.decisions``; the planner service runs in its own process
(``benchmarks/_planner_bus_probe.py``). The time is from just before the request is produced to
the decision's arrival at the client: two produce/fetch hops, decoding, lookup, planning,
encoding and publishing the decision (and its hints). The baseline is the same client against an
echo process with the same clients and settings that returns the request bytes unchanged: the
floor a request/response service on this bus can reach. Each repeat times the planner, then the echo (both processes up throughout).

Brokers: the embedded Tansu (the default bus) and Apache Kafka 4.2 (the test broker).
Prints p50/p99 (medians over runs) and ratios, writes
``benchmarks/results/planner_decision_bus_p99.json`` (Tansu figures; Kafka under ``details``).
Run: ``python -m benchmarks.bench_planner_bus [--requests 300] [--runs 3] [--brokers tansu,kafka]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from nexuskv.contracts import codec
from nexuskv.contracts.topics import DECISIONS, PLAN_REQUESTS
from streams.bus import tuning
from streams.bus.broker import ApacheKafkaBroker, TansuBroker
from streams.bus.clients import make_consumer, make_producer
from streams.bus.process import ManagedProcess
from streams.bus.topics import ensure_topics

from benchmarks import _planner_scenario as scenario
from benchmarks._planner_bus_probe import ECHO_REPLIES, ECHO_REQUESTS
from benchmarks._result import Run, write_result

REPO = Path(__file__).resolve().parents[1]


def _start_probe(mode: str, url, log_dir: Path) -> ManagedProcess:
    proc = ManagedProcess([sys.executable, "-m", "benchmarks._planner_bus_probe", mode, str(url)],
                          name=f"probe-{mode}", log_path=log_dir / f"{mode}.log", cwd=REPO)
    proc.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{mode} probe exited:\n{proc.log_tail()}")
        if "ready" in proc.log_tail(50).split():
            return proc
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"{mode} probe not ready in 60 s:\n{proc.log_tail()}")


async def _round_trips(url, mode: str, n: int, warmup: int) -> list[float]:
    request_topic, reply_topic = (PLAN_REQUESTS, DECISIONS) if mode == "planner" else (ECHO_REQUESTS, ECHO_REPLIES)
    producer = make_producer(url, client_id=f"bench-client-{mode}", **tuning.LOW_LATENCY_PRODUCER)
    consumer = make_consumer(url, reply_topic, client_id=f"bench-client-{mode}", **tuning.LOW_LATENCY_CONSUMER)
    await producer.start()
    await consumer.start()
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.02)
        await consumer.seek_to_end()
        tag = uuid.uuid4().hex[:8]
        times = []
        for i in range(warmup + n):
            rid = f"bench-{tag}-{i}"
            value = codec.encode(PLAN_REQUESTS, scenario.plan_request(rid, time.time()))
            key = rid.encode()
            t0 = time.perf_counter()
            ack = await producer.send(request_topic.name, value, key=key)
            found = False
            while not found:
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    if any(rec.key == key for rec in records):
                        found = True
            elapsed = time.perf_counter() - t0
            await ack
            if i >= warmup:
                times.append(elapsed)
        return times
    finally:
        await consumer.stop()
        await producer.stop()


def _pcts(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    return s[len(s) // 2] * 1e3, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3


def bench_broker(broker, args, log_dir: Path) -> dict[str, list[tuple[float, float]]]:
    url = broker.url
    asyncio.run(ensure_topics(url, partitions=8))
    asyncio.run(ensure_topics(url, partitions=8, topics=(ECHO_REQUESTS, ECHO_REPLIES)))
    runs: dict[str, list[tuple[float, float]]] = {"planner": [], "echo": []}
    procs = []
    try:
        for mode in runs:
            procs.append(_start_probe(mode, url, log_dir))
        for _ in range(args.runs):  # a repeat times the planner, then the echo: one run of the results file
            for mode in runs:
                runs[mode].append(_pcts(asyncio.run(_round_trips(url, mode, args.requests, warmup=30))))
    finally:
        for proc in procs:
            proc.stop()
    return runs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_planner_bus", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="timed round trips per case and repeat (default 300)")
    ap.add_argument("--repeats", "--runs", dest="runs", type=int, default=3,
                    help="repeats per broker, each timing the planner then the echo; one run each (default 3)")
    ap.add_argument("--brokers", default="tansu,kafka")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="nexuskv-bench-bus-"))
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for name in args.brokers.split(","):
        broker = TansuBroker() if name == "tansu" else ApacheKafkaBroker()
        with broker:
            results[name] = bench_broker(broker, args, log_dir)
    print(f"{'broker':<8}{'case':<10}{'p50 ms':>9}{'p99 ms':>9}")
    med = {}
    for name, runs in results.items():
        for mode, pcts in runs.items():
            p50 = statistics.median(p for p, _ in pcts)
            p99 = statistics.median(p for _, p in pcts)
            med[(name, mode)] = (p50, p99)
            print(f"{name:<8}{mode:<10}{p50:>9.2f}{p99:>9.2f}")
        pl, ec = med[(name, "planner")], med[(name, "echo")]
        print(f"{name}: planner / echo p99 ratio {pl[1] / ec[1]:.2f}, p50 ratio {pl[0] / ec[0]:.2f}")
    primary = "tansu" if "tansu" in results else next(iter(results))
    path = write_result("planner_decision_bus_p99", f"plan request -> decision over the bus on loopback, p99 ({primary})", "ms", [Run(p[1], e[1]) for p, e in zip(results[primary]["planner"], results[primary]["echo"])], f"raw aiokafka echo round trip ({primary}), p99", f"python -m benchmarks.bench_planner_bus --requests {args.requests} --runs {args.runs} "
        f"--brokers {args.brokers}", details={"p50_ms": med[(primary, "planner")][0], "echo_p50_ms": med[(primary, "echo")][0],
                 "by_broker": {f"{b}/{m}": {"p50_ms": v[0], "p99_ms": v[1]} for (b, m), v in med.items()},
                 "runs": {b: {m: [list(x) for x in r] for m, r in runs.items()} for b, runs in results.items()},
                 "requests_per_run": args.requests, "load_average": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
