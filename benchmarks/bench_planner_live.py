"""Lookup + plan per request on a live index with varied requests; and the engine's ask round trip.

State: a :class:`~nexuskv.index.GlobalIndex` (native core) holding ~1M resident block memberships
over 8 workers, built from the Mooncake conversation trace (``/work/shared/data/traces``, else the
slice in ``benchmarks/data``): each trace request's ``hash_ids`` (512-token blocks) become 32
16-token blocks each (keys derived from the hash id, so the trace's prefix sharing is kept), stored
by one worker's GPU; every fourth request's prefix also on that worker's host tier, every fifth on
its disk tier.

Requests: the trace's next requests, cut or padded to 8K tokens (512 keys; padding blocks exist
nowhere), so prefix depths vary as the trace's do; 4 of the 8 workers as candidates with loads
drawn at random (queued prefill 0-40K tokens, decode blocks 0-8K). **Live**: before every measured
request one kv-events batch is applied (a new trace request stored by a random worker, or an old
one removed), between requests as the replica's sliced apply does; it is not in the timing.

Timed per request, interleaved (the order alternates) so drift hits all alike:

* ``lookup+plan`` — ``index.lookup(scope, keys)`` (128-bit ints, as the planner service calls it)
  then :func:`nexuskv.planner.plan` (the figure; goal p99 <= 100 µs);
* ``lookup`` — the lookup alone;
* baseline ``lookup+dynamo`` — the same lookup then Dynamo's cost formula selecting a worker
  (:class:`nexuskv.routing_policies.DynamoCost`: no tiers costed, no transfer, no record).

Engine side (unless ``--no-ask``): the same index behind the node's sidecar (:mod:`streams.index_sidecar`) in
a **separate process** (so the GIL is not shared), applying its own live batches in 2 ms slices,
asked over the Unix socket by :class:`connectors.index_client.IndexClient` from this process, p50/p99
of the round trip against the in-process lookup it replaces (the same keys, the same index state);
then again with the sidecar idle (no batches applied: the transport's own cost).

Writes ``planner_live_lookup_plan_8k_p99.json`` and ``engine_ask_roundtrip_8k_p99.json``.
Run: ``python -m benchmarks.bench_planner_live [--requests 3000] [--runs 3] [--no-ask] [--no-write]``
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import gc
import hashlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nexuskv.contracts.kv_events import BlockRemoved, BlockStored, PublisherIdentity
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.descriptor import Tier
from nexuskv.identity import IdentityScope
from nexuskv.index import GlobalIndex, KeyedBlocks
from nexuskv.models import known_model
from nexuskv.planner import Headroom, PlanQuery, plan
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from nexuskv.routing_policies import DynamoCost

from benchmarks._result import Run, write_result

BS, QUERY_BLOCKS, SUB = 16, 512, 32  # 8K tokens; a Mooncake hash id covers 512 tokens = 32 of our blocks
WORKERS, TARGET = 8, 1_000_000
PROFILE = "h200x1-rdma4x200"
DESCRIPTOR = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="bench")
SCOPE = IdentityScope.of(DESCRIPTOR)
IDENT = PublisherIdentity(tenant_namespace=SCOPE.tenant_namespace, model=SCOPE.model,
                          model_revision=SCOPE.model_revision, tokenizer_revision=SCOPE.tokenizer_revision,
                          descriptor_id=SCOPE.descriptor_id)
TRACES = [Path("/work/shared/data/traces/conversation_trace.jsonl"),
          Path(__file__).resolve().parent / "data" / "conversation_trace_head1000.jsonl"]


def trace() -> list[list[int]]:
    path = next(p for p in TRACES if p.exists())
    return [json.loads(line)["hash_ids"] for line in path.read_text().splitlines() if line.strip()]


_KEYS: dict[int, bytes] = {}


def blocks_of(hash_ids: list[int]) -> bytes:
    """The canonical keys (16-byte digests, joined) of a request's 16-token blocks, at most 512."""
    out = []
    for h in hash_ids[: QUERY_BLOCKS // SUB]:
        k = _KEYS.get(h)
        if k is None:
            k = _KEYS[h] = b"".join(hashlib.blake2b(f"{h}:{j}".encode(), digest_size=16).digest() for j in range(SUB))
        out.append(k)
    return b"".join(out)


class Fleet:
    """The index and what each worker's publisher has stored (for live stores and removals)."""

    def __init__(self, requests: list[list[int]], seed: int = 7) -> None:
        self.index = GlobalIndex(secret=b"bench", seed=bytes(range(32)))
        self.rng = random.Random(seed)
        self.seq = dict.fromkeys(range(WORKERS), 0)
        self.next_hash = 1
        self.held: list[dict[bytes, int]] = [{} for _ in range(WORKERS)]  # per worker: key -> engine hash
        self.stored: list[tuple[int, list[int]]] = []  # (worker, engine hashes) per stored request
        self.requests, self.at = requests, 0
        while self.index.memberships < TARGET and self.at < len(requests):
            self.store(self.at % WORKERS, requests[self.at], extra_tiers=True)
            self.at += 1

    def _apply(self, worker: int, events: tuple) -> None:
        self.index.apply_events(f"w-{worker}", 1, self.seq[worker], IDENT, events)
        self.seq[worker] += 1

    def store(self, worker: int, hash_ids: list[int], *, extra_tiers: bool = False) -> None:
        keys = blocks_of(hash_ids)
        held = self.held[worker]
        new_keys, hashes = [], []
        for i in range(0, len(keys), 16):
            k = keys[i:i + 16]
            if k not in held:
                held[k] = self.next_hash
                self.next_hash += 1
                new_keys.append(k)
                hashes.append(held[k])
        if not new_keys:
            return
        events: list = [KeyedBlocks(engine_hashes=hashes, keys=b"".join(new_keys))]
        if extra_tiers and self.at % 4 == 0:
            events.append(BlockStored(engine_hashes=tuple(hashes), block_size=BS, tier=Tier.HOST))
        if extra_tiers and self.at % 5 == 0:
            events.append(BlockStored(engine_hashes=tuple(hashes[: len(hashes) // 2 or 1]), block_size=BS,
                                      tier=Tier.DISK))
        self._apply(worker, tuple(events))
        self.stored.append((worker, hashes))

    def live_batch(self) -> None:
        """One live kv-events batch: a new trace request stored, or the oldest one removed."""
        if self.rng.random() < 0.5 and self.at < len(self.requests):
            self.store(self.rng.randrange(WORKERS), self.requests[self.at])
            self.at += 1
        elif self.stored:
            worker, hashes = self.stored.pop(0)
            held = self.held[worker]
            gone = set(hashes)
            for k in [k for k, h in held.items() if h in gone]:
                del held[k]
            self._apply(worker, (BlockRemoved(engine_hashes=tuple(hashes)),))


def queries(requests: list[list[int]], n: int, rng: random.Random) -> list[PlanQuery]:
    out = []
    for i in range(n):
        hash_ids = requests[rng.randrange(len(requests))]
        raw = blocks_of(hash_ids)
        keys = [int.from_bytes(raw[j:j + 16], "big") for j in range(0, len(raw), 16)]
        keys += [rng.getrandbits(128) for _ in range(QUERY_BLOCKS - len(keys))]  # blocks that exist nowhere
        candidates = tuple(WorkerLoad(worker=f"w-{w}", profile=PROFILE, queued_prefill_tokens=rng.randrange(40_000),
                                      decode_blocks=rng.randrange(8_000))
                           for w in rng.sample(range(WORKERS), 4))
        out.append(PlanQuery(request_id=f"q{i}", scope=SCOPE, descriptor=DESCRIPTOR, keys=tuple(keys),
                             prompt_tokens=QUERY_BLOCKS * BS, arrival_at=1.0, candidates=candidates))
    return out


def pct(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def inprocess(fleet: Fleet, qs: list[PlanQuery], runs: int) -> dict:
    model, policy = shipped_cost_model(), ExecutionPolicy(version="bench")
    headroom = Headroom(transfers=64, bytes_per_s=400e9, pinned_bytes=64 << 30)
    dynamo, index = DynamoCost(), fleet.index

    def ours(q):
        plan(q, index.lookup(q.scope, q.keys), model, policy, now=1.0, headroom=headroom)

    def lookup(q):
        index.lookup(q.scope, q.keys)

    def baseline(q):
        dynamo.select(q, index.lookup(q.scope, q.keys))

    cases = {"lookup+plan": ours, "lookup": lookup, "lookup+dynamo": baseline}
    per_run: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    applied, apply_s, hits, actions = 0, 0.0, [], {}
    for q in qs[:200]:
        for fn in cases.values():
            fn(q)
    for r in range(runs):
        samples: dict[str, list[float]] = {k: [] for k in cases}
        order = list(cases.items())
        gc.collect()
        for i, q in enumerate(qs):
            t0 = time.perf_counter()
            fleet.live_batch()
            apply_s += time.perf_counter() - t0
            applied += 1
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                fn(q)
                samples[name].append(time.perf_counter() - t0)
            if r == 0:
                lk = index.lookup(q.scope, q.keys)
                hits.append(max((m.prefix_blocks for m in lk.matches if m.certain), default=0))
                a = plan(q, lk, model, policy, now=1.0, headroom=headroom).action.value
                actions[a] = actions.get(a, 0) + 1
        for name in cases:
            per_run[name].append(pct(samples[name]))
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in per_run.items()}
    return {"median": med, "runs": per_run, "live_batches": applied, "live_batch_mean_us": apply_s / applied * 1e6,
            "memberships": index.memberships, "prefix_hit_blocks": {"p10": sorted(hits)[len(hits) // 10],
                                                                     "p50": sorted(hits)[len(hits) // 2],
                                                                     "p90": sorted(hits)[len(hits) * 9 // 10],
                                                                     "zero": sum(1 for h in hits if h == 0)},
            "actions": actions}


# -- the engine's ask --------------------------------------------------------------------------------


class LiveReplica:
    """What the sidecar serves in the benchmark's server process: the fleet's index, live batches applied
    in slices of at most 2 ms on the sidecar's loop (as the replica does)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def lookup(self, scope, keys):
        return self.fleet.index.lookup(scope, keys)

    async def wait_caught_up(self, timeout_s: float = 60.0) -> None:
        await asyncio.sleep(0)

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.002:
                self.fleet.live_batch()
            await asyncio.sleep(0.002)  # about half the loop's time applying: a busy replica


def serve(path: str, live: bool) -> None:
    from streams.index_sidecar import IndexSidecar

    fleet = Fleet(trace())

    async def main() -> None:
        replica = LiveReplica(fleet)
        sidecar = IndexSidecar(replica, Path(path))
        await sidecar.start()
        print("ready", flush=True)
        await asyncio.gather(sidecar.serve_forever(), *([replica.run()] if live else []))

    asyncio.run(main())


def ask(qs: list[PlanQuery], runs: int, *, live: bool = True) -> dict:
    from connectors.index_client import IndexClient

    folder = tempfile.mkdtemp(prefix="nkv-bench-", dir="/tmp")
    path = os.path.join(folder, "index.sock")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_planner_live", "--serve", path] + ([] if live else ["--idle"]),
                            stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        local = Fleet(trace())  # the same state in this process: the in-process lookup the ask replaces
        client = IndexClient(path, budget_s=0.02, backoff_s=0.0)
        for q in qs[:200]:
            client.lookup(q.scope, q.keys)
        per_run: dict[str, list[tuple[float, float]]] = {"ask": [], "inprocess": []}
        for _ in range(runs):
            samples: dict[str, list[float]] = {"ask": [], "inprocess": []}
            gc.collect()
            for i, q in enumerate(qs):
                local.live_batch()
                for name in (("ask", "inprocess") if i % 2 == 0 else ("inprocess", "ask")):
                    t0 = time.perf_counter()
                    if name == "ask":
                        client.lookup(q.scope, q.keys)
                    else:
                        local.index.lookup(q.scope, q.keys)
                    samples[name].append(time.perf_counter() - t0)
            for name in samples:
                per_run[name].append(pct(samples[name]))
        stats = dict(client.stats)
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in per_run.items()}
    return {"median": med, "runs": per_run, "client": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-ask", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, live=not args.idle)
        return
    requests = trace()
    t0 = time.perf_counter()
    fleet = Fleet(requests)
    print(f"index: {fleet.index.memberships:,} memberships from {fleet.at:,} trace requests "
          f"({time.perf_counter() - t0:.1f} s)")
    qs = queries(requests, args.requests, random.Random(11))
    got = inprocess(fleet, qs, args.runs)
    med = got["median"]
    print(f"{'case':<16}{'p50 µs':>10}{'p99 µs':>10}")
    for name, (p50, p99) in med.items():
        print(f"{name:<16}{p50:>10.1f}{p99:>10.1f}")
    print(f"live batches applied between requests: {got['live_batches']:,}, {got['live_batch_mean_us']:.0f} µs each; "
          f"prefix hits (blocks) {got['prefix_hit_blocks']}; actions {got['actions']}")
    ratio = med["lookup+plan"][1] / med["lookup+dynamo"][1]
    print(f"lookup+plan p99 {med['lookup+plan'][1]:.1f} µs (goal <= 100): {ratio:.2f}x lookup+dynamo's")
    command = f"python -m benchmarks.bench_planner_live --requests {args.requests} --runs {args.runs}"
    if not args.no_write:
        path = write_result("planner_live_lookup_plan_8k_p99", "index lookup + plan per request, p99, in process (8K-token requests "
            "from the Mooncake trace, 4 of 8 candidates with random loads, ~1M memberships, live batches applied)", "us", [Run(med["lookup+plan"][1], med["lookup+dynamo"][1])], "lookup + Dynamo cost formula (same requests, same run), p99", command, details={"p50_us": med["lookup+plan"][0], "lookup_p50_us": med["lookup"][0],
                     "lookup_p99_us": med["lookup"][1], "baseline_p50_us": med["lookup+dynamo"][0],
                     "goal_p99_us": 100, **{k: v for k, v in got.items() if k not in ("median",)}})
        print(f"wrote {path}")
    if args.no_ask:
        return
    asked = ask(qs, args.runs)
    idle = ask(qs, args.runs, live=False)
    amed, imed = asked["median"], idle["median"]
    print(f"engine ask, sidecar idle (transport alone): p50 {imed['ask'][0]:.1f} µs, p99 {imed['ask'][1]:.1f} µs")
    print(f"engine ask (sidecar in another process, live): p50 {amed['ask'][0]:.1f} µs, p99 {amed['ask'][1]:.1f} µs; "
          f"in-process lookup p50 {amed['inprocess'][0]:.1f} µs, p99 {amed['inprocess'][1]:.1f} µs; "
          f"client {asked['client']}")
    if not args.no_write:
        path = write_result("engine_ask_roundtrip_8k_p99", "engine-side ask of the node's index sidecar, round trip p99 (512 keys, "
            "Unix socket, sidecar applying live batches)", "us", [Run(amed["ask"][1], amed["inprocess"][1])], "in-process replica lookup it replaces (same keys, same state), p99", command, details={"p50_us": amed["ask"][0], "baseline_p50_us": amed["inprocess"][0],
                              "budget_ms": 20, "runs": asked["runs"], "client": asked["client"],
                              "idle_sidecar_p50_us": imed["ask"][0], "idle_sidecar_p99_us": imed["ask"][1],
                              "idle_runs": idle["runs"], "idle_client": idle["client"]})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
