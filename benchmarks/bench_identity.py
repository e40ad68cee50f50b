"""Canonical block keys per second for 8K-token prompts, against a plain hashlib SHA-256 chain.

Both compute one chained 16-token-block key per block of the same prompts in the same run:

* NexusKV: :class:`nexuskv.identity.BlockKeyer` — keyed BLAKE2b-128 over the parent digest and
  the block's tokens packed once with numpy, returning 128-bit int keys.
* baseline: ``sha256(parent || struct.pack(tokens))`` per block in a Python loop, returning digests
  (what a straightforward implementation does; vLLM's own hash adds CBOR or pickle on top).

Prints keys/s for both, the ratio, and writes ``benchmarks/results/identity_block_keys_8k.json``.
Run: ``python -m benchmarks.bench_identity [--prompts 200] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import struct
import time

import numpy as np

from nexuskv.identity import BlockKeyer, IdentityScope

from benchmarks._result import Run, write_result

BLOCK = 16
TOKENS = 8192


def plain_sha256_chain(tokens: list[int], block: int = BLOCK) -> list[bytes]:
    out, prev = [], b""
    fmt = f"<{block}I"
    for i in range(0, len(tokens) // block * block, block):
        prev = hashlib.sha256(prev + struct.pack(fmt, *tokens[i:i + block])).digest()
        out.append(prev)
    return out


def _rate(fn, prompts: list) -> float:
    start = time.perf_counter()
    n = 0
    for p in prompts:
        n += len(fn(p))
    return n / (time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_identity", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200, help="8K-token prompts keyed per repeat (default 200)")
    ap.add_argument("--repeats", type=int, default=7,
                    help="repeats, each keying the prompts with both methods; one run each (default 7)")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 152_000, TOKENS).tolist() for _ in range(args.prompts)]
    scope = IdentityScope(tenant_namespace="bench", model="m", model_revision="r", tokenizer_revision="t",
                          descriptor_id="sd1-" + "0" * 32)
    keyer = BlockKeyer(scope, BLOCK, secret=b"bench-secret")
    ours_runs, base_runs = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        ours_runs.append(_rate(keyer.keys, prompts))
        base_runs.append(_rate(plain_sha256_chain, prompts))
    ours, base = statistics.median(ours_runs), statistics.median(base_runs)
    ratio = ours / base
    per_prompt_ms = TOKENS / BLOCK / ours * 1e3
    print(f"{'method':<34}{'keys/s (median)':>18}{'ms per 8K prompt':>18}")
    print(f"{'NexusKV BlockKeyer (BLAKE2b-128)':<34}{ours:>18,.0f}{per_prompt_ms:>18.3f}")
    print(f"{'plain hashlib sha256 chain':<34}{base:>18,.0f}{TOKENS / BLOCK / base * 1e3:>18.3f}")
    print(f"ratio (ours / baseline): {ratio:.2f}")
    path = write_result("identity_block_keys_8k", "canonical block keys per second, 8K-token prompts, 16-token blocks", "keys/s", [Run(o, b) for o, b in zip(ours_runs, base_runs)], "plain hashlib sha256 chain", f"python -m benchmarks.bench_identity --prompts {args.prompts} --repeats {args.repeats}", details={"runs": ours_runs, "baseline_runs": base_runs, "ms_per_8k_prompt": per_prompt_ms, "load_average": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
