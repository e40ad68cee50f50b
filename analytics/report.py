"""``nexuskv report DB``: the key tables of a decision store, and its plots as PNG files.

A store written by ``nexuskv replay`` starts with its two runs side by side
(:mod:`analytics.replay_figures`) and four more plots: ``replay_ttft_cdf.png`` (both runs),
``replay_ttft_predicted_vs_observed.png`` (the NexusKV run's predicted time to first token against
what it measured: like with like), ``replay_observed_gain.png`` (baseline TTFT minus NexusKV TTFT
per request, over time: no diagonal, since the planner's EG is a gain over recomputing on its
worker, not over the baseline run's vLLM prefix cache) and ``replay_prediction_error.png``.

Tables printed: reuse rates (logical, physical, ready, useful), Effective Gain by action, tier,
workload and tenant, prediction error, and the fallback and rejection reasons. Plots written:

* ``eg_distribution.png`` — predicted and observed Effective Gain per decision;
* ``ttft_cdf.png`` — TTFT CDF per policy (from the harness's ``harness_requests`` table when the
  file holds a harness run; otherwise the observed TTFT of the decisions);
* ``prediction_error.png`` — observed minus predicted TTFT;
* ``bandwidth_vs_size.png`` — transfer bandwidth against transfer size, per link.

The file is opened read-only, so point it at a snapshot (or at the file once the sink stopped).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

__all__ = ["TABLE_QUERIES", "render_tables", "write_plots", "report"]

TABLE_QUERIES: dict[str, str] = {
    "reuse rates": "SELECT * FROM reuse_rates",
    "Effective Gain by action": "SELECT * FROM eg_by_action",
    "Effective Gain by tier": "SELECT * FROM eg_by_tier",
    "Effective Gain by workload": "SELECT * FROM eg_by_workload",
    "Effective Gain by tenant": "SELECT * FROM eg_by_tenant",
    "prediction error": "SELECT * FROM prediction_error",
    "fallback and rejection reasons": "SELECT * FROM fallback_reasons LIMIT 15",
}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 48 else text[:45] + "..."


def _table(title: str, cols: Sequence[str], rows: Sequence[tuple]) -> str:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = [f"== {title} ==", "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells] or ["(no rows)"]
    return "\n".join(lines)


def render_tables(con: duckdb.DuckDBPyConnection) -> str:
    out = []
    for title, sql in TABLE_QUERIES.items():
        cur = con.execute(sql)
        out.append(_table(title, [d[0] for d in cur.description], cur.fetchall()))
    return "\n\n".join(out)


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?",
                            [name]).fetchall()[0][0])


def _plotting(out_dir: Path) -> tuple[Any, list[Path], Any]:
    """matplotlib (headless), the list of files written, and ``save(fig, name)`` that writes one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    return plt, paths, save


def write_plots(con: duckdb.DuckDBPyConnection, out_dir: Path) -> list[Path]:
    """Write the four PNG plots under ``out_dir``; returns their paths."""
    plt, paths, save = _plotting(out_dir)

    rows = con.execute("SELECT eg_s, observed_eg_s FROM request_outcomes").fetchall()
    fig, ax = plt.subplots(figsize=(6, 4))
    predicted = [r[0] for r in rows]
    observed = [r[1] for r in rows if r[1] is not None]
    ax.hist(predicted, bins=40, alpha=0.6, label=f"predicted (n={len(predicted)})")
    if observed:
        ax.hist(observed, bins=40, alpha=0.6, label=f"observed (n={len(observed)})")
    ax.axvline(0, color="black", lw=0.8)
    ax.set(xlabel="Effective Gain (s)", ylabel="decisions", title="Effective Gain per decision")
    ax.legend()
    save(fig, "eg_distribution.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    if _has_table(con, "harness_requests"):
        series = con.execute("SELECT policy, list(ttft_s ORDER BY ttft_s) FROM harness_requests "
                             "GROUP BY policy ORDER BY policy").fetchall()
    else:
        series = con.execute("SELECT 'observed', list(observed_ttft_s ORDER BY observed_ttft_s) "
                             "FROM request_outcomes WHERE observed_ttft_s IS NOT NULL").fetchall()
    for policy, values in series:
        values = values or []
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=policy)
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF per policy")
    ax.legend(fontsize=7)
    save(fig, "ttft_cdf.png")

    rows = con.execute("SELECT t_with_reuse_s, observed_ttft_s - t_with_reuse_s FROM request_outcomes "
                       "WHERE observed_ttft_s IS NOT NULL").fetchall()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r[0] for r in rows], [r[1] for r in rows], s=6)
    ax.axhline(0, color="black", lw=0.8)
    ax.set(xlabel="predicted TTFT (s)", ylabel="observed - predicted (s)", title="Prediction error")
    save(fig, "prediction_error.png")

    rows = con.execute("SELECT link, bytes, bytes_per_s FROM transfer_bandwidth WHERE bytes_per_s IS NOT NULL").fetchall()
    fig, ax = plt.subplots(figsize=(6, 4))
    for link in sorted({r[0] for r in rows}):
        pts = [(r[1], r[2] / 1e9) for r in rows if r[0] == link]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, label=link)
    ax.set(xscale="log", xlabel="transfer size (bytes)", ylabel="bandwidth (GB/s)",
           title="Bandwidth against transfer size, per tier link")
    if rows:
        ax.legend(fontsize=7)
    save(fig, "bandwidth_vs_size.png")
    return paths


def write_replay_plots(con: duckdb.DuckDBPyConnection, out_dir: Path, replay_id: str) -> list[Path]:
    """The replay's plots: TTFT CDFs of both runs, the NexusKV run's predicted vs observed TTFT, the
    observed gain over the baseline run per request, prediction error over time."""
    plt, paths, save = _plotting(out_dir)

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, values in con.execute(
            "SELECT run, list(ttft_s ORDER BY ttft_s) FROM replay_requests WHERE replay_id = ? AND NOT warmup "
            "AND ttft_s IS NOT NULL GROUP BY run ORDER BY run", [replay_id]).fetchall():
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{run} (n={len(values)})")
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF: vLLM alone vs vLLM + NexusKV")
    ax.legend(fontsize=8)
    save(fig, "replay_ttft_cdf.png")

    # Like with like. The planner predicts the NexusKV run's own time to first token (along the path it
    # chose, from the decision on); that is compared with what the NexusKV run measured, on a diagonal.
    # Its predicted EG is a gain over recomputing on its worker, while the baseline run is vLLM alone
    # with its own prefix cache on another engine: a different counterfactual, so the observed gain
    # over the baseline run is shown on its own, per request, with no diagonal against a prediction.
    rows = con.execute("SELECT predicted_ttft_s, nexuskv_ttft_s - coalesce(routing_s, 0), warmup "
                       "FROM replay_comparison WHERE replay_id = ? AND predicted_ttft_s IS NOT NULL "
                       "AND nexuskv_ttft_s IS NOT NULL", [replay_id]).fetchall()
    fig, ax = plt.subplots(figsize=(5, 5))
    for warm, label in ((True, "warm-up"), (False, "measured")):
        pts = [(r[0], r[1]) for r in rows if r[2] is warm]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, label=f"{label} (n={len(pts)})")
    if rows:
        lo = min(min(r[0], r[1]) for r in rows)
        hi = max(max(r[0], r[1]) for r in rows)
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.set(xlabel="predicted time from decision to first token (s)",
           ylabel="observed, NexusKV run (s)", title="NexusKV run: predicted vs observed TTFT")
    ax.legend(fontsize=8)
    save(fig, "replay_ttft_predicted_vs_observed.png")

    rows = con.execute("SELECT arrival_s, observed_eg_s, warmup FROM replay_comparison WHERE replay_id = ? "
                       "AND observed_eg_s IS NOT NULL ORDER BY seq", [replay_id]).fetchall()
    fig, ax = plt.subplots(figsize=(6, 4))
    for warm, label in ((True, "warm-up"), (False, "measured")):
        pts = [(r[0], r[1]) for r in rows if r[2] is warm]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, label=f"{label} (n={len(pts)})")
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set(xlabel="arrival (s after the first request)",
           ylabel="baseline TTFT - NexusKV TTFT (s)", title="Observed gain over the baseline run, per request")
    ax.legend(fontsize=8)
    save(fig, "replay_observed_gain.png")

    rows = con.execute("SELECT arrival_s, ttft_rel_error, warmup FROM replay_comparison WHERE replay_id = ? "
                       "AND ttft_rel_error IS NOT NULL ORDER BY seq", [replay_id]).fetchall()
    fig, ax = plt.subplots(figsize=(6, 4))
    for warm, label in ((True, "warm-up"), (False, "measured")):
        pts = [(r[0], r[1]) for r in rows if r[2] is warm]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, label=label)
    ax.set(xlabel="arrival (s after the first request)", ylabel="|predicted - observed| / observed TTFT",
           title="Prediction error over time (NexusKV run)")
    ax.legend(fontsize=8)
    save(fig, "replay_prediction_error.png")
    return paths


def report(db: Path, out_dir: Path) -> tuple[str, list[Path]]:
    """The printed tables and the written plots of the decision store at ``db`` (read-only).

    A store holding a ``nexuskv replay`` starts with the latest replay's side-by-side figures.
    """
    from analytics.replay_figures import render, replay_figures

    con = duckdb.connect(str(db), read_only=True)
    try:
        text, plots = render_tables(con), write_plots(con, out_dir)
        figures = replay_figures(con) if _has_table(con, "replay_runs") else None
        if figures is not None:
            text = render(figures) + "\n\n" + text
            plots = write_replay_plots(con, out_dir, figures.replay_id) + plots
        return text, plots
    finally:
        con.close()
