"""``nexuskv replay --engine reference``: the replay's engine choice, and its run end to end through the
embedded broker (engines, index worker, calibration, planner, executors and sink); the DuckDB file
holds one decision per request and every view answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analytics.schema import ALL_VIEWS, REPLAY_VIEWS
from nexuskv.errors import ConfigError
from streams.app.replay.session import ReplayConfig
from streams.app.replay.workload import WorkloadShape, build_workload
from streams.app.traces import load_trace

from benchmarks.trace_events import CONVERSATION_SLICE


def test_the_engine_chooses_the_runs_and_the_reference_takes_only_its_own(tmp_path):
    vllm = ReplayConfig(trace=tmp_path / "t.jsonl", out=tmp_path)
    ref = ReplayConfig(trace=tmp_path / "t.jsonl", out=tmp_path, engine="reference", engine_blocks=48)
    assert vllm.runs == ("baseline", "nexuskv") and ref.runs == ("nexuskv",)  # 48 blocks hold no vLLM prompt
    for bad, field in (({"engine": "sglang"}, "engine"), ({"engine": "reference", "runs": ("baseline",)}, "runs"),
                       ({"engine": "reference", "variant": "mamba"}, "variant"),
                       ({"engine": "reference", "trace_to": "http://127.0.0.1:4318"}, "trace_to")):
        with pytest.raises(ConfigError) as err:
            ReplayConfig(trace=tmp_path / "t.jsonl", out=tmp_path, **bad)
        assert err.value.field == field


def test_the_reference_engine_replays_the_same_workload_below_its_vocabulary(tmp_path):
    trace = load_trace(CONVERSATION_SLICE)
    shape = WorkloadShape(max_requests=60, conversations=8)
    vllm = build_workload(trace, ReplayConfig(trace=CONVERSATION_SLICE, out=tmp_path, shape=shape).workload_shape)
    config = ReplayConfig(trace=CONVERSATION_SLICE, out=tmp_path, shape=shape, engine="reference")
    ref = build_workload(trace, config.workload_shape)
    assert config.workload_shape.vocab == 256 < shape.vocab  # the reference model's vocabulary
    assert [(r.seq, r.arrival_s, r.conversation, len(r.tokens)) for r in ref.requests] == [
        (r.seq, r.arrival_s, r.conversation, len(r.tokens)) for r in vllm.requests]
    assert all(4 <= t < 256 for r in ref.requests for t in r.tokens)
    assert len({r.conversation for r in ref.requests}) == 8


@pytest.mark.tansu
@pytest.mark.slow
def test_short_reference_replay_end_to_end(tmp_path):
    out = tmp_path / "replay"
    env = {k: v for k, v in os.environ.items() if k != "NEXUSKV_BROKER"}  # the embedded broker
    done = subprocess.run(
        [sys.executable, "-m", "streams.app.cli", "replay", str(CONVERSATION_SLICE), "--engine", "reference",
         "--conversations", "12", "--workers", "2", "--gpu-pages", "48", "--time-scale", "30", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = len(build_workload(load_trace(CONVERSATION_SLICE), WorkloadShape(max_requests=200,
                                                                                conversations=12)).requests)
    assert f"{expected}/{expected}" in done.stderr  # the progress bar (the README's command shows it) ran to the end
    con = duckdb.connect(str(out / "decisions.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(DISTINCT request_id) FROM decisions").fetchall()[0][0] == expected
        for view in (v for v in ALL_VIEWS if v not in REPLAY_VIEWS):  # one run: nothing to compare
            assert con.execute(f"SELECT count(*) FROM {view}").fetchall()[0][0] > 0, f"view {view} is empty"
        prefills = con.execute("SELECT count(DISTINCT request_id) FROM observations WHERE kind = 'prefill'").fetchall()
        assert prefills[0][0] == expected  # every request's outcome was observed and joined
        actions = dict(con.execute("SELECT action, count(*) FROM request_outcomes GROUP BY 1").fetchall())
        assert sum(actions.values()) == expected and len(actions) >= 2
    finally:
        con.close()
    assert "== reuse rates ==" in done.stdout
    assert sorted(p.name for p in (out / "report").glob("*.png")) == [
        "bandwidth_vs_size.png", "eg_distribution.png", "prediction_error.png", "ttft_cdf.png"]
    assert (out / "logs" / "planner.log").is_file()
