"""``nexuskv replay --trace-to`` on real vLLM: one trace per replayed request, read back from a real Jaeger.

The smallest replay where the connector loads: one engine whose own KV cache (24 blocks) holds one
conversation's history at a time, two conversations interleaved, two turns each. The second turn
of a conversation finds most of its history evicted from the engine's cache and on the worker's
disk tier, so the connector loads it. Both runs (vLLM alone, vLLM + NexusKV) are traced; the
command runs as a user runs it (its own process, its own embedded broker).

Asserted on Jaeger's HTTP API (``/api/traces``), over every span of the replay's traces:

* exactly one trace per replayed request of each run, and every span naming a replayed request
  (by NexusKV's request ids or vLLM's ``gen_ai.request.id``) is in that request's trace: 0 split traces;
* every span's parent is in its own trace: 0 orphan spans;
* the NexusKV run's traces hold the router's plan request, the planner's decision and the index
  match, the decision records' writes, the connector's decision and vLLM's own request span; a
  load where the connector loaded; the baseline's hold vLLM's span under the replay's;
* the attributes: the decision's action, tier, reused tokens, predicted and observed EG;
* the report names the traces of the slowest and the most-improved requests, and they exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import duckdb
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.tansu, pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[3]
SYSTEM = 2  # trace blocks of the shared system prompt (32 tokens each)
HISTORY = (20, 22)  # trace blocks of each turn's prompt: the second turn extends the first


def _trace(path: Path) -> Path:
    """Turns 1 then 2 of two conversations, interleaved (c1, c2, c1, c2), 1.2 s apart after scaling."""
    rows, t = [], 0
    for turn in range(2):
        for c in range(2):
            own = [10_000 + c * 1000 + i for i in range(HISTORY[turn] - SYSTEM - 1)]
            hash_ids = list(range(SYSTEM)) + [5_000 + c] + own  # the second id names the conversation
            rows.append({"timestamp": t, "input_length": len(hash_ids) * 512, "output_length": 2,
                         "hash_ids": hash_ids})
            t += 7200
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _tags(span: dict) -> dict:
    return {t["key"]: t["value"] for t in span.get("tags", ())}


def _parent(span: dict) -> str | None:
    refs = [r for r in span.get("references") or () if r.get("refType") == "CHILD_OF"]
    return refs[0]["spanID"] if refs else None


def _replay_traces(jaeger, replay_id: str, expected: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """The traces holding the replay's request spans, once every request's vLLM span has arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {t["traceID"]: t for t in jaeger.traces("nexuskv-replay", limit=1000)
                 if any(s["operationName"] == "replay.request" and _tags(s).get("nexuskv.replay_id") == replay_id
                        for s in t["spans"])}
        with_engine = sum(1 for t in found.values() if any(s["operationName"] == "llm_request" for s in t["spans"]))
        if (len(found) >= expected and with_engine >= expected) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def test_a_traced_replay_is_one_jaeger_trace_per_request_with_vllms_span(tmp_path, jaeger):
    trace = _trace(tmp_path / "trace.jsonl")
    out = tmp_path / "replay"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEXUSKV_DATA_DIR": str(tmp_path / "data"),
           "NEXUSKV_METRICS_PORT": "0"}
    for name in ("NEXUSKV_BROKER", "NEXUSKV_OTLP_ENDPOINT"):  # its own embedded broker; the flag names the export
        env.pop(name, None)
    cmd = [sys.executable, "-m", "streams.app.cli", "replay", str(trace), "--requests", "4", "--warmup", "2",
           "--workers", "1", "--engine-blocks", "24", "--hash-block-tokens", "32", "--max-prompt-tokens", "704",
           "--max-output-tokens", "2", "--time-scale", "6", "--out", str(out), "--no-progress",
           "--trace-to", jaeger.otlp_http_url]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1400, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with duckdb.connect(str(out / "decisions.duckdb"), read_only=True) as con:
        replay_id = con.execute("SELECT replay_id FROM replay_runs LIMIT 1").fetchone()[0]
        rows = con.execute("SELECT run, request_id, trace_id, error FROM replay_requests WHERE replay_id = ? "
                           "ORDER BY run, seq", [replay_id]).fetchall()
    assert len(rows) == 8 and all(r[3] is None for r in rows), rows  # 4 requests, both runs, no error
    requests = {(run, rid): tid for run, rid, tid, _ in rows}
    assert all(re.fullmatch(r"[0-9a-f]{32}", tid or "") for tid in requests.values()), requests
    assert len(set(requests.values())) == 8  # one trace per request and run

    traces = _replay_traces(jaeger, replay_id, expected=8)
    assert set(traces) == set(requests.values())  # exactly those traces, each request's own

    for (run, rid), tid in requests.items():
        spans = traces[tid]["spans"]
        ids = {s["spanID"] for s in spans}
        orphans = [(s["operationName"], _parent(s)) for s in spans if _parent(s) is not None and _parent(s) not in ids]
        assert orphans == [], (run, rid, orphans)
        roots = [s["operationName"] for s in spans if _parent(s) is None]
        assert roots == ["replay.request"], (run, rid, roots)
        ops = Counter(s["operationName"] for s in spans)
        root = next(_tags(s) for s in spans if s["operationName"] == "replay.request")
        assert root["nexuskv.run"] == run and root["nexuskv.replay_request"] == rid
        engine = [_tags(s) for s in spans if s["operationName"] == "llm_request"]
        assert len(engine) == 1 and f"{run}-{rid}" in engine[0]["gen_ai.request.id"], (run, rid, ops)
        assert ops["engine.completion"] == 1
        if run == "baseline":
            assert not {"router.plan", "planner.decide", "connector.decide"} & set(ops), ops
            continue
        for op in ("router.plan", "planner.decide", "index.match", "connector.decide"):
            assert ops[op] == 1, (rid, op, ops)
        assert ops["record.decisions"] >= 2, ops  # the planner's decision and the connector's, both written
        for key in ("nexuskv.action", "nexuskv.tier", "nexuskv.reused_tokens", "nexuskv.predicted_eg_s",
                    "nexuskv.observed_eg_s"):
            assert key in root, (rid, key, root)
        connector = next(_tags(s) for s in spans if s["operationName"] == "connector.decide")
        for key in ("nexuskv.action", "nexuskv.tier", "nexuskv.reused_tokens", "nexuskv.eg_s"):
            assert key in connector, (rid, key, connector)
        if connector["nexuskv.action"] in ("transfer", "prefetch"):
            load = [_tags(s) for s in spans if s["operationName"] == "connector.load"]
            assert len(load) == 1 and load[0]["nexuskv.tier"] == connector["nexuskv.tier"], (rid, load, connector)

    # No span naming a replayed request lies outside its request's trace (0 split traces), in any
    # trace Jaeger holds of any service.
    every = {t["traceID"]: t for service in jaeger.services() for t in jaeger.traces(service, limit=1000)}
    split = []
    for t in every.values():
        for s in t["spans"]:
            tags = _tags(s)
            label = str(tags.get("nexuskv.request_id") or tags.get("gen_ai.request.id") or "")
            named = re.search(r"(?:^|[^a-z])(baseline|nexuskv)-(r\d{5})(?:$|[^0-9])", label)
            key = (named.group(1), named.group(2)) if named else None
            if label.startswith(replay_id + "/"):
                key = ("nexuskv", label.removeprefix(replay_id + "/"))
            if key in requests and t["traceID"] != requests[key]:
                split.append((key, s["operationName"], t["traceID"]))
    assert split == [], split[:5]

    # A load happened in the NexusKV run, inside its request's trace.
    loads = [s for tid in requests.values() for s in traces[tid]["spans"] if s["operationName"] == "connector.load"]
    assert loads and all(_tags(s)["nexuskv.load_ok"] for s in loads), [_tags(s) for s in loads]

    # The report names the traces to open: each run's slowest request, and the most improved.
    line = next((x for x in done.stdout.splitlines() if x.startswith("traces to open")), None)
    assert line is not None, done.stdout[-2000:]
    named = set(re.findall(r"trace ([0-9a-f]{32})", line))
    assert named and named <= set(requests.values()), (line, requests)
    assert "slowest baseline request" in line and "slowest nexuskv request" in line and "most improved" in line
