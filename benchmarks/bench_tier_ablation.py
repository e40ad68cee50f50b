"""§10.4 ablation of tier admission and eviction by utility, in the harness, under tier pressure.

``python -m benchmarks.bench_tier_ablation [--trials 3]`` runs the evaluation harness
(:mod:`benchmarks.harness`) on the Mooncake conversation slice with the ``pressure`` capacities
(host a quarter, disk and store an eighth of the default: the slice's working set overfills every
tier beyond the GPU several times) for

* ``nexuskv`` — the tier manager's host, disk and store tiers evict and admit by utility per byte;
* ``no-eviction-utility`` — the same planner on LRU tiers that admit everything (what every other
  policy, and the engines, do): the baseline of the figure;
* ``no-tier-admission`` — utility eviction, but every offload and write admitted;
* ``no-admission-budgets`` — utility tiers, no transfer budgets (the budgets' own ablation, here
  where tiers are under pressure);
* ``hit-driven`` and the ``oracle`` for reference (both on LRU tiers).

It writes ``benchmarks/results/harness_tier_ablation.json``: NexusKV's mean TTFT (median over
trials) against ``no-eviction-utility``'s, and every run's medians in ``details``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

from benchmarks._result import Run, write_result
from benchmarks.harness import HarnessConfig, run_harness
from benchmarks.harness.cluster import CAPACITIES
from benchmarks.harness.output import render

POLICIES = ("nexuskv", "no-eviction-utility", "no-tier-admission", "no-admission-budgets", "hit-driven", "oracle")
FIGURES = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "eg_vs_oracle", "eg_vs_oracle_run", "eg_s", "physical_rate",
           "reused_rate", "useful_rate", "fallbacks")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_tier_ablation", description=__doc__)
    ap.add_argument("--trials", "--repeats", dest="trials", type=int, default=3,
                    help="repeats with different noise seeds, every policy on each; one run each (default 3, "
                         "~2 min a trial here)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--capacity", choices=tuple(CAPACITIES), default="pressure")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = HarnessConfig(requests=args.requests, trials=args.trials, policies=POLICIES, control_requests=0,
                           capacity=CAPACITIES[args.capacity], jobs=args.jobs)
    result = run_harness(config)
    print(render(result))
    medians = {p: {f: result.median(p, f) for f in FIGURES} for p in POLICIES}
    per_trial = {p: [t[p].ttft_mean_s for t in result.trials] for p in POLICIES}
    value, base = medians["nexuskv"]["ttft_mean_s"], medians["no-eviction-utility"]["ttft_mean_s"]
    print(f"mean TTFT: utility tiers {value:.4f} s, LRU tiers {base:.4f} s: ratio {value / base:.3f}")
    if not args.no_write:
        command = "python -m benchmarks.bench_tier_ablation " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        details = {"capacity": args.capacity, "capacities": dataclasses.asdict(CAPACITIES[args.capacity]),
                   "workload": result.workload.name, "requests": len(result.workload.requests),
                   "trials": args.trials, "medians": medians, "ttft_mean_per_trial": per_trial,
                   "counters": result.counters, "wall_s": round(result.wall_s, 1),
                   "load_average": os.getloadavg()}
        path = write_result("harness_tier_ablation", "NexusKV's mean TTFT with utility tiers (admission and "
                            "eviction by expected gain per byte) under tier pressure, simulated cluster", "s", [Run(v, b) for v, b in zip(per_trial["nexuskv"], per_trial["no-eviction-utility"])], "no-eviction-utility (the same planner on LRU tiers)", command.strip(), details)
        print(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
