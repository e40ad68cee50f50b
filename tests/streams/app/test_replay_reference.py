"""``nexuskv replay``, end to end through the embedded broker: engines, index worker, calibration,
planner, executors and sink; the DuckDB file holds one decision per request and every view answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analytics.schema import ALL_VIEWS, REPLAY_VIEWS
from streams.app.replay_reference import select_requests
from streams.app.traces import load_trace

from benchmarks.trace_events import CONVERSATION_SLICE


def test_conversation_selection_keeps_every_turn_in_time_order():
    trace = load_trace(CONVERSATION_SLICE)
    picked = select_requests(trace, 1000, conversations=8)
    keys = {r.hash_ids[1] for r in picked}
    assert len(keys) == 8
    assert [r.timestamp_ms for r in picked] == sorted(r.timestamp_ms for r in picked)
    assert all(sum(1 for r in picked if r.hash_ids[1] == k) >= 2 for k in keys)
    assert select_requests(trace, 5) == trace[:5]


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
    expected = len(select_requests(load_trace(CONVERSATION_SLICE), 200, conversations=12))
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
