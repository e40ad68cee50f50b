"""Jaeger killed mid-replay: every request still completes, and the spans it lost are counted.

A traced ``nexuskv replay`` (the NexusKV run only: the router's plan spans, the planner's, the
connector's and vLLM's all export) on real vLLM, one engine, twelve short requests 1.2 s apart,
exporting to a Jaeger of this test's own (the session's Jaeger serves other tests). Once the first
request's spans have reached Jaeger, the test kills Jaeger with SIGKILL: no goodbye, the port
refuses from then on. Asserted:

* 0 failed requests: every request of the run is in the decision store without an error, with
  its trace id, and most of them were sent after the kill;
* the drops are counted: the replay's report of this process's export
  (``nexuskv_spans_exported`` / ``nexuskv_spans_dropped``) shows spans exported before the kill
  and spans dropped as failed exports after it; nothing waited for room in the queue;
* the export stayed bounded: the replay finished, under the test's limit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from nexuskv.errors import JaegerError
from streams.app.jaeger import JaegerServer

pytestmark = [pytest.mark.vllm, pytest.mark.tansu, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
REQUESTS = 12
BLOCKS = 8  # trace blocks per prompt (32 tokens each after --hash-block-tokens 32)


def _trace(path: Path) -> Path:
    """Twelve single-turn requests of distinct conversations sharing a system prompt, 1.2 s apart
    after scaling."""
    rows = []
    for i in range(REQUESTS):
        hash_ids = [0, 1, 5_000 + i] + [10_000 + i * 100 + j for j in range(BLOCKS - 3)]
        rows.append({"timestamp": i * 7200, "input_length": len(hash_ids) * 512, "output_length": 2,
                     "hash_ids": hash_ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _first_request_in(jaeger: JaegerServer, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether a ``replay.request`` span reached Jaeger before the replay ended or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(JaegerError):  # a query that failed is asked again
            traces = jaeger.traces("nexuskv-replay")
            if any(s["operationName"] == "replay.request" for t in traces for s in t["spans"]):
                return True
        time.sleep(0.2)
    return False


def test_jaeger_killed_mid_replay_fails_no_request_and_the_drops_are_counted(tmp_path, jaeger_binary):
    trace = _trace(tmp_path / "trace.jsonl")
    out = tmp_path / "replay"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEXUSKV_DATA_DIR": str(tmp_path / "data"),
           "NEXUSKV_METRICS_PORT": "0"}
    for name in ("NEXUSKV_BROKER", "NEXUSKV_OTLP_ENDPOINT"):  # its own embedded broker; the flag names the export
        env.pop(name, None)
    log = tmp_path / "replay.log"
    with JaegerServer(binary=jaeger_binary) as jaeger:
        cmd = [sys.executable, "-m", "streams.app.cli", "replay", str(trace), "--runs", "nexuskv",
               "--requests", str(REQUESTS), "--warmup", "2", "--workers", "1", "--engine-blocks", "24",
               "--hash-block-tokens", "32", "--max-prompt-tokens", str(BLOCKS * 32), "--max-output-tokens", "2",
               "--time-scale", "6", "--out", str(out), "--no-progress", "--trace-to", jaeger.otlp_http_url]
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
            try:
                reached = _first_request_in(jaeger, proc, timeout_s=600)
                assert jaeger.process is not None and jaeger.process.pid is not None
                os.kill(jaeger.process.pid, signal.SIGKILL)
                killed_at = time.time()
                code = proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    output = log.read_text(errors="replace")
    assert reached, "no replay span reached Jaeger before the replay ended:\n" + output[-3000:]
    assert code == 0, output[-4000:]

    with duckdb.connect(str(out / "decisions.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT request_id, sent_at, error, trace_id, ttft_s FROM replay_requests "
                           "WHERE run = 'nexuskv' ORDER BY seq").fetchall()
    assert len(rows) == REQUESTS, rows
    assert [r for r in rows if r[2] is not None] == []  # 0 failed requests
    assert all(re.fullmatch(r"[0-9a-f]{32}", r[3] or "") for r in rows), rows
    after = [r for r in rows if r[1] > killed_at]
    assert len(after) >= REQUESTS // 2, (killed_at, [(r[0], r[1]) for r in rows])  # the kill was mid-replay

    line = next((x for x in output.splitlines() if "run 'nexuskv': trace export from this process" in x), None)
    assert line is not None, output[-3000:]
    counts = re.search(r"(\d+) spans exported, (\d+) dropped \(export failed (\d+), queue full (\d+)\)", line)
    assert counts is not None, line
    exported, dropped, failed, full = map(int, counts.groups())
    print(f"{len(after)} of {REQUESTS} requests sent after the kill; {line.strip()}; TTFT s before the kill "
          f"{[round(r[4], 3) for r in rows if r[1] <= killed_at]}, after {[round(r[4], 3) for r in after]}")
    assert exported >= 1, line  # the first request's spans, before the kill
    # Each request after the kill ends at least its replay.request, router.plan and engine.completion
    # spans in this process; every one of them failed to export, and was counted.
    assert failed >= 3 * len(after) and full == 0 and dropped == failed, line
