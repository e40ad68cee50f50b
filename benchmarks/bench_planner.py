"""In-process decision latency of the planner, against Dynamo's cost formula on the same inputs.

The scenario (``benchmarks/_planner_scenario.py``): an 8K-token prompt, 4 candidates, state in 5
places; the planner weighs 16 options and orders a transfer. Three timings per call, interleaved
in every run so that drift on a shared machine hits all alike:

* ``decide`` — :func:`nexuskv.planner.plan`: every option costed with its uncertainty, the gate,
  the choice, as an immutable :class:`~nexuskv.planner.Plan` (the figure);
* ``decide + records`` — the same plus building its wire records (the pydantic Decision with
  its alternatives, the placement hints and the transfer command) — what the planner service does
  before publishing;
* baseline ``dynamo`` — :class:`nexuskv.routing_policies.DynamoCost` selecting a worker on the same query
  and lookup (Dynamo's formula alone: no tiers costed, no transfer, no record).

Prints p50 and p99 (medians over runs) and ratios, writes
``benchmarks/results/planner_decision_inprocess_p99.json``.
Run: ``python -m benchmarks.bench_planner [--calls 4000] [--runs 5]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from nexuskv.planner import Headroom, plan
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from nexuskv.routing_policies import DynamoCost

from benchmarks import _planner_scenario as scenario
from benchmarks._result import Run, write_result


def _reference_us() -> float:
    """This machine's Python speed right now: a loop of 1,000 integer additions, µs (median of 50)."""
    def loop() -> int:
        total = 0
        for i in range(1000):
            total += i
        return total

    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        loop()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_planner", description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4000, help="timed calls per case and repeat (default 4000)")
    ap.add_argument("--repeats", "--runs", dest="runs", type=int, default=5,
                    help="repeats, each timing the planner and the Dynamo formula in turn; one run each (default 5)")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    q, lk = scenario.query(), scenario.lookup()
    model, policy = shipped_cost_model(), ExecutionPolicy(version="bench")
    headroom = Headroom(transfers=64, bytes_per_s=400e9, pinned_bytes=64 << 30)
    dynamo = DynamoCost()
    first = plan(q, lk, model, policy, now=1.0, headroom=headroom)
    print(f"scenario: {len(first.options)} options, decision {first.action.value} on {first.worker}; "
          f"dynamo picks {dynamo.select(q, lk).worker}")

    def decide():
        plan(q, lk, model, policy, now=1.0, headroom=headroom)

    def decide_records():
        p = plan(q, lk, model, policy, now=1.0, headroom=headroom)
        p.decision, p.hints, p.transfers  # noqa: B018 - building them is what is timed

    def baseline():
        dynamo.select(q, lk)

    cases = {"decide": decide, "decide+records": decide_records, "dynamo": baseline}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    reference = [_reference_us()]
    for _ in range(args.runs):
        for name, fn in cases.items():
            for _ in range(200):  # warm caches and the allocator
                fn()
            gc.collect()
            samples = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            runs[name].append(_percentiles(samples))
        reference.append(_reference_us())
    med = {k: (statistics.median(p50 for p50, _ in v), statistics.median(p99 for _, p99 in v)) for k, v in runs.items()}
    print(f"{'case':<18}{'p50 µs':>10}{'p99 µs':>10}")
    for name, (p50, p99) in med.items():
        print(f"{name:<18}{p50:>10.1f}{p99:>10.1f}")
    ratio = med["decide"][1] / med["dynamo"][1]
    print(f"p99 ratio decide / dynamo: {ratio:.1f}; decide+records / decide: "
          f"{med['decide+records'][1] / med['decide'][1]:.1f}")
    print(f"machine reference: 1,000 integer additions in Python take {statistics.median(reference):.1f} µs "
          f"(range {min(reference):.1f}-{max(reference):.1f} during the runs)")
    path = write_result("planner_decision_inprocess_p99", "planner decision latency in process, p99 (8K prompt, 4 candidates, "
        "5 locations)", "us", [Run(d[1], b[1]) for d, b in zip(runs["decide"], runs["dynamo"])], "Dynamo cost formula alone (same inputs), p99", f"python -m benchmarks.bench_planner --calls {args.calls} --runs {args.runs}", details={"p50_us": med["decide"][0], "decide_with_records_p50_us": med["decide+records"][0],
                 "decide_with_records_p99_us": med["decide+records"][1], "dynamo_p50_us": med["dynamo"][0],
                 "options": len(first.options), "action": first.action.value,
                 "reference_1000_adds_us": statistics.median(reference),
                 "runs": {k: [list(x) for x in v] for k, v in runs.items()}, "load_average": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
