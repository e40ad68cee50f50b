"""The figures of one ``nexuskv replay``: both runs side by side, measured, from the decision store.

Every figure is computed over the *measured* requests (the warm-up is reported apart). Per run:
TTFT mean and percentiles, end-to-end latency, prompt tokens the engines computed. Across runs,
per request: the observed Effective Gain (baseline TTFT minus NexusKV TTFT of the same request),
whether the outputs differ (greedy: they must not), and for the NexusKV run the prediction —
predicted EG beside observed, and the relative error of the predicted TTFT, before and after the
warm-up. Plus the NexusKV run's routing decisions by action, tokens reused by source tier, and the
loads the engines' connectors decided: planned vs completed, and tokens loaded per tier
(``replay_loads``). A traced replay (``--trace-to``) also names the traces to open first
(:class:`TracePointers`): each run's slowest measured request, and the request NexusKV improved most.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

__all__ = ["ReplayFigures", "RunFigures", "TracePointers", "TracedRequest", "latest_replay_id", "replay_figures"]


@dataclass(frozen=True, slots=True)
class RunFigures:
    run: str
    requests: int
    errors: int
    mean_ttft_s: float | None
    p50_ttft_s: float | None
    p95_ttft_s: float | None
    p99_ttft_s: float | None
    mean_e2e_s: float | None
    p99_e2e_s: float | None
    prompt_tokens: int
    recomputed_tokens: int


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """One request of a traced replay, and the trace(s) to open in Jaeger (by run)."""

    request_id: str
    seconds: float  # its TTFT (slowest) or its observed EG (most improved)
    trace_ids: dict[str, str]  # run -> trace id


@dataclass(frozen=True, slots=True)
class TracePointers:
    slowest: dict[str, TracedRequest]  # by run: its slowest measured request (TTFT)
    most_improved: TracedRequest | None  # the largest observed EG (baseline TTFT - NexusKV TTFT)


@dataclass(frozen=True, slots=True)
class ReplayFigures:
    replay_id: str
    measured: dict[str, RunFigures]  # by run
    warmup: dict[str, RunFigures]
    compared: int  # measured requests present in both runs
    differing_outputs: int  # over every request present in both runs, warm-up included
    mean_observed_eg_s: float | None
    sum_observed_eg_s: float | None
    sum_predicted_eg_s: float | None
    median_ttft_rel_error_warmup: float | None
    median_ttft_rel_error: float | None  # measured requests that were predicted
    unpredicted: int  # measured requests decided without a cost profile (no prediction to compare)
    median_routing_s: float | None  # the NexusKV run's routing round trip (included in its TTFT)
    actions: dict[str, int]
    reused_tokens_by_tier: dict[str, int]
    transfers_planned: int  # loads the engines' connectors decided (measured requests)
    transfers_completed: int
    transfers_fell_back: int  # recomputed instead: the load failed or came too late
    tokens_loaded_by_tier: dict[str, int]
    traces: TracePointers | None = None  # a traced replay's requests to open first
    tokens_from_others: int = 0  # measured loads' tokens whose state another worker produced
    differing_by_run: dict[str, int] = field(default_factory=dict)  # other run -> outputs unlike NexusKV's
    # Measured requests the router planned to load from a tier whose engine then loaded nothing
    # (the connector found the source did not hold it, or could not be asked: a store gone).
    moves_not_made: int = 0

    def ratio(self, field_name: str, against: str = "baseline") -> float | None:
        """NexusKV / ``against`` (a run of the replay) of a RunFigures field over the measured requests."""
        a, b = self.measured.get("nexuskv"), self.measured.get(against)
        if a is None or b is None:
            return None
        x, y = getattr(a, field_name), getattr(b, field_name)
        return x / y if x is not None and y else None


def latest_replay_id(con: duckdb.DuckDBPyConnection) -> str | None:
    rows = con.execute("SELECT replay_id FROM replay_runs ORDER BY started_at DESC LIMIT 1").fetchall()
    return rows[0][0] if rows else None


def _runs(con: duckdb.DuckDBPyConnection, replay_id: str, phase: str) -> dict[str, RunFigures]:
    rows = con.execute(
        "SELECT run, requests, errors, mean_ttft_s, p50_ttft_s, p95_ttft_s, p99_ttft_s, mean_e2e_s, p99_e2e_s, "
        "prompt_tokens, recomputed_tokens FROM replay_summary WHERE replay_id = ? AND phase = ?",
        [replay_id, phase]).fetchall()
    return {r[0]: RunFigures(*r[:9], int(r[9] or 0), int(r[10] or 0)) for r in rows}


def _traces(con: duckdb.DuckDBPyConnection, replay_id: str) -> TracePointers | None:
    slowest = {
        run: TracedRequest(rid, ttft, {run: tid}) for run, rid, ttft, tid in con.execute(
            "SELECT run, arg_max(request_id, ttft_s), max(ttft_s), arg_max(trace_id, ttft_s) FROM replay_requests "
            "WHERE replay_id = ? AND NOT warmup AND ttft_s IS NOT NULL AND trace_id IS NOT NULL GROUP BY run "
            "ORDER BY run", [replay_id]).fetchall()}
    if not slowest:
        return None
    best = con.execute(
        "SELECT c.request_id, c.observed_eg_s, b.trace_id, n.trace_id FROM replay_comparison c "
        "JOIN replay_requests b ON b.replay_id = c.replay_id AND b.request_id = c.request_id AND b.run = 'baseline' "
        "JOIN replay_requests n ON n.replay_id = c.replay_id AND n.request_id = c.request_id AND n.run = 'nexuskv' "
        "WHERE c.replay_id = ? AND NOT c.warmup AND c.observed_eg_s IS NOT NULL AND n.trace_id IS NOT NULL "
        "ORDER BY c.observed_eg_s DESC, c.seq LIMIT 1", [replay_id]).fetchall()
    improved = None
    if best:
        rid, eg, base, nkv = best[0]
        improved = TracedRequest(rid, eg, {k: v for k, v in (("baseline", base), ("nexuskv", nkv)) if v})
    return TracePointers(slowest, improved)


def replay_figures(con: duckdb.DuckDBPyConnection, replay_id: str | None = None) -> ReplayFigures | None:
    """The figures of ``replay_id`` (the latest replay when None); None when the store holds none."""
    replay_id = replay_id or latest_replay_id(con)
    if replay_id is None:
        return None
    one = con.execute(
        "SELECT count(*) FILTER (WHERE NOT warmup), count(*) FILTER (WHERE NOT outputs_equal), "
        "avg(observed_eg_s) FILTER (WHERE NOT warmup), sum(observed_eg_s) FILTER (WHERE NOT warmup), "
        "sum(predicted_eg_s) FILTER (WHERE NOT warmup), "
        "median(ttft_rel_error) FILTER (WHERE warmup), median(ttft_rel_error) FILTER (WHERE NOT warmup), "
        "count(*) FILTER (WHERE NOT warmup AND NOT coalesce(predicted, false)), "
        "median(routing_s) FILTER (WHERE NOT warmup) "
        "FROM replay_comparison WHERE replay_id = ?", [replay_id]).fetchall()[0]
    decided = ("SELECT d.* FROM replay_requests r JOIN (SELECT * FROM decisions QUALIFY row_number() OVER "
               "(PARTITION BY request_id ORDER BY revision DESC) = 1) d ON d.request_id = r.decision_id "
               "WHERE r.replay_id = ? AND r.run = 'nexuskv' AND NOT r.warmup")
    actions = dict(con.execute(f"SELECT action, count(*) FROM ({decided}) GROUP BY action ORDER BY action",
                               [replay_id]).fetchall())
    tiers = dict(con.execute(f"SELECT coalesce(source_tier, 'none'), sum(reused_tokens) FROM ({decided}) "
                             "WHERE reused_tokens > 0 GROUP BY ALL ORDER BY 1", [replay_id]).fetchall())
    loads = con.execute(
        "SELECT tier, sum(loads_planned), sum(loads_completed), sum(loads_fell_back), sum(tokens_loaded), "
        "sum(tokens_from_others) "
        "FROM replay_loads WHERE replay_id = ? AND run = 'nexuskv' AND phase = 'measured' GROUP BY tier ORDER BY tier",
        [replay_id]).fetchall()
    planned = sum(int(r[1] or 0) for r in loads)
    completed = sum(int(r[2] or 0) for r in loads)
    fell_back = sum(int(r[3] or 0) for r in loads)
    not_made = con.execute(
        "SELECT count(*) FROM replay_requests r JOIN decisions d ON d.request_id = r.decision_id AND d.revision = 0 "
        "WHERE r.replay_id = ? AND r.run = 'nexuskv' AND NOT r.warmup AND d.action IN ('transfer', 'prefetch') "
        "AND d.source_tier IS DISTINCT FROM 'gpu' AND r.engine_request_id IS NOT NULL AND NOT EXISTS ("
        "SELECT 1 FROM decisions e WHERE e.revision = 0 AND e.action IN ('transfer', 'prefetch') "
        "AND (e.request_id = r.engine_request_id OR starts_with(e.request_id, r.engine_request_id || '-')))",
        [replay_id]).fetchall()[0][0]
    differing = dict(con.execute(
        "SELECT o.run, count(*) FILTER (WHERE o.output_digest <> n.output_digest) FROM replay_requests n "
        "JOIN replay_requests o ON o.replay_id = n.replay_id AND o.request_id = n.request_id AND o.run <> n.run "
        "WHERE n.replay_id = ? AND n.run = 'nexuskv' AND n.error IS NULL AND o.error IS NULL GROUP BY o.run "
        "ORDER BY o.run", [replay_id]).fetchall())
    return ReplayFigures(
        replay_id=replay_id, measured=_runs(con, replay_id, "measured"), warmup=_runs(con, replay_id, "warm-up"),
        compared=int(one[0] or 0), differing_outputs=int(one[1] or 0), mean_observed_eg_s=one[2],
        sum_observed_eg_s=one[3], sum_predicted_eg_s=one[4], median_ttft_rel_error_warmup=one[5],
        median_ttft_rel_error=one[6], unpredicted=int(one[7] or 0), median_routing_s=one[8],
        actions={k: int(v) for k, v in actions.items()},
        reused_tokens_by_tier={k: int(v) for k, v in tiers.items()}, transfers_planned=planned,
        transfers_completed=completed, transfers_fell_back=fell_back,
        tokens_loaded_by_tier={str(r[0]): int(r[4] or 0) for r in loads}, traces=_traces(con, replay_id),
        tokens_from_others=sum(int(r[5] or 0) for r in loads),
        differing_by_run={str(k): int(v) for k, v in differing.items()}, moves_not_made=int(not_made or 0))


def _s(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} {unit}".rstrip()


RUN_ORDER = ("baseline", "affinity", "equal-bytes", "nexuskv")
_ROWS = (("requests", "requests"), ("errors", "errors"), ("TTFT mean (s)", "mean_ttft_s"),
         ("TTFT p50 (s)", "p50_ttft_s"), ("TTFT p95 (s)", "p95_ttft_s"), ("TTFT p99 (s)", "p99_ttft_s"),
         ("end-to-end mean (s)", "mean_e2e_s"), ("end-to-end p99 (s)", "p99_e2e_s"),
         ("prompt tokens", "prompt_tokens"), ("prompt tokens recomputed", "recomputed_tokens"))


def _cell(v) -> str:
    return f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else str(v)):>14}"


def _not_made(fig: ReplayFigures) -> str:
    return (f"; {fig.moves_not_made} planned moves not loaded by their engine (recomputed: the source did not "
            "hold them or could not be asked)") if fig.moves_not_made else ""


def _render_arms(fig: ReplayFigures, runs: list[str], others: list[str]) -> str:
    lines = [f"== replay {fig.replay_id}: measured requests (warm-up excluded) =="]
    lines.append(f"{'':28}" + "".join(f"{r:>14}" for r in runs))
    for label, name in _ROWS:
        lines.append(f"{label:28}" + "".join(_cell(getattr(fig.measured[r], name)) for r in runs))
    for name, label in (("mean_ttft_s", "TTFT mean"), ("p99_ttft_s", "TTFT p99")):
        parts = [f"{o} {r:.3f}" for o in others if (r := fig.ratio(name, o)) is not None]
        lines.append(f"NexusKV / each run, {label}: " + ", ".join(parts))
    lines.append("outputs differing from NexusKV's: "
                 + ", ".join(f"{o} {fig.differing_by_run.get(o, 0)}" for o in others))
    loaded = sum(fig.tokens_loaded_by_tier.values())
    lines.append(f"tokens NexusKV loaded: {loaded}, of them produced by another worker: {fig.tokens_from_others}"
                 + (f" ({fig.tokens_from_others / loaded:.0%})" if loaded else "")
                 + f"; transfers completed {fig.transfers_completed} of {fig.transfers_planned} planned"
                 + (f" ({fig.transfers_fell_back} fell back to recompute)" if fig.transfers_fell_back else "")
                 + _not_made(fig))
    lines.append("median relative error of the predicted time from decision to first token: after warm-up "
                 + ("-" if fig.median_ttft_rel_error is None else f"{fig.median_ttft_rel_error:.1%}"))
    if fig.actions:
        lines.append("NexusKV decisions: " + ", ".join(f"{k} {v}" for k, v in fig.actions.items()))
    return "\n".join(lines)


def render(fig: ReplayFigures) -> str:
    """The replay's figures as text: both runs side by side, then the comparison and the prediction."""
    runs = [r for r in RUN_ORDER if r in fig.measured]
    others = [r for r in runs if r != "nexuskv"] if "nexuskv" in runs else []
    if len(others) > 1:  # more arms than one baseline: one table of runs, then NexusKV's ratio to each
        return _render_arms(fig, runs, others)
    lines = [f"== replay {fig.replay_id}: measured requests (warm-up excluded) =="]
    header = f"{'':28}" + "".join(f"{r:>14}" for r in runs) + ("      ratio" if len(runs) == 2 else "")
    lines.append(header)
    rows = [("requests", "requests"), ("errors", "errors"), ("TTFT mean (s)", "mean_ttft_s"),
            ("TTFT p50 (s)", "p50_ttft_s"), ("TTFT p95 (s)", "p95_ttft_s"), ("TTFT p99 (s)", "p99_ttft_s"),
            ("end-to-end mean (s)", "mean_e2e_s"), ("end-to-end p99 (s)", "p99_e2e_s"),
            ("prompt tokens", "prompt_tokens"), ("prompt tokens recomputed", "recomputed_tokens")]
    for label, name in rows:
        vals = [getattr(fig.measured[r], name) for r in runs]
        cells = "".join(f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else str(v)):>14}" for v in vals)
        ratio = fig.ratio(name) if len(runs) == 2 and name not in ("requests", "errors") else None
        lines.append(f"{label:28}{cells}" + (f"{ratio:>11.3f}" if ratio is not None else ""))
    if len(runs) == 2:
        lines.append(f"outputs differing between the runs: {fig.differing_outputs} (of every request in both)")
        lines.append(f"observed EG (baseline TTFT - NexusKV TTFT, same request): mean {_s(fig.mean_observed_eg_s)}, "
                     f"sum {_s(fig.sum_observed_eg_s)}; predicted EG sum {_s(fig.sum_predicted_eg_s)}")
    lines.append("median relative error of the predicted time from decision to first token: warm-up "
                 + ("-" if fig.median_ttft_rel_error_warmup is None else f"{fig.median_ttft_rel_error_warmup:.1%}")
                 + ", after warm-up "
                 + ("-" if fig.median_ttft_rel_error is None else f"{fig.median_ttft_rel_error:.1%}")
                 + (f" ({fig.unpredicted} measured requests decided without a cost profile)" if fig.unpredicted else "")
                 + ("" if fig.median_routing_s is None else
                    f"; routing round trip (in NexusKV's TTFT) median {fig.median_routing_s * 1e3:.0f} ms"))
    if fig.actions:
        lines.append("NexusKV decisions: " + ", ".join(f"{k} {v}" for k, v in fig.actions.items())
                     + "; tokens reused by source tier: "
                     + (", ".join(f"{k} {v}" for k, v in fig.reused_tokens_by_tier.items()) or "none")
                     + f"; transfers completed {fig.transfers_completed} of {fig.transfers_planned} planned"
                     + (f" ({fig.transfers_fell_back} fell back to recompute)" if fig.transfers_fell_back else "")
                     + _not_made(fig)
                     + "; tokens loaded by tier: "
                     + (", ".join(f"{k} {v}" for k, v in fig.tokens_loaded_by_tier.items()) or "none"))
    if fig.traces is not None:
        t = fig.traces
        parts = [f"slowest {run} request {x.request_id} (TTFT {x.seconds:.3f} s): trace {x.trace_ids[run]}"
                 for run, x in t.slowest.items()]
        if t.most_improved is not None:
            x = t.most_improved
            parts.append(f"most improved {x.request_id} (observed EG {x.seconds:.3f} s): "
                         + ", ".join(f"{run} trace {tid}" for run, tid in x.trace_ids.items()))
        lines.append("traces to open (Jaeger: /trace/<id>): " + "; ".join(parts))
    warm = [r for r in ("baseline", "nexuskv") if r in fig.warmup]
    if warm:
        lines.append("warm-up (excluded above): " + "; ".join(
            f"{r} {fig.warmup[r].requests} requests, mean TTFT {_s(fig.warmup[r].mean_ttft_s)}" for r in warm))
    return "\n".join(lines)
