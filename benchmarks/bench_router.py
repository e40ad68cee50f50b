"""Routing policies side by side on the Mooncake conversation trace: predicted TTFT and hit rates.

Eight simulated workers (``benchmarks/router_sim.py``: the trace replay's LRU GPU and host
caches, FIFO prefill queues, Llama-3.1-8B on one H200 each) serve the same requests three times,
routed by NexusKV (the planner's Effective Gain), Dynamo's cost formula and llm-d's longest
prefix × tier weight scorer (``nexuskv/routing_policies.py``). Each request's predicted TTFT is its wait
in the routed worker's queue plus the planner's predicted service time there; the hit rate is
the prompt tokens restored instead of computed (local hit rate: already in the routed worker's
GPU cache).

The simulation is deterministic, so "several runs" are several *windows* of the trace (each a
fresh cluster): the figure is the median over windows of each policy's mean predicted TTFT.
Value = NexusKV; baseline = the better of Dynamo and llm-d. Writes
``benchmarks/results/router_policies_ttft_nexuskv_model.json`` (graded by NexusKV's own cost model).
Run: ``python -m benchmarks.bench_router [--requests 1000] [--windows 3] [--time-scale 1.0]``
(``--time-scale 4 --result router_policies_ttft_nexuskv_model_load4x``: the same trace at four times its rate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from streams.router import POLICY_NAMES

from benchmarks._result import Run, write_result
from benchmarks.router_sim import SimConfig, compare, side_by_side
from benchmarks.trace_events import CONVERSATION_TRACE, load_trace

_COLUMNS = ("mean_ttft_s", "p99_ttft_s", "mean_wait_s", "hit_rate", "local_hit_rate")


def _windows(total: int, size: int, count: int) -> list[int]:
    if count <= 1 or total <= size:
        return [0]
    step = (total - size) / (count - 1)
    return sorted({round(k * step) for k in range(count)})


def _table(rows: dict[str, dict[str, float | int | str]]) -> str:
    lines = [f"{'policy':<9} {'mean TTFT':>10} {'p99 TTFT':>10} {'mean wait':>10} {'hit rate':>9} {'local hit':>9}"]
    for name, r in rows.items():
        lines.append(f"{name:<9} {r['mean_ttft_s']:>9.3f}s {r['p99_ttft_s']:>9.3f}s {r['mean_wait_s']:>9.3f}s "
                     f"{r['hit_rate']:>9.3f} {r['local_hit_rate']:>9.3f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_router", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per window")
    ap.add_argument("--windows", "--repeats", dest="windows", type=int, default=3,
                    help="repeats: disjoint windows of the trace, a fresh cluster each, every policy on the same "
                         "window; one run each (default 3)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=1.0, help="divide arrival times by this (load)")
    ap.add_argument("--result", default="router_policies_ttft_nexuskv_model", help="result file name (benchmarks/results/)")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    trace = load_trace(CONVERSATION_TRACE)
    config = SimConfig(workers=args.workers, time_scale=args.time_scale)
    per_window = []
    for start in _windows(len(trace), args.requests, args.windows):
        t0 = time.perf_counter()
        rows = side_by_side(compare(trace[start:start + args.requests], config=config))
        print(f"\nwindow: requests {start}-{start + args.requests - 1} of {CONVERSATION_TRACE.name} "
              f"({time.perf_counter() - t0:.0f} s)\n{_table(rows)}")
        per_window.append({"first_request": start, "policies": rows})

    medians = {name: {c: statistics.median(float(w["policies"][name][c]) for w in per_window) for c in _COLUMNS}
               for name in POLICY_NAMES}
    print(f"\nmedians over {len(per_window)} window(s)\n{_table(medians)}")
    ours = medians["nexuskv"]["mean_ttft_s"]
    rival = min(("dynamo", "llm-d"), key=lambda n: medians[n]["mean_ttft_s"])
    theirs = medians[rival]["mean_ttft_s"]
    print(f"\nmean predicted TTFT: nexuskv {ours:.3f} s vs {rival} {theirs:.3f} s: ratio {ours / theirs:.3f}")
    command = (f"python -m benchmarks.bench_router --requests {args.requests} --windows {args.windows} "
               f"--workers {args.workers} --time-scale {args.time_scale} --result {args.result}")
    write_result(args.result, f"mean TTFT predicted by NexusKV's own cost model (the model NexusKV's rule optimises), Mooncake conversation trace, {args.workers} simulated workers "
                 f"(median over {len(per_window)} windows of {args.requests} requests)", "s", [Run(w["policies"]["nexuskv"]["mean_ttft_s"], w["policies"][rival]["mean_ttft_s"]) for w in per_window], f"{rival} (the better of dynamo and llm-d)", command, details={"medians": medians, "windows": per_window, "trace": CONVERSATION_TRACE.name,
                          "config": {"workers": config.workers, "gpu_blocks": config.gpu_blocks,
                                     "host_blocks": config.host_blocks, "tpot_s": config.tpot_s,
                                     "time_scale": config.time_scale}, "load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
