"""What tracing costs a request: mean TTFT of the replay's NexusKV run with every span exported, vs none.

Each pair of runs replays the same request stream on real vLLM (two CPU engines, the random
``replay`` Llama) through vLLM + NexusKV — the run where every exporter is busy: the replay's own
spans, the planner's, the decision sink's, vLLM's request spans and the connector's — once with
``--trace-to`` a real local Jaeger (``streams.app.jaeger``, started here) and once without. The
order alternates between pairs (off then on, on then off, ...) so that a drift of the shared
machine's load does not favour one side. The figure is the traced run's mean TTFT over the
measured requests; its baseline the untraced run's in the same pair; the ratio is the median of
the per-pair ratios (goal: <= 1.02).

Writes ``benchmarks/results/replay_trace_overhead.json``.

    python -m benchmarks.bench_trace_overhead --pairs 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from analytics.replay_figures import replay_figures
from streams.app.jaeger import JaegerServer, provision_jaeger

from benchmarks._result import Run, write_result

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "data" / "conversation_trace_head1000.jsonl"


def _one(out: Path, requests: int, warmup: int, trace_to: str | None) -> dict:
    """One NexusKV run as ``nexuskv replay`` runs it, in a process of its own (OpenTelemetry allows one
    tracer provider per process: an untraced run after a traced one must not inherit it)."""
    cmd = [sys.executable, "-m", "streams.app.cli", "replay", str(TRACE), "--requests", str(requests),
           "--warmup", str(warmup), "--runs", "nexuskv", "--out", str(out), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "NEXUSKV_OTLP_ENDPOINT"}
    if trace_to is not None:
        cmd += ["--trace-to", trace_to]
    for attempt in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
        if done.returncode == 0:
            break
        # The replay picks free ports before its engines bind them; on a shared machine another
        # process can take one in between ("Address already in use"): that run starts again, once.
        print(f"replay failed ({done.returncode}), attempt {attempt + 1}:\n{done.stdout[-1500:]}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    else:
        raise SystemExit(f"replay failed twice:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with duckdb.connect(str(out / "decisions.duckdb"), read_only=True) as con:
        fig = replay_figures(con)
        assert fig is not None
        traced, errors = con.execute("SELECT count(trace_id), count(error) FROM replay_requests WHERE replay_id = ?",
                                     [fig.replay_id]).fetchone()
    n = fig.measured["nexuskv"]
    return {"replay_id": fig.replay_id, "traced": trace_to is not None, "mean_ttft_s": n.mean_ttft_s,
            "p50_ttft_s": n.p50_ttft_s, "p99_ttft_s": n.p99_ttft_s, "requests": n.requests, "errors": errors,
            "requests_with_trace_id": traced, "load_1m": round(os.getloadavg()[0], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--no-write", action="store_true", help="print, do not write the results file")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-trace-overhead-"))
    runs: list[Run] = []
    rows: list[dict] = []
    with JaegerServer(binary=provision_jaeger()) as jaeger:
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            pair = {}
            for traced in order:
                row = _one(base / f"pair{i}-{'on' if traced else 'off'}", args.requests, args.warmup,
                           jaeger.otlp_http_url if traced else None)
                pair[traced] = row
                rows.append(row)
                print(row, flush=True)
                time.sleep(2)
            runs.append(Run(pair[True]["mean_ttft_s"], pair[False]["mean_ttft_s"]))
            print(f"-- pair {i + 1}/{args.pairs}: traced / untraced mean TTFT {runs[-1].ratio:.3f}", flush=True)
        spans = sum(len(t.get("spans", ())) for t in jaeger.endpoints.traces("nexuskv-replay", limit=10000))
    command = f"python -m benchmarks.bench_trace_overhead --pairs {args.pairs} --requests {args.requests} " \
              f"--warmup {args.warmup}"
    details = {"runs": rows, "trace": TRACE.name, "spans_in_jaeger_for_the_replay_traces": spans,
               "workload": f"{args.requests} requests ({args.warmup} warm-up) of the trace's conversations, "
                           "NexusKV run only, 2 vLLM CPU engines, random 8-layer Llama (float32)",
               "machine": f"{os.cpu_count()} cores, shared with other work; load_1m per run in runs"}
    if not args.no_write:
        path = write_result("replay_trace_overhead", "mean TTFT of the replay's measured requests, NexusKV run, "
                            "every span exported to a local Jaeger", "s", runs,
                            "the same run without trace export (same pair)", command, details)
        print(f"wrote {path}")
    ratios = sorted(r.ratio for r in runs if r.ratio is not None)
    print(f"per-pair ratios {', '.join(f'{r:.3f}' for r in ratios)}; median {ratios[len(ratios) // 2]:.3f}")


if __name__ == "__main__":
    main()
