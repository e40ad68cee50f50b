"""The main command's figure, several times: ``nexuskv replay``, vLLM + NexusKV against the baselines.

Each repeat is one ``nexuskv replay benchmarks/data/conversation_trace_head1000.jsonl`` of the
chosen ``--shape`` with the chosen runs (``--arms``), all on the same request stream, engines and
machine:

* ``default`` — 48 requests of the trace's multi-turn conversations, 12 of them warm-up, two vLLM
  CPU engines serving the random ``replay`` Llama in float32; NexusKV saves to each worker's disk.
* ``skewed`` — a few hot conversations behind one shared prefix, their openers one at a time and
  then a burst of their turns (:mod:`streams.app.replay.workload`), with NexusKV saving to the
  shared remote tier (a Mooncake Store started for the run): the shape where state must move.

The runs: ``baseline`` (vLLM alone: prefix caching, least-outstanding routing), ``affinity``
(vLLM behind a router that tracks each engine's cache from vLLM's own KV events, Dynamo's cost
rule), ``equal-bytes`` (vLLM alone with engine caches grown by NexusKV's tier bytes) and
``nexuskv``. **The order of the runs alternates between repeats** (as given, then reversed), so
no arm always runs first on a cold machine. Every ratio is NexusKV / that arm **within one
repeat**; a results file's ratio is the median of the per-repeat ratios (``benchmarks/_result.py``).

Writes, per arm compared, ``benchmarks/results/<prefix>_ttft_mean[_vs_<arm>].json`` and
``..._ttft_p99[...]`` (``<prefix>``: ``replay`` for the default shape, whose files against
``baseline`` keep their names, ``replay_skewed`` for the skewed one), and with NexusKV loads
``<prefix>_moved_share.json`` (tokens loaded from state another worker produced over all tokens
loaded), each with every repeat's figures in ``details``; prints each repeat.

    python -m benchmarks.bench_replay --repeats 3
    python -m benchmarks.bench_replay --shape skewed --arms baseline,affinity,equal-bytes,nexuskv --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import duckdb

from analytics.replay_figures import ReplayFigures, render, replay_figures
from nexuskv.config import Settings
from streams.app.replay.session import ReplayConfig, run_replay
from streams.app.replay.workload import WorkloadShape

from benchmarks._result import Run, write_result

TRACE = Path(__file__).resolve().parent / "data" / "conversation_trace_head1000.jsonl"
ARM_NAMES = {"baseline": "vLLM alone (prefix caching, least-outstanding routing)",
             "affinity": "vLLM behind a KV-event prefix- and load-aware router (Dynamo's cost rule)",
             "equal-bytes": "vLLM alone with engine caches grown by NexusKV's tier bytes (least-outstanding)"}
SKEWED = {"hot": 8, "engine_blocks": 96}  # the skewed shape's defaults here (README, benchmarks/README)


def config_of(shape: str, out: Path, runs: tuple[str, ...]) -> ReplayConfig:
    if shape == "skewed":
        return ReplayConfig(trace=TRACE, out=out, shape=WorkloadShape(hot=SKEWED["hot"]), runs=runs,
                            engine_blocks=SKEWED["engine_blocks"], save_tier="remote", engine_reports=True)
    return ReplayConfig(trace=TRACE, out=out, runs=runs)


def order_of(arms: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The runs of repeat ``repeat``: as given on even repeats, reversed on odd ones."""
    return arms if repeat % 2 == 0 else tuple(reversed(arms))


def _one(config: ReplayConfig, settings: Settings) -> tuple[ReplayFigures, float]:
    outcome = run_replay(config, settings, progress=False, say=lambda _line: None)
    with duckdb.connect(str(outcome.db), read_only=True) as con:
        fig = replay_figures(con, outcome.replay_id)
    assert fig is not None
    return fig, outcome.wall_s


def _row(fig: ReplayFigures, wall_s: float, order: tuple[str, ...]) -> dict:
    row: dict = {"replay_id": fig.replay_id, "wall_s": round(wall_s, 1), "order": list(order)}
    for run, m in fig.measured.items():
        row[run] = {"mean_ttft_s": m.mean_ttft_s, "p50_ttft_s": m.p50_ttft_s, "p99_ttft_s": m.p99_ttft_s,
                    "errors": m.errors, "recomputed_tokens": m.recomputed_tokens}
    row.update({"differing_outputs": max(fig.differing_by_run.values(), default=0),
                "differing_by_run": fig.differing_by_run, "median_ttft_rel_error": fig.median_ttft_rel_error,
                "recomputed_tokens_ratio": fig.ratio("recomputed_tokens", "baseline"),
                "unpredicted": fig.unpredicted, "transfers_planned": fig.transfers_planned,
                "transfers_completed": fig.transfers_completed, "transfers_fell_back": fig.transfers_fell_back,
                "tokens_loaded_by_tier": fig.tokens_loaded_by_tier, "tokens_from_others": fig.tokens_from_others,
                "moves_not_made": fig.moves_not_made, "actions": fig.actions})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="default", choices=["default", "skewed"])
    ap.add_argument("--arms", default="baseline,nexuskv", help="runs of each repeat, in the first repeat's order")
    ap.add_argument("--repeats", "--runs", type=int, default=3, dest="repeats")
    ap.add_argument("--out", type=Path, default=None, help="folder for the replays (default: a temporary one)")
    args = ap.parse_args()
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if "nexuskv" not in arms or len(arms) < 2:
        ap.error("--arms: nexuskv and at least one arm to compare it with")
    settings = Settings.from_env()
    base = args.out or Path(tempfile.mkdtemp(prefix="bench-replay-"))
    rows = []
    for i in range(args.repeats):
        order = order_of(arms, i)
        fig, wall = _one(config_of(args.shape, base / f"repeat{i}", order), settings)
        print(render(fig))
        rows.append(_row(fig, wall, order))
        print(f"-- repeat {i + 1}/{args.repeats} ({', '.join(order)}): {rows[-1]}\n", flush=True)
        time.sleep(2)

    prefix = "replay" if args.shape == "default" else "replay_skewed"
    command = f"python -m benchmarks.bench_replay --shape {args.shape} --arms {','.join(arms)} --repeats {args.repeats}"
    shape = dataclasses.asdict(config_of(args.shape, base, arms).shape)
    details = {"runs": rows, "trace": TRACE.name, "shape": shape,
               "median_ttft_rel_error": statistics.median(r["median_ttft_rel_error"] or 0.0 for r in rows)}
    what = "the default replay" if args.shape == "default" else "the skewed replay"
    for arm in (a for a in arms if a != "nexuskv"):
        suffix = "" if (args.shape == "default" and arm == "baseline") else f"_vs_{arm.replace('-', '_')}"
        for stat, label in (("mean_ttft_s", "mean"), ("p99_ttft_s", "p99")):
            runs = [Run(r["nexuskv"][stat], r[arm][stat]) for r in rows]
            path = write_result(f"{prefix}_ttft_{label}{suffix}",
                                f"{label} TTFT of {what}'s measured requests, vLLM + NexusKV", "s", runs,
                                ARM_NAMES[arm], command, details)
            ratios = [x.ratio for x in runs]
            print(f"NexusKV / {arm}, {label} TTFT: per repeat {', '.join(f'{x:.3f}' for x in ratios)}; "
                  f"median {statistics.median(ratios):.3f} ({path.name})")
    loaded = [sum(r["tokens_loaded_by_tier"].values()) for r in rows]
    if all(loaded):
        runs = [Run(r["tokens_from_others"], n) for r, n in zip(rows, loaded)]
        write_result(f"{prefix}_moved_share", f"tokens NexusKV loaded in {what} from state another worker produced",
                     "tokens", runs, "every token NexusKV loaded", command, details)
        print("moved share per repeat: " + ", ".join(f"{x.ratio:.2f}" for x in runs))


if __name__ == "__main__":
    main()
