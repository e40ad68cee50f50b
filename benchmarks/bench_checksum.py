"""Payload checksum throughput: XXH3-128 (what the data plane uses) against BLAKE2b-128 and CRC32.

Hashes the same random payloads (``--unit`` bytes each, ``--mib`` MiB per pass) with
``nexuskv.dataplane.payload.payload_checksum`` (XXH3-128 over the address fields and the data)
and with ``hashlib.blake2b(digest_size=16)`` and ``zlib.crc32`` over the data alone, passes
interleaved; prints GB/s medians and writes ``benchmarks/results/checksum_xxh3_128.json``
(baseline: BLAKE2b, the fastest cryptographic hash in the standard library).
Run: ``python -m benchmarks.bench_checksum [--mib 256] [--unit 2097152] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import zlib

import numpy as np

from nexuskv.dataplane.payload import PayloadKey, payload_checksum

from benchmarks._result import Run, write_result


def _rate(fn, buffers) -> float:
    start = time.perf_counter()
    for b in buffers:
        fn(b)
    return sum(b.nbytes for b in buffers) / (time.perf_counter() - start) / 1e9


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_checksum", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB checksummed per repeat (default 256)")
    ap.add_argument("--unit", type=int, default=2 << 20, help="payload size in bytes (default 2 MiB)")
    ap.add_argument("--repeats", type=int, default=7,
                    help="repeats, each timing every method over the same buffers; one run each (default 7)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, args.unit, dtype=np.uint8) for _ in range(max(1, (args.mib << 20) // args.unit))]
    key = PayloadKey("sd1-" + "0" * 32, 1)
    methods = {
        "xxh3-128 (payload_checksum)": lambda b: payload_checksum(key, b),
        "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "crc32": lambda b: zlib.crc32(b),
    }
    runs: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            runs[name].append(_rate(fn, buffers))
    med = {m: statistics.median(r) for m, r in runs.items()}
    for m, v in med.items():
        print(f"{m:<30}{v:>8.2f} GB/s")
    ours, base = med["xxh3-128 (payload_checksum)"], med["blake2b-128"]
    print(f"ratio (xxh3-128 / blake2b): {ours / base:.1f}")
    path = write_result("checksum_xxh3_128", f"payload checksum throughput, {args.unit}-byte payloads", "GB/s", [Run(o, b) for o, b in zip(runs["xxh3-128 (payload_checksum)"], runs["blake2b-128"])], "hashlib blake2b digest_size=16", f"python -m benchmarks.bench_checksum --mib {args.mib} --unit {args.unit} --repeats {args.repeats}", details={"runs": runs, "medians": med, "load_average": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
