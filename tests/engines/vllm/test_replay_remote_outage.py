"""The shared remote tier killed mid-replay: requests recompute, outputs stay identical, the fallbacks counted.

``nexuskv replay --shape skewed`` on real vLLM, NexusKV saving to the shared remote tier: a
Mooncake Store this test starts and names in ``NEXUSKV_REMOTE_TIER`` (so the replay uses it and
the test holds its processes). Once NexusKV's run has served its warm-up, the hot conversations'
openers and the first turns of their burst (read from the replay's progress bar), the test kills
both store processes (master and memory segment) with SIGKILL. Asserted:

* the replay finishes (exit 0) and no request of either run failed, many of them after the kill;
* the outputs are identical to vLLM alone's, and nothing was loaded from the store once it was gone;
* the report counts it: the router still planned moves from the store (the index named its
  blocks), and each is in the report as a planned move its engine did not load (recomputed), or
  as a load that fell back; every load the connectors planned completed or fell back.

What this found: the connector's probe of the remote tier raised on vLLM's scheduler thread and
killed the engine core (EngineDeadError for every later request); with that fixed, every probe
waited out the backend's 10 s deadline (about 10 s TTFT for each request after the kill). The
probe now has a 1 s deadline and a dead store opens its breaker (``nexuskv.dataplane.deadlines``):
one stalled step per engine, then calls fail at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from analytics.replay_figures import replay_figures
from nexuskv.dataplane.remote_store import parse_store_address
from streams.remote_tier import RemoteTierStore, local_address

from benchmarks.trace_events import CONVERSATION_SLICE

pytestmark = [pytest.mark.vllm, pytest.mark.tansu, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
HOT = 8
KILL_AFTER = 24  # NexusKV requests served when the store is killed: 12 warm-up, 8 openers, 4 of the burst


def _served(log: Path, run: str) -> int:
    """Requests ``run`` has served so far, from the replay's progress bar (tqdm, on stderr)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    done = re.findall(rf"{run}:\s+\d+%\|[^|]*\|\s*(\d+)/\d+", text)
    return int(done[-1]) if done else 0


def _kill_after(store: RemoteTierStore, log: Path, proc: subprocess.Popen, served: int, timeout_s: float) -> float:
    """SIGKILL the store's processes once NexusKV's run has served ``served`` requests; when."""
    deadline = time.monotonic() + timeout_s
    while _served(log, "nexuskv") < served:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the NexusKV run did not serve {served} requests:\n"
                                 + log.read_text(errors="replace")[-3000:])
        time.sleep(0.1)
    for pid in store.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return time.time()


def test_remote_store_killed_mid_replay_recomputes_with_identical_outputs(tmp_path):
    out = tmp_path / "replay"
    address = local_address()
    store = RemoteTierStore(parse_store_address(address), 256 << 20, log_dir=tmp_path).start(60.0)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEXUSKV_DATA_DIR": str(tmp_path / "data"),
           "NEXUSKV_METRICS_PORT": "0", "NEXUSKV_REMOTE_TIER": address}
    for name in ("NEXUSKV_BROKER", "NEXUSKV_OTLP_ENDPOINT"):  # its own embedded broker, no trace export
        env.pop(name, None)
    log = tmp_path / "replay.log"
    cmd = [sys.executable, "-m", "streams.app.cli", "replay", str(CONVERSATION_SLICE), "--shape", "skewed",
           "--hot", str(HOT), "--save-tier", "remote", "--runs", "baseline,nexuskv", "--engine-blocks", "96",
           "--max-output-tokens", "2", "--out", str(out)]
    try:
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
            try:
                objects_before = len(store.admin.object_names())
                killed_at = _kill_after(store, log, proc, KILL_AFTER, timeout_s=600)
                code = proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        store.stop()
    output = log.read_text(errors="replace")
    assert code == 0, output[-4000:]

    with duckdb.connect(str(out / "decisions.duckdb"), read_only=True) as con:
        fig = replay_figures(con)
        rows = con.execute("SELECT run, error FROM replay_requests WHERE error IS NOT NULL").fetchall()
        # NexusKV's requests whose first token came after the kill, and the router's planned loads
        # from the remote tier among those sent after it.
        later = con.execute("SELECT count(*) FROM replay_requests WHERE run = 'nexuskv' AND sent_at + ttft_s > ?",
                            [killed_at]).fetchall()[0][0]
        planned_after = con.execute(
            "SELECT count(*) FROM replay_requests r JOIN decisions d ON d.request_id = r.decision_id "
            "AND d.revision = 0 WHERE r.run = 'nexuskv' AND r.sent_at > ? AND d.action IN ('transfer', 'prefetch') "
            "AND d.source_tier = 'remote'", [killed_at + 1.0]).fetchall()[0][0]
        loaded_after = con.execute(
            "SELECT coalesce(sum(o.pages), 0) FROM observations o JOIN replay_requests r ON r.run = 'nexuskv' "
            "AND (o.request_id = r.engine_request_id OR starts_with(o.request_id, r.engine_request_id || '-')) "
            "WHERE o.kind = 'transfer' AND o.ok AND o.source_tier = 'remote' AND r.sent_at > ?",
            [killed_at + 1.0]).fetchall()[0][0]
        loaded_remote = fig.tokens_loaded_by_tier.get("remote", 0) if fig is not None else 0
    assert fig is not None
    print(f"killed after {KILL_AFTER} NexusKV requests served ({later} first tokens after it); remote loads "
          f"planned by the router after it {planned_after}, blocks loaded after it {loaded_after}; report: "
          f"{fig.transfers_completed} of {fig.transfers_planned} loads completed, {fig.transfers_fell_back} fell "
          f"back, {fig.moves_not_made} planned moves not loaded; remote tokens loaded {loaded_remote}")
    assert rows == [], rows[:5]  # no request of either run failed
    assert later >= 10, later  # the kill was mid-run
    assert fig.differing_by_run == {"baseline": 0}, fig.differing_by_run  # recompute gives the same tokens
    assert objects_before == 0 and loaded_remote > 0  # the store was in use before the kill ...
    assert loaded_after == 0  # ... and nothing was loaded from it once it was gone
    assert fig.transfers_completed + fig.transfers_fell_back == fig.transfers_planned, fig
    # Each move from the store the router planned after the kill is counted as recomputed. Whether it
    # plans any depends on where the planner sends the burst (since it counts its own recent
    # decisions as load, it spreads the burst and may plan none after the kill).
    assert fig.moves_not_made + fig.transfers_fell_back >= planned_after
    if planned_after:
        assert "planned moves not loaded by their engine" in output or "fell back to recompute" in output
