"""The main command's figure, several times: ``nexuskv replay``'s default replay, vLLM alone vs vLLM + NexusKV.

Each run is the default ``nexuskv replay benchmarks/data/conversation_trace_head1000.jsonl`` (48
requests of the trace's multi-turn conversations, 12 of them warm-up, two vLLM CPU engines serving
the random ``replay`` Llama in float32): the baseline (vLLM's own prefix caching behind a
least-outstanding load balancer) and the NexusKV run (the same engines with NexusKV's connector,
bridges, index, sidecar, calibration and planner routing) on the same request stream. Figures are
over the measured requests, both runs measured in the same replay; the ratio is NexusKV / vLLM alone.

Writes ``benchmarks/results/replay_ttft_mean.json`` (mean TTFT, the goal's figure: <= 0.7x) and
``replay_ttft_p99.json`` (p99, goal: no worse), each with every run's figures in ``details``
(medians across runs are the values), and prints each run.

    python -m benchmarks.bench_replay --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import duckdb

from analytics.replay_figures import ReplayFigures, render, replay_figures
from nexuskv.config import Settings
from streams.app.replay.session import ReplayConfig, run_replay

from benchmarks._result import Run, write_result

TRACE = Path(__file__).resolve().parent / "data" / "conversation_trace_head1000.jsonl"


def _one(out: Path, settings: Settings) -> tuple[ReplayFigures, float]:
    outcome = run_replay(ReplayConfig(trace=TRACE, out=out), settings, progress=False, say=lambda _line: None)
    with duckdb.connect(str(outcome.db), read_only=True) as con:
        fig = replay_figures(con, outcome.replay_id)
    assert fig is not None
    return fig, outcome.wall_s


def _row(fig: ReplayFigures, wall_s: float) -> dict:
    b, n = fig.measured["baseline"], fig.measured["nexuskv"]
    return {"replay_id": fig.replay_id, "wall_s": round(wall_s, 1),
            "baseline_mean_ttft_s": b.mean_ttft_s, "nexuskv_mean_ttft_s": n.mean_ttft_s,
            "baseline_p99_ttft_s": b.p99_ttft_s, "nexuskv_p99_ttft_s": n.p99_ttft_s,
            "baseline_p50_ttft_s": b.p50_ttft_s, "nexuskv_p50_ttft_s": n.p50_ttft_s,
            "recomputed_tokens_ratio": fig.ratio("recomputed_tokens"), "differing_outputs": fig.differing_outputs,
            "median_ttft_rel_error": fig.median_ttft_rel_error, "unpredicted": fig.unpredicted,
            "transfers_planned": fig.transfers_planned, "transfers_completed": fig.transfers_completed,
            "tokens_loaded_by_tier": fig.tokens_loaded_by_tier}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="folder for the replays (default: a temporary one)")
    args = ap.parse_args()
    settings = Settings.from_env()
    base = args.out or Path(tempfile.mkdtemp(prefix="bench-replay-"))
    rows = []
    for i in range(args.runs):
        fig, wall = _one(base / f"run{i}", settings)
        print(render(fig))
        rows.append(_row(fig, wall))
        print(f"-- run {i + 1}/{args.runs}: {rows[-1]}\n", flush=True)
        time.sleep(2)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    command = f"python -m benchmarks.bench_replay --runs {args.runs}"
    details = {"runs": rows, "trace": TRACE.name, "median_ttft_rel_error": med("median_ttft_rel_error"),
               "differing_outputs": [r["differing_outputs"] for r in rows]}
    write_result("replay_ttft_mean", "mean TTFT of the default replay's measured requests, vLLM + NexusKV", "s", [Run(med("nexuskv_mean_ttft_s"), med("baseline_mean_ttft_s"))], "vLLM alone (prefix caching, least-outstanding routing)", command, details)
    write_result("replay_ttft_p99", "p99 TTFT of the default replay's measured requests, vLLM + NexusKV", "s", [Run(med("nexuskv_p99_ttft_s"), med("baseline_p99_ttft_s"))], "vLLM alone (prefix caching, least-outstanding routing)", command, details)
    mean_n, mean_b = med("nexuskv_mean_ttft_s"), med("baseline_mean_ttft_s")
    p99_n, p99_b = med("nexuskv_p99_ttft_s"), med("baseline_p99_ttft_s")
    print(f"median over {args.runs} runs: mean TTFT {mean_n:.3f} s vs {mean_b:.3f} s ({mean_n / mean_b:.3f}x); "
          f"p99 {p99_n:.3f} s vs {p99_b:.3f} s; median prediction error {med('median_ttft_rel_error'):.1%}")


if __name__ == "__main__":
    main()
