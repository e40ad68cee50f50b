"""The replay's own spans (:mod:`streams.app.replay.tracing`) and the report's pointers to traces.

In-memory exporter: the root span per request, the client span whose context goes to vLLM as a
W3C ``traceparent``, the outcome's attributes; and the report naming the slowest and the
most-improved requests' trace ids from ``replay_requests``. The real export, read back from a real
Jaeger with real vLLM, is ``tests/engines/vllm/test_replay_traces.py``.
"""

from __future__ import annotations

import duckdb
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from analytics.replay_figures import render, replay_figures
from analytics.store import DecisionStore
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ConfigError
from streams.app.replay.client import Completion
from streams.app.replay.routing import Routed
from streams.app.replay.runs import outcome_attributes
from streams.app.replay.tracing import ReplayTracing, engine_args, engine_trace_env, service_trace_env, trace_id_of


@pytest.fixture
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return ReplayTracing("http://127.0.0.1:4318", "replay-x", provider, provider.get_tracer("t")), exporter


def test_the_engine_request_carries_a_traceparent_of_a_child_of_the_request_span(tracing):
    rt, exporter = tracing
    with rt.request("nexuskv", "r00003", {"nexuskv.seq": 3}) as root:
        with rt.completion("http://127.0.0.1:8000") as headers:
            pass
        tid = trace_id_of(root)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    client, req = spans["engine.completion"], spans["replay.request"]
    assert client.parent.span_id == req.context.span_id and req.parent is None
    assert tid == format(req.context.trace_id, "032x")
    ctx = trace.get_current_span(propagate.extract(headers)).get_span_context()
    assert (ctx.trace_id, ctx.span_id) == (req.context.trace_id, client.context.span_id)
    assert headers["traceparent"].startswith("00-" + tid + "-")
    assert req.attributes["nexuskv.replay_id"] == "replay-x" and req.attributes["nexuskv.run"] == "nexuskv"


def test_untraced_the_replay_sends_no_trace_header_and_names_no_trace():
    rt = ReplayTracing.start(None)
    with rt.request("baseline", "r00000", {}) as root:
        with rt.completion("http://127.0.0.1:8000") as headers:
            assert headers == {}
        assert trace_id_of(root) is None
    assert engine_args(None) == [] and engine_trace_env(None, "e") == {} and service_trace_env(None) == {}


def test_a_traced_engine_exports_over_http_to_the_same_collector():
    assert engine_args("http://127.0.0.1:4318/") == ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
    env = engine_trace_env("http://127.0.0.1:4318", "nexuskv-engine0")
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's default is gRPC
    assert service_trace_env("http://c:4318")["NEXUSKV_OTLP_ENDPOINT"] == "http://c:4318"


def test_a_trace_to_that_is_not_an_http_url_names_the_field(tmp_path):
    from streams.app.replay.session import ReplayConfig

    with pytest.raises(ConfigError) as err:
        ReplayConfig(trace=tmp_path / "t.jsonl", out=tmp_path, trace_to="127.0.0.1:4318")
    assert err.value.field == "trace_to"


def _decision() -> Decision:
    return Decision(request_id="replay-x/r00003", tenant_namespace="default", decided_at=1.0, action=Action.TRANSFER,
                    worker="w0", source=EntryLocation(worker="w0", tier=Tier.DISK, group=0), prompt_tokens=640,
                    reused_tokens=448, reused_blocks=14, t_compute_s=0.3, t_with_reuse_s=0.1, eg_s=0.2,
                    eg_lower_s=0.15, reason="load pays", policy_version="builtin", cost_model_version="v1")


def test_the_outcome_attributes_carry_the_decision_and_the_observed_eg():
    done = Completion(sent_at=0.0, ttft_s=0.10, e2e_s=0.2, output_ids=(5, 6), prompt_tokens=640, cached_tokens=448)
    attrs = outcome_attributes(Routed(0, _decision(), routing_s=0.02), done, baseline_ttft_s=0.5)
    assert attrs["nexuskv.action"] == "transfer" and attrs["nexuskv.tier"] == "disk"
    assert attrs["nexuskv.reused_tokens"] == 448 and attrs["nexuskv.predicted_eg_s"] == 0.2
    assert attrs["nexuskv.observed_eg_s"] == pytest.approx(0.5 - 0.12)
    plain = outcome_attributes(Routed(1), done, baseline_ttft_s=None)
    assert "nexuskv.action" not in plain and "nexuskv.observed_eg_s" not in plain
    assert plain["nexuskv.ttft_s"] == pytest.approx(0.10)


def _row(run: str, rid: str, seq: int, ttft: float, trace_id: str | None) -> dict:
    return {"replay_id": "replay-x", "run": run, "request_id": rid, "seq": seq, "warmup": False, "engine": "w0",
            "arrival_s": float(seq), "sent_at": 1.0, "ttft_s": ttft, "e2e_s": ttft + 0.1, "prompt_tokens": 640,
            "cached_tokens": 0, "output_tokens": 2, "output_digest": "d", "trace_id": trace_id}


def test_the_report_names_the_slowest_and_the_most_improved_requests_traces(tmp_path):
    store = DecisionStore(tmp_path / "d.duckdb")
    ttft = {"r00000": (0.50, 0.45), "r00001": (0.90, 0.30), "r00002": (0.40, 0.60)}  # baseline, nexuskv
    rows = []
    for seq, (rid, (b, n)) in enumerate(ttft.items()):
        rows += [_row("baseline", rid, seq, b, f"{seq:031x}b"), _row("nexuskv", rid, seq, n, f"{seq:031x}n")]
    store.write("replay_requests", rows)
    store.write("replay_runs", [{"replay_id": "replay-x", "run": r, "started_at": 1.0, "wall_s": 1.0, "engine": "v",
                                 "engines": 1, "model": "m", "router": "x", "config_json": "{}"}
                                for r in ("baseline", "nexuskv")])
    store.close()
    with duckdb.connect(str(tmp_path / "d.duckdb"), read_only=True) as con:
        fig = replay_figures(con, "replay-x")
    t = fig.traces
    assert t.slowest["baseline"].request_id == "r00001" and t.slowest["baseline"].trace_ids == {"baseline": f"{1:031x}b"}
    assert t.slowest["nexuskv"].request_id == "r00002" and t.slowest["nexuskv"].trace_ids == {"nexuskv": f"{2:031x}n"}
    assert t.most_improved.request_id == "r00001" and t.most_improved.seconds == pytest.approx(0.60)
    assert t.most_improved.trace_ids == {"baseline": f"{1:031x}b", "nexuskv": f"{1:031x}n"}
    line = next(x for x in render(fig).splitlines() if x.startswith("traces to open"))
    assert f"slowest nexuskv request r00002 (TTFT 0.600 s): trace {2:031x}n" in line
    assert f"most improved r00001 (observed EG 0.600 s): baseline trace {1:031x}b, nexuskv trace {1:031x}n" in line


def test_an_untraced_replay_names_no_trace(tmp_path):
    store = DecisionStore(tmp_path / "d.duckdb")
    store.write("replay_requests", [_row("baseline", "r00000", 0, 0.5, None), _row("nexuskv", "r00000", 0, 0.4, None)])
    store.write("replay_runs", [{"replay_id": "replay-x", "run": "baseline", "started_at": 1.0, "wall_s": 1.0,
                                 "engine": "v", "engines": 1, "model": "m", "router": "x", "config_json": "{}"}])
    store.close()
    with duckdb.connect(str(tmp_path / "d.duckdb"), read_only=True) as con:
        fig = replay_figures(con, "replay-x")
    assert fig.traces is None and "traces to open" not in render(fig)
