"""NexusKV's index beside NVIDIA Dynamo's RadixTree, on the same blocks and queries, in one process.

Needs the optional extra ``bench`` (``python -m pip install -e ".[bench]"``: PyPI ``ai-dynamo-runtime``,
whose ``dynamo._core.RadixTree`` is Dynamo's KV router index, Rust behind PyO3).

State: ~1M resident blocks (24 prompts of 8,192 blocks and 1,660 of 512 blocks, each stored by one
of 8 workers), sent to each index as stored-block events of at most 4,096 blocks:

* **NexusKV** — :class:`~nexuskv.index.GlobalIndex` (native core) applying
  :class:`~nexuskv.index.KeyedBlocks` events: 16-byte canonical keys computed at the edge and
  8-byte engine hashes, packed as bytes, one publisher batch per prompt. A second ingest figure
  (``wire``) starts from the records' bytes, as the index worker and the replicas do: each
  prompt's kv-events version 2 payload (:mod:`nexuskv.contracts.keyed_events`, built before the
  clock starts) is decoded by ``codec.decode`` and applied with ``GlobalIndex.apply``, the whole
  consumer path, as Dynamo's figure includes its JSON parse; once into an index that grows from
  empty, once into one sized for the fleet up front (``expected_blocks``, which services take
  from ``NEXUSKV_INDEX_EXPECTED_BLOCKS``: here the resident block count). After the timed ingest,
  a quarter of the prompts also get a host-tier event (their first 4,096 blocks offloaded), so
  NexusKV holds more memberships than Dynamo and answers with tiers.
* **Dynamo** — ``RadixTree.apply_event(worker_id, json_bytes)`` with its ``stored`` event JSON
  (``block_hash`` = the engine hash, ``tokens_hash`` = a 64-bit hash of the block's tokens,
  chained by ``parent_hash``), built before the clock starts; the clock stops when a
  ``find_matches`` queued after the last event returns (the tree applies on its own thread).
* **dict** — the fair in-Python baseline: one dict from 128-bit key to an interned frozenset of
  locations, ingest and lookup in plain Python, answering per location with prefix and extents.
  Its answer is put together by the index oracle's run merging
  (``tests/oracles/reference_index.py``: :func:`location_runs`, :func:`prefix_and_extents`), the
  plain statement of what the native core computes, instead of a copy of it here.

Queries: an 8K-token prompt of 16-token blocks (512 keys): the first 384 blocks of one of the 24
long prompts (a prefix hit) and 128 blocks that exist nowhere, rotating over the long prompts;
2,000 lookups x 3 rounds, each round every index in turn. NexusKV answers per (worker, tier, KV
group): prefix, partial extents beyond the first gap, certainty; Dynamo answers per worker: the
length of the matched prefix (it stops at the first miss). Figures: ingest blocks/s, lookup p50 and
p99 (median over the rounds), bytes per membership (the native core's allocated capacity plus the
Python side's traced bytes).

Run: ``python -m benchmarks.bench_index_peers [--rounds 3] [--lookups 2000] [--no-write]``;
``--ingest-only --runs 7``: only the three ingest figures, each run building NexusKV's three indexes
and Dynamo's tree back to back on the same prompts (the figures least disturbed by a shared
machine's load drifting between them), written as the same result files.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's idle BLAS threads would spin on the 2 cores

import argparse
import gc
import json
import statistics
import time
import tracemalloc

import numpy as np

from nexuskv.contracts import codec
from nexuskv.contracts.keyed_events import KeyedBatch, KeyedStored, encode_keyed
from nexuskv.contracts.kv_events import BlockRemoved, BlockStored, PublisherIdentity
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.descriptor import Tier
from nexuskv.identity import IdentityScope
from nexuskv.index import GlobalIndex, KeyedBlocks

from benchmarks._result import Run, write_result
from tests.oracles.reference_index import location_runs, prefix_and_extents

BS = 16
WORKERS = 8
LONG, LONG_BLOCKS, SHORT, SHORT_BLOCKS = 24, 8192, 1660, 512
EVENT_BLOCKS = 4096
QUERY_HIT, QUERY_MISS = 384, 128
IDENT = PublisherIdentity(tenant_namespace="bench", model="m", model_revision="r", tokenizer_revision="t",
                          descriptor_id="sd1-" + "0" * 32)
SCOPE = IdentityScope(tenant_namespace="bench", model="m", model_revision="r", tokenizer_revision="t",
                      descriptor_id="sd1-" + "0" * 32)


class Prompt:
    """One resident prompt: its worker, canonical keys, engine hashes and Dynamo's local hashes."""

    def __init__(self, i: int, n: int, rng: np.random.Generator, worker: int | None = None) -> None:
        self.i, self.n, self.worker = i, n, i % WORKERS if worker is None else worker
        self.keys = rng.bytes(16 * n)
        self.hashes = (np.uint64(i) << np.uint64(20)) | np.arange(n, dtype=np.uint64)
        self.local = rng.integers(0, 2**63, n, dtype=np.uint64)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


# -- NexusKV -------------------------------------------------------------------------------------------


def nexuskv_batches(prompts: list[Prompt]) -> list[tuple[str, int, tuple[KeyedBlocks, ...]]]:
    out, seq = [], [0] * WORKERS
    for p in prompts:
        events = tuple(
            KeyedBlocks(engine_hashes=p.hashes[s:s + EVENT_BLOCKS].astype("<u8").tobytes(),
                        keys=p.keys[16 * s:16 * min(p.n, s + EVENT_BLOCKS)])
            for s in range(0, p.n, EVENT_BLOCKS))
        out.append((f"worker-{p.worker}", seq[p.worker], events))
        seq[p.worker] += 1
    return out


def nexuskv_build(prompts: list[Prompt], *, trace: bool = False) -> tuple[GlobalIndex, float, int]:
    """The index with every prompt stored (timed) and a quarter offloaded to host; with ``trace``,
    the bytes tracemalloc saw allocated (the Python side: the native core's tables are not traced)."""
    batches = nexuskv_batches(prompts)
    gc.collect()
    if trace:
        tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0] if trace else 0
    index = GlobalIndex(secret=b"bench", seed=bytes(range(32)))
    t0 = time.perf_counter()
    for pub, seq, events in batches:
        index.apply_events(pub, 1, seq, IDENT, events)
    elapsed = time.perf_counter() - t0
    seq = {f"worker-{w}": sum(1 for p in prompts if p.worker == w) for w in range(WORKERS)}
    for p in prompts:
        if p.i % 4 == 0:
            pub = f"worker-{p.worker}"
            tier = BlockStored(engine_hashes=tuple(p.hashes[:EVENT_BLOCKS].tolist()), block_size=BS, tier=Tier.HOST)
            index.apply_events(pub, 1, seq[pub], IDENT, (tier,))
            seq[pub] += 1
    traced = 0
    if trace:
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - traced0
        tracemalloc.stop()
    return index, sum(p.n for p in prompts) / elapsed, traced


def nexuskv_payloads(prompts: list[Prompt]) -> list[bytes]:
    """Each prompt's batch as the kv-events version 2 record value its publisher sends."""
    out, seq = [], [0] * WORKERS
    for p in prompts:
        events = tuple(
            KeyedStored(engine_hashes=p.hashes[s:s + EVENT_BLOCKS].astype("<u8").tobytes(),
                        keys=p.keys[16 * s:16 * min(p.n, s + EVENT_BLOCKS)], block_size=BS)
            for s in range(0, p.n, EVENT_BLOCKS))
        out.append(encode_keyed(KeyedBatch(publisher=f"worker-{p.worker}", incarnation=1, seq=seq[p.worker], ts=0.0,
                                           identity=IDENT, events=events)))
        seq[p.worker] += 1
    return out


def nexuskv_build_wire(prompts: list[Prompt], *, expected_blocks: int = 0) -> float:
    """Blocks per second from record bytes to an applied index (decode + apply)."""
    payloads = nexuskv_payloads(prompts)
    gc.collect()
    index = GlobalIndex(secret=b"bench", seed=bytes(range(32)), expected_blocks=expected_blocks)
    decode, apply = codec.decode, index.apply
    t0 = time.perf_counter()
    for raw in payloads:
        apply(decode(KV_EVENTS, raw))
    elapsed = time.perf_counter() - t0
    assert index.stats().blocks == sum(p.n for p in prompts)
    return sum(p.n for p in prompts) / elapsed


# -- Dynamo --------------------------------------------------------------------------------------------


def dynamo_events(prompts: list[Prompt]) -> list[tuple[int, bytes]]:
    out, event_id = [], 0
    for p in prompts:
        for s in range(0, p.n, EVENT_BLOCKS):
            e = min(p.n, s + EVENT_BLOCKS)
            blocks = [{"block_hash": int(h), "tokens_hash": int(t)}
                      for h, t in zip(p.hashes[s:e].tolist(), p.local[s:e].tolist())]
            ev = {"event_id": event_id, "data": {"stored": {"parent_hash": int(p.hashes[s - 1]) if s else None,
                                                            "blocks": blocks}}}
            out.append((p.worker, json.dumps(ev).encode()))
            event_id += 1
    return out


def dynamo_build(prompts: list[Prompt]):
    from dynamo._core import RadixTree

    events = dynamo_events(prompts)
    gc.collect()
    rss0 = rss_bytes()
    tree = RadixTree()
    t0 = time.perf_counter()
    for worker, raw in events:
        tree.apply_event(worker, raw)
    tree.find_matches([0])  # queued behind every event: returns once all are applied
    elapsed = time.perf_counter() - t0
    return tree, sum(p.n for p in prompts) / elapsed, rss_bytes() - rss0


# -- the in-Python baseline ----------------------------------------------------------------------------


class DictIndex:
    """A dict from 128-bit key to an interned frozenset of locations (worker, tier)."""

    def __init__(self) -> None:
        self.blocks: dict[int, frozenset] = {}
        self.sets: dict[frozenset, frozenset] = {}

    def add(self, keys: list[int], loc: tuple[int, str]) -> None:
        blocks, sets, empty = self.blocks, self.sets, frozenset()
        for k in keys:
            new = blocks.get(k, empty) | {loc}
            blocks[k] = sets.setdefault(new, new)

    def lookup(self, keys: list[int]) -> list[tuple[tuple[int, str], int, tuple[tuple[int, int], ...]]]:
        get, empty = self.blocks.get, frozenset()
        runs = location_runs([get(k, empty) for k in keys])
        return [(loc, *prefix_and_extents(got)) for loc, got in sorted(runs.items())]


def key_ints(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[i:i + 16], "big") for i in range(0, len(raw), 16)]


def dict_build(prompts: list[Prompt], *, trace: bool = False) -> tuple[DictIndex, float, int]:
    gc.collect()
    if trace:
        tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0] if trace else 0
    keyed = [(key_ints(p.keys), p.worker) for p in prompts]  # the dict owns its key objects
    index = DictIndex()
    t0 = time.perf_counter()
    for keys, worker in keyed:
        for s in range(0, len(keys), EVENT_BLOCKS):
            index.add(keys[s:s + EVENT_BLOCKS], (worker, "gpu"))
    elapsed = time.perf_counter() - t0
    for (keys, worker), p in zip(keyed, prompts):
        if p.i % 4 == 0:
            index.add(keys[:EVENT_BLOCKS], (worker, "host"))
    del keyed
    traced = 0
    if trace:
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - traced0
        tracemalloc.stop()
    return index, sum(p.n for p in prompts) / elapsed, traced


# -- churn: a full index that stores new prompts while evicting old ones --------------------------------


CHURN = 240  # prompts of 512 blocks stored, and as many evicted, once the ~1M blocks are resident


def churn_plan(prompts: list[Prompt], rng: np.random.Generator) -> list[tuple[Prompt, Prompt]]:
    """(new prompt, evicted prompt) pairs on the same worker: the evicted one is a resident short
    prompt, the new one has fresh keys and hashes."""
    short = [p for p in prompts if p.n == SHORT_BLOCKS][:CHURN]
    return [(Prompt(100_000 + k, SHORT_BLOCKS, rng, worker=old.worker), old) for k, old in enumerate(short)]


def nexuskv_churn(index: GlobalIndex, plan, prompts: list[Prompt]) -> float:
    seq = {f"worker-{w}": index.publisher_status(f"worker-{w}").next_seq for w in range(WORKERS)}
    batches = []
    for new, old in plan:
        pub = f"worker-{new.worker}"
        stored = KeyedBlocks(engine_hashes=new.hashes.astype("<u8").tobytes(), keys=new.keys)
        removed = BlockRemoved(engine_hashes=tuple(old.hashes.tolist()))
        batches.append((pub, seq[pub], (stored, removed)))
        seq[pub] += 1
    gc.collect()
    t0 = time.perf_counter()
    for pub, s, events in batches:
        index.apply_events(pub, 1, s, IDENT, events)
    return 2 * SHORT_BLOCKS * len(plan) / (time.perf_counter() - t0)


def dynamo_churn(tree, plan) -> float:
    events, event_id = [], 1 << 30
    for new, old in plan:
        blocks = [{"block_hash": int(h), "tokens_hash": int(t)} for h, t in zip(new.hashes.tolist(), new.local.tolist())]
        events.append((new.worker, json.dumps({"event_id": event_id, "data": {"stored": {"parent_hash": None,
                                                                                          "blocks": blocks}}}).encode()))
        events.append((old.worker, json.dumps({"event_id": event_id + 1, "data": {"removed": {
            "block_hashes": [int(h) for h in old.hashes.tolist()]}}}).encode()))
        event_id += 2
    gc.collect()
    t0 = time.perf_counter()
    for worker, raw in events:
        tree.apply_event(worker, raw)
    tree.find_matches([0])
    return 2 * SHORT_BLOCKS * len(plan) / (time.perf_counter() - t0)


# -- lookups -------------------------------------------------------------------------------------------


def timed(fn, queries: list, count: int) -> list[float]:
    gc.collect()
    out = []
    clock = time.perf_counter_ns
    for i in range(count):
        q = queries[i % len(queries)]
        t0 = clock()
        fn(q)
        out.append((clock() - t0) / 1000)
    return out


def run_once(args: argparse.Namespace) -> dict:
    """One complete measurement: builds, lookups, churn. Returns its figures."""
    rng = np.random.default_rng(7)
    prompts = [Prompt(i, LONG_BLOCKS if i < LONG else SHORT_BLOCKS, rng) for i in range(LONG + SHORT)]
    _, _, python_side = nexuskv_build(prompts, trace=True)  # memory: a traced build, dropped
    _, _, base_traced = dict_build(prompts, trace=True)
    gc.collect()
    wire_rate = nexuskv_build_wire(prompts)
    gc.collect()
    sized_rate = nexuskv_build_wire(prompts, expected_blocks=sum(p.n for p in prompts))
    gc.collect()
    ours, ours_rate, _ = nexuskv_build(prompts)
    tree, dyn_rate, dyn_rss = dynamo_build(prompts)
    base, base_rate, _ = dict_build(prompts)
    stored = sum(p.n for p in prompts)
    core_nbytes = ours.stats().core_nbytes
    members = ours.memberships
    per_member = (core_nbytes + python_side) / members
    print(f"resident: {stored:,} blocks stored by {WORKERS} workers; NexusKV {members:,} memberships "
          f"({ours.stats().blocks:,} blocks)")
    print(f"ingest of pre-keyed stored blocks: NexusKV {ours_rate / 1e6:.2f} M/s, Dynamo {dyn_rate / 1e6:.2f} M/s "
          f"(JSON), dict {base_rate / 1e6:.2f} M/s; ratio vs Dynamo {ours_rate / dyn_rate:.2f}; from v2 record bytes "
          f"(decode + apply) {wire_rate / 1e6:.2f} M/s, ratio {wire_rate / dyn_rate:.2f}; into a table sized "
          f"up front {sized_rate / 1e6:.2f} M/s, ratio {sized_rate / dyn_rate:.2f}")
    print(f"bytes per membership: NexusKV {per_member:.1f} (core {core_nbytes / members:.1f} + Python "
          f"{python_side / members:.1f}); dict {base_traced / members:.1f}; Dynamo RSS growth "
          f"{dyn_rss / stored:.1f} per block")

    q_ours, q_dyn, q_base = [], [], []
    for j in range(LONG):
        p = prompts[j]
        miss = rng.bytes(16 * QUERY_MISS)
        q_ours.append(p.keys[:16 * QUERY_HIT] + miss)
        q_dyn.append(p.local[:QUERY_HIT].tolist() + rng.integers(0, 2**63, QUERY_MISS, dtype=np.uint64).tolist())
        q_base.append(key_ints(q_ours[-1]))
    for j in range(LONG):  # the same answer where the answers overlap: the worker's GPU prefix
        got = ours.lookup(SCOPE, q_ours[j])
        gpu = [m for m in got.matches if m.location.tier == Tier.GPU]
        assert [(m.location.worker, m.prefix_blocks, m.extents, m.certain) for m in gpu] == \
            [(f"worker-{j % WORKERS}", QUERY_HIT, (), True)], got
        assert (len(got.matches) == 2) == (j % 4 == 0)
        scores = tree.find_matches(q_dyn[j]).scores
        assert scores == {(j % WORKERS, 0): QUERY_HIT}, scores
        assert [(loc, prefix) for loc, prefix, _ in base.lookup(q_base[j]) if loc[1] == "gpu"] == \
            [((j % WORKERS, "gpu"), QUERY_HIT)]

    rounds: dict[str, list[tuple[float, float]]] = {"ours": [], "dynamo": [], "dict": []}
    for r in range(args.rounds):
        for name, fn, qs, count in (("ours", lambda q: ours.lookup(SCOPE, q), q_ours, args.lookups),
                                    ("dynamo", tree.find_matches, q_dyn, args.lookups),
                                    ("dict", base.lookup, q_base, max(200, args.lookups // 10))):
            t = timed(fn, qs, count)
            rounds[name].append((float(np.percentile(t, 50)), float(np.percentile(t, 99))))
        print(f"round {r + 1}: " + "; ".join(f"{k} p50 {v[-1][0]:.1f} µs p99 {v[-1][1]:.1f} µs" for k, v in rounds.items()))
    plan = churn_plan(prompts, rng)
    churn_ours, churn_dyn = nexuskv_churn(ours, plan, prompts), dynamo_churn(tree, plan)
    print(f"churn at ~1M resident (store 512-block prompts, evict as many): NexusKV {churn_ours / 1e6:.2f} M block "
          f"ops/s, Dynamo {churn_dyn / 1e6:.2f} M/s; ratio {churn_ours / churn_dyn:.2f}")
    out = {"stored": stored, "memberships": members, "ingest": (ours_rate, dyn_rate, base_rate),
           "ingest_wire": (wire_rate, dyn_rate), "ingest_wire_sized": (sized_rate, dyn_rate),
           "churn": (churn_ours, churn_dyn), "bytes": (per_member, base_traced / members),
           "core_nbytes": core_nbytes, "python_traced_bytes": python_side, "dynamo_rss_per_block": dyn_rss / stored}
    for q, i in (("p50", 0), ("p99", 1)):
        out[q] = tuple(statistics.median(x[i] for x in rounds[k]) for k in ("ours", "dynamo", "dict"))
    out["rounds_us"] = rounds
    return out


def ingest_once() -> dict:
    """One run of the ingest figures only: NexusKV in process, from v2 bytes, from v2 bytes sized; Dynamo."""
    rng = np.random.default_rng(7)
    prompts = [Prompt(i, LONG_BLOCKS if i < LONG else SHORT_BLOCKS, rng) for i in range(LONG + SHORT)]
    stored = sum(p.n for p in prompts)
    wire = nexuskv_build_wire(prompts)
    gc.collect()
    sized = nexuskv_build_wire(prompts, expected_blocks=stored)
    gc.collect()
    _, keyed, _ = nexuskv_build(prompts)
    gc.collect()
    tree, dyn, _ = dynamo_build(prompts)
    del tree
    print(f"ingest: in process {keyed / 1e6:.2f}, from v2 bytes {wire / 1e6:.2f}, sized {sized / 1e6:.2f} M/s; "
          f"Dynamo {dyn / 1e6:.2f} M/s; ratios {keyed / dyn:.2f} / {wire / dyn:.2f} / {sized / dyn:.2f}")
    return {"stored": stored, "ingest": (keyed, dyn, 0.0), "ingest_wire": (wire, dyn), "ingest_wire_sized": (sized, dyn)}


def write_ingest(runs: list[dict], cmd: str, common: dict) -> None:
    def med(key: str, i: int) -> float:
        return statistics.median(run[key][i] for run in runs)

    def per_run(key: str) -> list:
        return [list(run[key]) for run in runs]

    write_result("index_peers_ingest_keyed", "ingest of pre-keyed stored blocks into an empty index (events of up "
                 "to 4,096 blocks)", "blocks/s", [Run(run["ingest"][0], run["ingest"][1]) for run in runs], "Dynamo RadixTree.apply_event, JSON events (ai-dynamo-runtime 1.6.1)", cmd, details={**common, "per_run_blocks_per_s": per_run("ingest"), "goal_ratio": 1.0,
                          **({"dict_baseline_blocks_per_s": med("ingest", 2)} if med("ingest", 2) else {}),
                          "note": "NexusKV's events are decoded objects with packed keys; Dynamo's clock includes "
                                  "its JSON parse"})
    write_result("index_peers_ingest_wire", "ingest of pre-keyed stored blocks from kv-events v2 record bytes "
                 "(codec.decode + GlobalIndex.apply) into an empty index (events of up to 4,096 blocks)", "blocks/s", [Run(run["ingest_wire"][0], run["ingest_wire"][1]) for run in runs], "Dynamo RadixTree.apply_event, JSON events (ai-dynamo-runtime 1.6.1)", cmd, details={**common, "per_run_blocks_per_s": per_run("ingest_wire"), "goal_ratio": 1.0,
                          "note": "both clocks start from bytes: NexusKV's msgpack v2 record values, Dynamo's JSON"})
    write_result("index_peers_ingest_wire_sized", "ingest of pre-keyed stored blocks from kv-events v2 record "
                 "bytes (codec.decode + GlobalIndex.apply) into an index sized for them up front (expected_blocks, "
                 "NEXUSKV_INDEX_EXPECTED_BLOCKS)", "blocks/s", [Run(run["ingest_wire_sized"][0], run["ingest_wire_sized"][1]) for run in runs], "Dynamo RadixTree.apply_event, JSON events (ai-dynamo-runtime 1.6.1)", cmd, details={**common, "per_run_blocks_per_s": per_run("ingest_wire_sized"), "goal_ratio": 1.0,
                               "expected_blocks": runs[0]["stored"],
                               "note": "both clocks start from bytes; NexusKV's block table sized for the resident "
                                       "blocks before the clock starts (Dynamo's tree needs no sizing)"})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_index_peers", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", "--runs", dest="runs", type=int, default=3,
                    help="complete measurements, each timing NexusKV and Dynamo on the same state; every one is a "
                         "run of the results files, the figures their medians (default 3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--ingest-only", action="store_true", help="only the ingest figures (see the module docstring)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    cmd = f"python -m benchmarks.bench_index_peers --runs {args.runs} --rounds {args.rounds} --lookups {args.lookups}"
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        raise SystemExit("bench_index_peers needs Dynamo's RadixTree: python -m pip install -e '.[bench]'") from None
    if args.ingest_only:
        runs = []
        for r in range(args.runs):
            print(f"-- ingest run {r + 1} of {args.runs}")
            runs.append(ingest_once())
            gc.collect()
        if not args.no_write:
            write_ingest(runs, f"python -m benchmarks.bench_index_peers --ingest-only --runs {args.runs}",
                         {"resident_blocks": runs[0]["stored"], "workers": WORKERS, "runs": args.runs,
                          "index_backend": "native", "load_average_at_end": os.getloadavg()})
        return
    runs = []
    for r in range(args.runs):
        print(f"-- run {r + 1} of {args.runs}")
        runs.append(run_once(args))
        gc.collect()

    def med(key: str, i: int) -> float:
        return statistics.median(run[key][i] for run in runs)

    def per_run(key: str) -> list:
        return [list(run[key]) for run in runs]

    print(f"== medians of {args.runs} runs: lookup p50 NexusKV {med('p50', 0):.1f} / Dynamo {med('p50', 1):.1f} µs "
          f"(ratio {med('p50', 0) / med('p50', 1):.2f}), p99 {med('p99', 0):.1f} / {med('p99', 1):.1f} µs (ratio "
          f"{med('p99', 0) / med('p99', 1):.2f}); ingest {med('ingest', 0) / 1e6:.2f} / {med('ingest', 1) / 1e6:.2f} "
          f"M/s (ratio {med('ingest', 0) / med('ingest', 1):.2f}), from v2 record bytes {med('ingest_wire', 0) / 1e6:.2f} M/s "
          f"(ratio {med('ingest_wire', 0) / med('ingest_wire', 1):.2f}), sized {med('ingest_wire_sized', 0) / 1e6:.2f} M/s "
          f"(ratio {med('ingest_wire_sized', 0) / med('ingest_wire_sized', 1):.2f}); churn {med('churn', 0) / 1e6:.2f} / "
          f"{med('churn', 1) / 1e6:.2f} M ops/s (ratio {med('churn', 0) / med('churn', 1):.2f}); bytes per membership "
          f"{med('bytes', 0):.1f} (dict {med('bytes', 1):.1f})")
    if args.no_write:
        return
    first = runs[0]
    common = {"resident_blocks": first["stored"], "memberships": first["memberships"], "workers": WORKERS,
              "keys_per_lookup": 512, "lookups_per_round": args.lookups, "rounds": args.rounds, "runs": args.runs,
              "index_backend": "native", "load_average_at_end": os.getloadavg()}
    for q in ("p50", "p99"):
        write_result(f"index_peers_lookup_8k_{q}", f"lookup latency {q}, 8K-token prompt (512 keys: 384 present, 128 absent), ~1M resident blocks", "µs", [Run(run[q][0], run[q][1]) for run in runs], "Dynamo RadixTree.find_matches (ai-dynamo-runtime 1.6.1)", cmd, details={**common, "per_run_us": per_run(q), "dict_baseline_us": med(q, 2), "goal_ratio": 1.0,
                              "answer": "NexusKV: per (worker, tier, group) prefix, extents, certainty; "
                                        "Dynamo: per worker prefix length"})
    write_ingest(runs, cmd, common)
    write_result("index_peers_churn_keyed", "block operations per second on a full index: pre-keyed stores of "
                 "512-block prompts, each with the eviction of a resident one", "ops/s", [Run(run["churn"][0], run["churn"][1]) for run in runs], "Dynamo RadixTree.apply_event, JSON stored + removed events", cmd, details={**common, "per_run_ops_per_s": per_run("churn"), "prompts": CHURN, "goal_ratio": 1.0})
    write_result("index_peers_bytes_per_membership", "bytes per (block, location) membership at ~1M resident blocks", "bytes", [Run(run["bytes"][0], run["bytes"][1]) for run in runs], "dict of key -> location set (traced)", cmd, details={**common, "core_nbytes": first["core_nbytes"], "python_traced_bytes":
                          first["python_traced_bytes"], "dynamo_rss_growth_per_block": first["dynamo_rss_per_block"],
                          "goal": 64})


if __name__ == "__main__":
    main()
