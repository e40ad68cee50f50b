"""Decoding a ``nexuskv.kv-events`` record: version 2 (pre-keyed, msgspec) against version 1 (msgpack ->
dict -> pydantic, token ids validated one by one), in ns per block.

Both versions of the same engine batches, as the bridge publishes them: version 1 is what it sent
before (``translate``), version 2 is that batch keyed at the edge (:class:`~nexuskv.edge_keys.EdgeKeyer`,
no token ids). The timed call is what the index worker and every replica run per record:
``codec.decode(KV_EVENTS, payload)``, which checks size, encoding, version and every field.

Shapes (16-token blocks):

* ``prompt`` — the headline: one record storing an 8K-token prompt (512 blocks in one run);
* ``step`` — one engine step of a busy vLLM: 32 stored runs of 16 blocks (256-token prompts) and
  256 blocks evicted one event each, as vLLM emits them (the bridge's keyer merges consecutive
  removals of one tier into one event: this shape shows what that leaves);
* ``evictions`` — 4,096 evicted blocks, one vLLM event each.

Each figure: the median over ``--runs`` repeats (each timing version 2, then version 1) of the mean
time per record over ``--iters`` decodes, divided by the blocks the record stores or removes; the
results file holds every repeat of the ``prompt`` shape.

Run: ``python -m benchmarks.bench_kv_decode [--runs 5] [--iters 2000] [--no-write]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np

from connectors.kv_wire import EngineBatch, EngineRemoved, EngineStored
from nexuskv.contracts import codec
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import KvEventBatch, PublisherIdentity
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.edge_keys import EdgeKeyer
from streams.bridge import translate

from benchmarks._result import Run, write_result

BS = 16
IDENT = PublisherIdentity(tenant_namespace="bench", model="m", model_revision="r", tokenizer_revision="t",
                          descriptor_id="sd1-" + "0" * 32)


def shapes(rng: np.random.Generator) -> dict[str, EngineBatch]:
    def run(n: int, base: int) -> EngineStored:
        return EngineStored(block_hashes=tuple(range(base, base + n)), parent_block_hash=None,
                            token_ids=tuple(rng.integers(0, 128_000, n * BS).tolist()), block_size=BS, medium="GPU")

    return {
        "prompt": EngineBatch(ts=1.0, events=(run(512, 1 << 40),)),
        "step": EngineBatch(ts=1.0, events=tuple(run(16, (k + 1) << 32) for k in range(32))
                            + tuple(EngineRemoved(block_hashes=(h,), medium="GPU") for h in range(7, 7 + 256))),
        "evictions": EngineBatch(ts=1.0, events=tuple(EngineRemoved(block_hashes=(h,), medium="GPU")
                                                      for h in range(9, 9 + 4096))),
    }


def payloads(batch: EngineBatch) -> tuple[bytes, bytes, int]:
    v1 = translate(batch, publisher="vllm/pod/dp0", incarnation=1, seq=0, identity=IDENT, default_block_size=BS)
    v2 = EdgeKeyer(b"bench-secret-0123").key_batch(v1)
    assert isinstance(v2, KeyedBatch) and v2.block_operations == v1.block_operations
    raw1, raw2 = codec.encode(KV_EVENTS, v1), codec.encode(KV_EVENTS, v2)
    assert isinstance(codec.decode(KV_EVENTS, raw1), KvEventBatch) and codec.decode(KV_EVENTS, raw2) == v2
    return raw1, raw2, v1.block_operations


def per_block_ns(raw: bytes, blocks: int, iters: int) -> float:
    decode = codec.decode
    gc.collect()
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        decode(KV_EVENTS, raw)
    return (time.perf_counter_ns() - t0) / iters / blocks


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", "--runs", dest="repeats", type=int, default=5,
                    help="repeats, each timing version 2 then version 1 on the same record; one run each (default 5)")
    ap.add_argument("--iters", type=int, default=2000, help="decodes of version 2 per repeat (default 2000)")
    ap.add_argument("--no-write", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    details: dict[str, dict] = {}
    for name, batch in shapes(np.random.default_rng(3)).items():
        raw1, raw2, blocks = payloads(batch)
        iters1 = max(20, args.iters // (20 if blocks > 256 else 4))  # v1 is ~100x slower: fewer iterations
        runs2, runs1 = [], []
        for _ in range(args.repeats):  # interleaved: load on a shared machine hits both alike
            runs2.append(per_block_ns(raw2, blocks, args.iters))
            runs1.append(per_block_ns(raw1, blocks, iters1))
        v2, v1 = statistics.median(runs2), statistics.median(runs1)
        details[name] = {"blocks": blocks, "v2_ns_per_block": round(v2, 2), "v1_ns_per_block": round(v1, 1),
                         "ratio": round(v2 / v1, 4), "v2_bytes": len(raw2), "v1_bytes": len(raw1),
                         "v2_runs": runs2, "v1_runs": runs1}
        print(f"{name:10s} {blocks:5d} blocks: v2 {v2:8.2f} ns/block ({len(raw2):,} B), v1 {v1:8.1f} ns/block "
              f"({len(raw1):,} B); ratio {v2 / v1:.4f}")
    head = details["prompt"]
    if not args.no_write:
        path = write_result("kv_events_decode", "decode of a kv-events record (8K-token prompt, 512 blocks)", "ns/block", [Run(a, b) for a, b in zip(head["v2_runs"], head["v1_runs"])], "version 1: msgpack -> dict -> pydantic", f"python -m benchmarks.bench_kv_decode --runs {args.repeats} --iters {args.iters}", {**details, "load_average": os.getloadavg()})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
