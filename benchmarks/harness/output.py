"""Where a harness run goes: a DuckDB file, the record as JSON, the result file, and the printed tables.

DuckDB tables (``harness.duckdb``):

* ``harness_requests`` — one row per (trial, policy, request): every field of
  :class:`~.simulator.Row` (``policy, workload, request_id, ttft_s, eg_s, reused_tokens,
  prompt_tokens, ...``). ``nexuskv report`` plots the TTFT CDF per policy from it.
* ``harness_summary`` — one row per (trial, policy): the figures of :class:`~.metrics.Summary`.
* ``harness_record`` — the §10.6 record of the run, as JSON text, one row.
* the decision store's own tables and views (:mod:`analytics.schema`), holding NexusKV's first
  trial as the pipeline's sink would: its decisions, transfer results and the engines' prefill
  observations (simulated times). ``nexuskv report harness.duckdb`` prints and plots them.

The result file ``benchmarks/results/harness_eg_vs_oracle.json`` holds NexusKV's aggregate EG
as a fraction of the oracle's on the same states (median over trials; :mod:`.metrics`); its
baseline is the best other policy's fraction.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import duckdb
import pyarrow as pa

from analytics.store import DecisionStore

from benchmarks._result import Run, write_result
from benchmarks.harness.metrics import Summary
from benchmarks.harness.run import HarnessResult
from benchmarks.harness.simulator import ROW_FIELDS, Row

__all__ = ["write_duckdb", "write_artifacts", "write_result_file", "render", "goals", "GOALS"]

#: The harness's goals (issue 7): checked, and printed, with every run.
GOALS = {
    "eg_vs_oracle": 0.95,  # NexusKV's aggregate EG at least 95% of the oracle's (on the same states)
    "control_overhead": 0.01,  # at most 1% mean-TTFT overhead on the no-reuse control
}

_ROW_TYPES = {f: pa.float64() for f in ROW_FIELDS}
_ROW_TYPES.update({f: pa.string() for f in ("policy", "workload", "request_id", "tenant", "worker", "baseline_worker",
                                            "action", "source", "link", "fallback")})
_ROW_TYPES.update({f: pa.int64() for f in ("trial", "prompt_tokens", "output_tokens", "logical_tokens",
                                           "physical_tokens", "reused_tokens", "useful_tokens", "unsafe_tokens",
                                           "moved_tokens", "moved_bytes")})
_ROW_TYPES["failed"] = pa.bool_()


def _rows_table(rows: list[Row]) -> pa.Table:
    columns = list(zip(*rows)) if rows else [[] for _ in ROW_FIELDS]
    return pa.table({f: pa.array(list(col), type=_ROW_TYPES[f]) for f, col in zip(ROW_FIELDS, columns)})


def _summary_table(result: HarnessResult) -> pa.Table:
    names = [f.name for f in fields(Summary)]
    data: dict[str, list] = {"trial": []}
    data.update({n: [] for n in names})
    for trial, by_policy in enumerate(result.trials):
        for s in by_policy.values():
            data["trial"].append(trial)
            for n in names:
                data[n].append(getattr(s, n))
    return pa.table(data)


def write_duckdb(result: HarnessResult, path: Path) -> Path:
    """Write the run's tables to a fresh DuckDB file at ``path`` (replacing one already there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, path.with_name(path.name + ".wal")):
        stale.unlink(missing_ok=True)
    store = DecisionStore(path)
    try:
        rec = result.store_records
        store.write_all(rec.get("decisions", ()), rec.get("results", ()), rec.get("observations", ()))
    finally:
        store.close()
    con = duckdb.connect(str(path))
    try:
        requests = _rows_table(result.rows)
        summary = _summary_table(result)
        con.register("requests_arrow", requests)
        con.execute("CREATE TABLE harness_requests AS SELECT * FROM requests_arrow")
        con.unregister("requests_arrow")
        con.register("summary_arrow", summary)
        con.execute("CREATE TABLE harness_summary AS SELECT * FROM summary_arrow")
        con.unregister("summary_arrow")
        con.execute("CREATE TABLE harness_record (record JSON)")
        con.execute("INSERT INTO harness_record VALUES (?)", [json.dumps(result.record)])
    finally:
        con.close()
    return path


def write_artifacts(result: HarnessResult, out: Path) -> dict[str, str]:
    """The DuckDB file, ``record.json`` and ``summary.json`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    db = write_duckdb(result, out / "harness.duckdb")
    (out / "record.json").write_text(json.dumps(result.record, indent=2) + "\n", encoding="utf-8")
    summary = {"trials": [{p: s.as_dict() for p, s in t.items()} for t in result.trials],
               "control": result.control, "counters": result.counters}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    result.files.update(duckdb=str(db), record=str(out / "record.json"), summary=str(out / "summary.json"))
    return result.files


def goals(result: HarnessResult) -> dict[str, dict]:
    """Each goal, its measured value and whether it is met (medians over trials)."""
    out: dict[str, dict] = {}
    frac = result.median("nexuskv", "eg_vs_oracle")
    out["eg_vs_oracle"] = {"goal": f">= {GOALS['eg_vs_oracle']}", "value": frac,
                           "met": frac is not None and frac >= GOALS["eg_vs_oracle"]}
    nkv = result.median("nexuskv", "ttft_mean_s")
    for rival in ("dynamo", "llm-d"):
        if rival in result.config.policies:
            theirs = result.median(rival, "ttft_mean_s")
            out[f"ttft_mean_below_{rival}"] = {"goal": f"mean TTFT < {rival}'s", "value": nkv, "theirs": theirs,
                                               "met": nkv is not None and theirs is not None and nkv < theirs}
    if result.control is not None:
        over = result.control["overhead"]
        out["control_overhead"] = {"goal": f"<= {GOALS['control_overhead']:.0%}", "value": over,
                                   "met": over <= GOALS["control_overhead"]}
    return out


def write_result_file(result: HarnessResult, command: str, *, results_dir: Path | None = None) -> Path:
    """``harness_eg_vs_oracle``: NexusKV's EG over the oracle's; baseline, the best other policy's."""
    value = result.median("nexuskv", "eg_vs_oracle")
    best = result.best_other()
    if value is None or best is None:
        raise ValueError("the run has no oracle gain to compare with (nothing could be reused)")
    per_policy = {p: {k: result.median(p, k) for k in ("eg_vs_oracle", "eg_vs_oracle_run", "eg_s", "ttft_mean_s",
                                                       "ttft_p50_s", "ttft_p99_s", "throughput_rps", "utilization",
                                                       "logical_rate",
                                                       "physical_rate", "reused_rate", "useful_rate")}
                  for p in result.config.runs}
    details = {"workload": result.workload.name, "requests": len(result.workload.requests),
               "trials": result.config.trials, "policies": per_policy, "goals": goals(result),
               "control": result.control, "record": result.record}
    # one run per trial: NexusKV's figure and the best other policy's, both from that trial's seeds
    runs = [Run(t["nexuskv"].eg_vs_oracle, t[best[0]].eg_vs_oracle) for t in result.trials
            if t["nexuskv"].eg_vs_oracle is not None and t[best[0]].eg_vs_oracle is not None]
    details["load_average"] = os.getloadavg()
    return write_result("harness_eg_vs_oracle", "NexusKV's aggregate realized Effective Gain as a fraction of the "
                        "oracle's on the same states (simulated cluster, same workload and seeds)", "fraction", runs, f"best other policy: {best[0]}", command, details, results_dir=results_dir)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(result: HarnessResult) -> str:
    """The side-by-side table (medians over trials), the control, and the goals."""
    cfg = result.config
    wl = result.workload
    lines = [f"harness: {wl.name}, {len(wl.requests)} requests ({wl.arrival}), {cfg.workers} workers of "
             f"{cfg.profile}, {cfg.model}, truth '{cfg.drift}', {cfg.trials} trial(s), seed {cfg.seed}",
             f"{'policy':24s} {'TTFT mean':>9s} {'p50':>7s} {'p99':>7s} {'req/s':>6s} {'util':>5s} {'logical':>7s} "
             f"{'physical':>8s} {'useful':>6s} {'EG sum s':>9s} {'EG/oracle':>9s} {'/orc.run':>8s} {'fallbk':>6s} "
             f"{'plan ms':>7s}"]
    for p in cfg.runs:
        m = lambda a, p=p: result.median(p, a)  # noqa: E731 - a local shorthand for the table
        lines.append(
            f"{p:24s} {_f(m('ttft_mean_s'), '9.3f')} {_f(m('ttft_p50_s'), '7.3f')} {_f(m('ttft_p99_s'), '7.3f')} "
            f"{_f(m('throughput_rps'), '6.2f')} {_f(m('utilization'), '5.2f')} {_f(m('logical_rate'), '7.3f')} "
            f"{_f(m('physical_rate'), '8.3f')} "
            f"{_f(m('useful_rate'), '6.3f')} {_f(m('eg_s'), '9.2f')} {_f(m('eg_vs_oracle'), '9.3f')} "
            f"{_f(m('eg_vs_oracle_run'), '8.3f')} {_f(m('fallbacks'), '6.0f')} {_f(m('plan_mean_ms'), '7.3f')}")
    if result.control is not None:
        c = result.control
        lines.append(f"no-reuse control ({c['requests']} requests): mean TTFT recompute "
                     f"{c['recompute_ttft_mean_s']:.4f} s, nexuskv {c['nexuskv_ttft_mean_s']:.4f} s: overhead "
                     f"{c['overhead']:+.3%} (p50 {c['overhead_p50']:+.3%}, p99 {c['overhead_p99']:+.3%}; plan "
                     f"{c['nexuskv_plan_mean_ms']:.3f} ms mean)")
    for name, g in goals(result).items():
        value = g["value"]
        shown = "-" if value is None else (f"{value:.3f}" if name != "control_overhead" else f"{value:+.3%}")
        extra = f" vs {g['theirs']:.3f}" if "theirs" in g and g["theirs"] is not None else ""
        lines.append(f"goal {name}: {g['goal']}: {shown}{extra} -> {'met' if g['met'] else 'NOT met'}")
    lines.append(f"wall {result.wall_s:.1f} s")
    return "\n".join(lines)
