"""Index figures: in-process ingest, lookup latency at 1M resident blocks, bytes per membership.

Each against the plain dict-of-sets index (``ReferenceIndex``, the index's test oracle in
``tests/oracles/reference_index.py``) in the same run, on the same inputs.

* ``index_ingest_inprocess`` — block operations per second on one core applying the Mooncake
  conversation replay (``benchmarks/trace_events.py``; first ``--requests`` requests, 8 workers, 16-token
  blocks, 4,096-block GPU and 8,192-block host LRU caches; stores with key computation from
  tokens, tier moves, removals). Median of ``--repeats`` runs.
* ``index_lookup_{2k,8k,32k,128k}_p99`` — µs per lookup given the query's keys (an ``(n, 2)``
  uint64 array), with ~1M resident blocks: 24 prompts of 8,192 blocks and 1,660 of 512 blocks,
  each stored by one of 8 publishers, a quarter also offloaded to host. A query is the first 3/4
  of a long prompt's tokens plus a random 1/4 (a prefix hit and a miss tail), rotating over the
  long prompts so memory is not all cached. Key computation (tokens -> key array) reported apart.
* ``index_bytes_per_membership`` — bytes held for the 1M-block state (the native core's allocated
  capacity, which ``tracemalloc`` cannot see, plus the Python side's traced bytes), divided by
  its (block, location) memberships.

Run: ``python -m benchmarks.bench_index [--requests 300] [--repeats 3] [--lookups 2000]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc

import numpy as np

from nexuskv.contracts.kv_events import BlockStored, KvEventBatch, PublisherIdentity
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope, digest_array
from nexuskv.index import GlobalIndex

from benchmarks._result import Run, write_result
from benchmarks.trace_events import TraceReplay, load_trace
from tests.oracles.reference_index import ReferenceIndex

SECRET = b"bench"
BS = 16
SIZES = {"2k": 2048, "8k": 8192, "32k": 32768, "128k": 131072}
IDENT = PublisherIdentity(tenant_namespace="bench", model="m", model_revision="r", tokenizer_revision="t",
                          descriptor_id="sd1-" + "0" * 32)
SCOPE = IdentityScope(tenant_namespace="bench", model="m", model_revision="r", tokenizer_revision="t",
                      descriptor_id="sd1-" + "0" * 32)


def ingest(requests: int, repeats: int) -> dict:
    replay = TraceReplay(load_trace(limit=requests), workers=8, gpu_blocks=4096, host_blocks=8192)
    batches = list(replay.batches())
    ops = replay.block_ops
    ours, base = [], []
    for _ in range(repeats):
        for kind, runs in (("ours", ours), ("base", base)):
            index = GlobalIndex(secret=SECRET) if kind == "ours" else ReferenceIndex(secret=SECRET)
            gc.collect()
            t0 = time.perf_counter()
            for b in batches:
                index.apply(b)
            runs.append(ops / (time.perf_counter() - t0))
    return {"ops": ops, "batches": len(batches), "ours": ours, "base": base}


def resident_state(rng: np.random.Generator) -> tuple[list[KvEventBatch], list[np.ndarray]]:
    """Batches storing ~1M blocks, and the long prompts' tokens."""
    long_prompts = [rng.integers(0, 128_000, 8192 * BS, dtype=np.uint32) for _ in range(24)]
    short = [rng.integers(0, 128_000, 512 * BS, dtype=np.uint32) for _ in range(1660)]
    batches, seq = [], {}
    for i, toks in enumerate(long_prompts + short):
        pub = f"bench-worker-{i % 8}"
        n = len(toks) // BS
        events = []
        for start in range(0, n, 4096):
            stop = min(n, start + 4096)
            events.append(BlockStored(engine_hashes=tuple(range(i << 20 | start, i << 20 | stop)),
                                      parent=(i << 20 | (start - 1)) if start else None,
                                      token_ids=tuple(toks[start * BS: stop * BS].tolist()), block_size=BS))
        if i % 4 == 0:
            events.append(BlockStored(engine_hashes=tuple(range(i << 20, i << 20 | min(n, 4096))), block_size=BS,
                                      tier=Tier.HOST))
        s = seq.get(pub, 0)
        seq[pub] = s + 1
        batches.append(KvEventBatch(publisher=pub, incarnation=1, seq=s, ts=0.0, identity=IDENT, events=tuple(events)))
    return batches, long_prompts


def build(kind: str, batches: list[KvEventBatch]):
    index = GlobalIndex(secret=SECRET) if kind == "ours" else ReferenceIndex(secret=SECRET)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for b in batches:
        index.apply(b)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    if kind == "ours":
        used += index.stats().core_nbytes  # the native core's tables are not traced
    return index, used


def lookups(index, queries: list[np.ndarray], count: int, as_ints: bool) -> list[float]:
    times = []
    qs = [[(int(h) << 64) | int(lo) for h, lo in q] for q in queries] if as_ints else queries
    for i in range(count):
        q = qs[i % len(qs)]
        t0 = time.perf_counter_ns()
        index.lookup(SCOPE, q)
        times.append((time.perf_counter_ns() - t0) / 1000)
    return times


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_index", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="Mooncake trace requests replayed for ingest (default 300)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="repeats of the ingest replay and of each lookup size, each timing GlobalIndex then the "
                         "dict-of-sets index; one run each (default 3). Bytes per membership are measured once.")
    ap.add_argument("--lookups", type=int, default=2000, help="GlobalIndex lookups per size and repeat (default 2000)")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    cmd = f"python -m benchmarks.bench_index --requests {args.requests} --repeats {args.repeats} --lookups {args.lookups}"

    got = ingest(args.requests, args.repeats)
    ours, base = statistics.median(got["ours"]), statistics.median(got["base"])
    print(f"ingest in-process: {got['ops']:,} block ops in {got['batches']} batches; "
          f"GlobalIndex {ours:,.0f} ops/s, dict-of-sets {base:,.0f} ops/s, ratio {ours / base:.2f}")
    if not args.no_write:
        write_result("index_ingest_inprocess", "block operations per second per core, Mooncake replay", "ops/s", [Run(o, b) for o, b in zip(got["ours"], got["base"])], "plain dict-of-sets index (ReferenceIndex)", cmd, details={"runs": got["ours"], "baseline_runs": got["base"], "block_ops": got["ops"],
                              "requests": args.requests, "goal": 300_000, "load_average": os.getloadavg()})

    rng = np.random.default_rng(7)
    batches, long_prompts = resident_state(rng)
    ours_ix, ours_bytes = build("ours", batches)
    base_ix, base_bytes = build("base", batches)
    members = ours_ix.memberships
    blocks = ours_ix.stats().blocks
    print(f"resident: {blocks:,} blocks, {members:,} memberships; bytes/membership GlobalIndex "
          f"{ours_bytes / members:.1f} (nbytes {ours_ix.nbytes / members:.1f}), dict-of-sets {base_bytes / members:.1f}")
    if not args.no_write:
        write_result("index_bytes_per_membership", "bytes per (block, location) membership at ~1M resident blocks", "bytes", [Run(ours_bytes / members, base_bytes / members)], "plain dict-of-sets index (ReferenceIndex)", cmd, details={"blocks": blocks, "memberships": members, "traced_bytes": ours_bytes,
                                   "baseline_traced_bytes": base_bytes, "nbytes_estimate": ours_ix.nbytes,
                                   "goal": 64, "load_average": os.getloadavg(),
                                   "runs_note": "measured once: traced bytes of the same state do not vary"})
    keyer = BlockKeyer(SCOPE, BS, SECRET)
    # Both indexes' objects are long-lived from here: out of the collector's way, so the
    # dict-of-sets index's ~500 MB of Python objects do not stretch the other one's GC pauses.
    gc.collect()
    gc.freeze()
    for label, tokens in SIZES.items():
        queries, key_us = [], []
        for j, prompt in enumerate(long_prompts):
            head = prompt[: tokens * 3 // 4]
            tail = rng.integers(0, 128_000, tokens - len(head), dtype=np.uint32)
            q_tokens = np.concatenate((head, tail))
            t0 = time.perf_counter_ns()
            arr = digest_array(keyer.digests(q_tokens))
            key_us.append((time.perf_counter_ns() - t0) / 1000)
            queries.append(arr)
        first = ours_ix.lookup(SCOPE, queries[0])
        assert first == base_ix.lookup(SCOPE, [(int(h) << 64) | int(lo) for h, lo in queries[0]])
        per_run = []  # (p50, p99, baseline p50, baseline p99) per repeat, both timed in it
        for _ in range(args.repeats):
            t_ours = lookups(ours_ix, queries, args.lookups, as_ints=False)
            t_base = lookups(base_ix, queries, max(50, args.lookups // 20), as_ints=True)
            per_run.append(tuple(float(np.percentile(t, q)) for t in (t_ours, t_base) for q in (50, 99)))
        p50, p99, b50, b99 = (statistics.median(r[i] for r in per_run) for i in range(4))
        print(f"lookup {label} ({tokens // BS} keys, {len(first.matches)} matching locations): GlobalIndex p50 "
              f"{p50:.1f} µs p99 {p99:.1f} µs; dict-of-sets p50 {b50:.1f} p99 {b99:.1f}; ratio p99 {p99 / b99:.3f}; "
              f"key computation median {statistics.median(key_us):.0f} µs")
        if not args.no_write:
            write_result(f"index_lookup_{label}_p99", f"lookup latency p99, {tokens}-token prompt given its keys, "
                         f"~1M resident blocks", "µs", [Run(r[1], r[3]) for r in per_run], "plain dict-of-sets index (ReferenceIndex), p99", cmd, details={"p50_us": p50, "baseline_p50_us": b50, "keys": tokens // BS, "lookups": args.lookups,
                                  "per_run_us": [list(r) for r in per_run], "load_average": os.getloadavg(),
                                  "baseline_lookups": len(t_base), "key_computation_median_us": statistics.median(key_us),
                                  "resident_blocks": blocks, "matching_locations": len(first.matches),
                                  "goal_p99_us_at_8k": 10})


if __name__ == "__main__":
    main()
