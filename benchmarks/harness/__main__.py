"""``python -m benchmarks.harness``: run the harness, print the table, write the DuckDB file and the result."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks.harness.cluster import CAPACITIES
from benchmarks.harness.output import render, write_artifacts, write_result_file
from benchmarks.harness.run import TRACES, HarnessConfig, run_harness
from benchmarks.harness.truth import DRIFTS

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "build" / "harness"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness", description=__doc__)
    ap.add_argument("--trace", choices=TRACES, default="conversation",
                    help="Mooncake conversation or synthetic trace replay, or the generated §10.2 shapes")
    ap.add_argument("--requests", type=int, default=1000, help="requests of the stream (the trace's first N)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=2.0,
                    help="trace replay: arrival = timestamp / this (2: the trace played twice as fast)")
    ap.add_argument("--load", type=float, default=0.6,
                    help="generated workloads: share of the workers recomputing would keep busy")
    ap.add_argument("--arrival", choices=("poisson", "burst"), default="poisson", help="generated workloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", "--repeats", dest="trials", type=int, default=1,
                    help="repeats with different noise seeds, every policy on each; one run each of the results "
                         "file, figures are medians (default 1: a trial of the full harness takes minutes)")
    ap.add_argument("--drift", choices=tuple(DRIFTS), default="drift", help="how the true costs differ from the "
                                                                          "shipped profile the planner starts from")
    ap.add_argument("--ablations", action="store_true", help="also run NexusKV with each §10.4 mechanism off")
    ap.add_argument("--capacity", choices=tuple(CAPACITIES), default="default",
                    help="tier capacities (pressure: host, disk and store small enough to overfill several times)")
    ap.add_argument("--only", nargs="+", default=None, metavar="POLICY",
                    help="run only these policies and ablations (the oracle is always run)")
    ap.add_argument("--control", type=int, default=200, help="requests of the no-reuse control (0: skip it)")
    ap.add_argument("--warmup", type=int, default=0, help="requests left out of the figures (caches start cold)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel processes")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="raw artifacts: harness.duckdb, record.json")
    ap.add_argument("--no-write", action="store_true",
                    help="do not write benchmarks/results/harness_eg_vs_oracle.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = {}
    if args.only:
        extra["policies"] = tuple(dict.fromkeys([*args.only, "oracle"]))
    config = HarnessConfig(trace=args.trace, requests=args.requests, workers=args.workers, time_scale=args.time_scale,
                           load=args.load, arrival=args.arrival, seed=args.seed, trials=args.trials, drift=args.drift,
                           ablations=args.ablations, control_requests=args.control, warmup=args.warmup,
                           jobs=args.jobs, out=args.out, capacity=CAPACITIES[args.capacity], **extra)
    result = run_harness(config)
    write_artifacts(result, args.out)
    print(render(result))
    print(f"rows: {result.files['duckdb']} (table harness_requests); record: {result.files['record']}")
    print(f"NexusKV's decisions as the decision store keeps them: nexuskv report {result.files['duckdb']}")
    if not args.no_write:
        command = "python -m benchmarks.harness " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        path = write_result_file(result, command.strip())
        print(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
