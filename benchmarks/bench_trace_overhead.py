"""What tracing costs a request: mean TTFT of the replay's NexusKV run with every span exported, vs none.

Each pair of runs replays the same request stream on real vLLM (two CPU engines, the random
``replay`` Llama) through vLLM + NexusKV — the run where every exporter is busy: the replay's own
spans, the planner's, the decision sink's, vLLM's request spans and the connector's — once with
``--trace-to`` a real local Jaeger (``streams.app.jaeger``, started here) and once without. The
order alternates between pairs (off then on, on then off, ...) so that a drift of the shared
machine's load does not favour one side. The figure is the traced run's mean TTFT over the
measured requests; its baseline the untraced run's in the same pair; the ratio is the median of
the per-pair ratios (goal: <= 1.02). Each run records the machine's 1-minute load average when it
starts and ends (``load_1m_start``, ``load_1m``): the machine is shared, and the figure is only as
good as the load was even.

Each traced run's traces are also checked in Jaeger (``trace_check`` of its row), over every request
of the run: the traces found (one per request), orphan spans (a span whose parent is not in its
trace), split traces (a span naming a request of the run, by NexusKV's request id or vLLM's
``gen_ai.request.id``, in any trace of any service other than that request's, traces rooted in
another replay excepted: those name the same request ids), and the requests
whose trace holds vLLM's own ``llm_request`` span (goal: 0 orphans, 0 splits).

Writes ``benchmarks/results/replay_trace_overhead.json``.

    python -m benchmarks.bench_trace_overhead --pairs 3
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from analytics.replay_figures import replay_figures
from nexuskv.errors import JaegerError
from streams.app.jaeger import JaegerEndpoints, JaegerServer, provision_jaeger

from benchmarks._result import Run, write_result

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "data" / "conversation_trace_head1000.jsonl"


def _tags(span: dict) -> dict:
    return {t["key"]: t["value"] for t in span.get("tags", ())}


def _parent(span: dict) -> str | None:
    refs = [r for r in span.get("references") or () if r.get("refType") == "CHILD_OF"]
    return refs[0]["spanID"] if refs else None


def _trace_check(jaeger: JaegerEndpoints, replay_id: str, trace_ids: dict[str, str],
                 timeout_s: float = 60.0) -> dict:
    """Orphan spans and split traces over every request of a traced run (``trace_ids``: request id to
    the trace id the replay recorded), once every request's trace holds vLLM's span (or ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {t["traceID"]: t for t in jaeger.traces("nexuskv-replay", limit=10000)
                 if any(s["operationName"] == "replay.request" and _tags(s).get("nexuskv.replay_id") == replay_id
                        for s in t["spans"])}
        with_engine = {tid for tid, t in found.items() if any(s["operationName"] == "llm_request" for s in t["spans"])}
        if set(trace_ids.values()) <= with_engine or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    orphans = 0
    for t in found.values():
        ids = {s["spanID"] for s in t["spans"]}
        orphans += sum(1 for s in t["spans"] if _parent(s) is not None and _parent(s) not in ids)
    split: set[str] = set()
    for service in jaeger.services():
        for t in jaeger.traces(service, limit=10000):
            # Another replay of the same trace names the same request ids (vLLM's gen_ai.request.id
            # holds no replay id): its traces are not this run's splits.
            if any(s["operationName"] == "replay.request" and _tags(s).get("nexuskv.replay_id") != replay_id
                   for s in t["spans"]):
                continue
            for s in t["spans"]:
                label = str(_tags(s).get("nexuskv.request_id") or _tags(s).get("gen_ai.request.id") or "")
                named = re.search(r"(?:^|[^a-z])nexuskv-(r\d{5})(?:$|[^0-9])", label)
                rid = label.removeprefix(replay_id + "/") if label.startswith(replay_id + "/") else (
                    named.group(1) if named else None)
                if rid in trace_ids and t["traceID"] != trace_ids[rid]:
                    split.add(rid)
    return {"requests": len(trace_ids), "traces_found": len(set(trace_ids.values()) & set(found)),
            "traces_of_the_replay": len(found), "orphan_spans": orphans, "split_traces": len(split),
            "requests_with_vllm_span": len(set(trace_ids.values()) & with_engine),
            "spans": sum(len(t["spans"]) for t in found.values())}


def _one(out: Path, requests: int, warmup: int, jaeger: JaegerEndpoints | None) -> dict:
    """One NexusKV run as ``nexuskv replay`` runs it, in a process of its own (OpenTelemetry allows one
    tracer provider per process: an untraced run after a traced one must not inherit it)."""
    cmd = [sys.executable, "-m", "streams.app.cli", "replay", str(TRACE), "--requests", str(requests),
           "--warmup", str(warmup), "--runs", "nexuskv", "--out", str(out), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "NEXUSKV_OTLP_ENDPOINT"}
    if jaeger is not None:
        cmd += ["--trace-to", jaeger.otlp_http_url]
    load_start = round(os.getloadavg()[0], 1)
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
        trace_ids = dict(con.execute("SELECT request_id, trace_id FROM replay_requests WHERE replay_id = ? "
                                     "AND trace_id IS NOT NULL", [fig.replay_id]).fetchall())
    load = round(os.getloadavg()[0], 1)
    n = fig.measured["nexuskv"]
    row = {"replay_id": fig.replay_id, "traced": jaeger is not None, "mean_ttft_s": n.mean_ttft_s,
           "p50_ttft_s": n.p50_ttft_s, "p99_ttft_s": n.p99_ttft_s, "requests": n.requests, "errors": errors,
           "requests_with_trace_id": traced, "load_1m_start": load_start, "load_1m": load}
    if jaeger is not None:
        try:
            row["trace_check"] = _trace_check(jaeger, fig.replay_id, trace_ids)
        except JaegerError as exc:  # the figure stands; the check's failure is recorded, not hidden
            row["trace_check"] = {"error": str(exc)[:500]}
    return row


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
                           jaeger.endpoints if traced else None)
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
               "machine": f"{os.cpu_count()} cores, shared with other work; load_1m per run in runs",
               "load_1m_range": [min(min(r["load_1m_start"], r["load_1m"]) for r in rows), max(max(r["load_1m_start"], r["load_1m"]) for r in rows)],
               "orphan_spans": sum(r["trace_check"].get("orphan_spans", 0) for r in rows if "trace_check" in r),
               "split_traces": sum(r["trace_check"].get("split_traces", 0) for r in rows if "trace_check" in r),
               "trace_checks_failed": sum(1 for r in rows if "error" in r.get("trace_check", {})),
               "failed_requests": sum(r["errors"] for r in rows)}
    if not args.no_write:
        path = write_result("replay_trace_overhead", "mean TTFT of the replay's measured requests, NexusKV run, "
                            "every span exported to a local Jaeger", "s", runs,
                            "the same run without trace export (same pair)", command, details)
        print(f"wrote {path}")
    ratios = sorted(r.ratio for r in runs if r.ratio is not None)
    print(f"per-pair ratios {', '.join(f'{r:.3f}' for r in ratios)}; median {ratios[len(ratios) // 2]:.3f}")


if __name__ == "__main__":
    main()
