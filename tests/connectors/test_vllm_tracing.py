"""The connector's spans in a request's trace (:mod:`connectors.vllm.tracing`), with an in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from connectors.vllm.tracing import RequestTraces
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _parent(tracer) -> tuple[dict[str, str], trace.Span]:
    """A span as the replay's engine.completion, and the HTTP headers vLLM would hand the connector."""
    span = tracer.start_span("engine.completion")
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier, span


def _decision(rid: str, action: Action = Action.TRANSFER) -> Decision:
    return Decision(request_id=rid, tenant_namespace="default", decided_at=1.0, action=action, worker="w0",
                    source=EntryLocation(worker="w0", tier=Tier.DISK, group=0), prompt_tokens=640,
                    reused_tokens=448, reused_blocks=14, t_compute_s=0.3, t_with_reuse_s=0.1, eg_s=0.2,
                    eg_lower_s=0.15, reason="load pays", policy_version="builtin", cost_model_version="v1")


def test_the_decision_and_the_load_are_children_of_the_request_and_the_record_carries_the_decision(traced):
    tracer, exporter = traced
    headers, parent = _parent(tracer)
    traces = RequestTraces(tracer_=tracer)
    traces.track("cmpl-nexuskv-r00002-0-ab", headers)
    kafka = traces.decided(_decision("cmpl-nexuskv-r00002-0-ab"))
    traces.load_started("cmpl-nexuskv-r00002-0-ab", tier="disk", tokens=448)
    traces.load_finished("cmpl-nexuskv-r00002-0-ab", ok=True)
    traces.forget("cmpl-nexuskv-r00002-0-ab")
    parent.end()

    spans = {s.name: s for s in exporter.get_finished_spans()}
    decide, load = spans["connector.decide"], spans["connector.load"]
    pctx = parent.get_span_context()
    for s in (decide, load):
        assert s.context.trace_id == pctx.trace_id and s.parent.span_id == pctx.span_id
    assert decide.attributes["nexuskv.action"] == "transfer" and decide.attributes["nexuskv.tier"] == "disk"
    assert decide.attributes["nexuskv.reused_tokens"] == 448 and decide.attributes["nexuskv.eg_s"] == 0.2
    assert load.attributes["nexuskv.load_ok"] is True and load.status.status_code is not StatusCode.ERROR
    # The decision record's headers continue the connector.decide span (the sink's span is its child).
    carried = propagate.extract({k: v.decode() for k, v in kafka})
    sctx = trace.get_current_span(carried).get_span_context()
    assert (sctx.trace_id, sctx.span_id) == (pctx.trace_id, decide.context.span_id)


def test_a_load_left_open_when_the_request_finishes_ends_as_an_error(traced):
    tracer, exporter = traced
    headers, parent = _parent(tracer)
    traces = RequestTraces(tracer_=tracer)
    traces.track("r1", headers)
    traces.load_started("r1", tier="disk", tokens=64)
    traces.forget("r1")
    (load,) = [s for s in exporter.get_finished_spans() if s.name == "connector.load"]
    assert load.attributes["nexuskv.load_ok"] is False and load.status.status_code is StatusCode.ERROR
    assert traces.decided(_decision("r1")) == []  # forgotten: no more spans for it


def test_a_request_without_trace_context_gets_no_span_and_no_headers(traced):
    tracer, exporter = traced
    traces = RequestTraces(tracer_=tracer)
    for headers in (None, {}, {"traceparent": "not-a-traceparent"}):
        traces.track("r2", headers)
    assert traces.decided(_decision("r2")) == []
    traces.load_started("r2", tier="disk", tokens=64)
    traces.load_finished("r2", ok=True)
    assert exporter.get_finished_spans() == ()


def test_at_most_capacity_requests_are_held_and_the_oldest_open_load_is_ended(traced):
    tracer, exporter = traced
    traces = RequestTraces(tracer_=tracer, capacity=2)
    for rid in ("a", "b", "c"):
        headers, _ = _parent(tracer)
        traces.track(rid, headers)
        traces.load_started(rid, tier="disk", tokens=32)
    ended = [s for s in exporter.get_finished_spans() if s.name == "connector.load"]
    assert [s.attributes["nexuskv.request_id"] for s in ended] == ["a"]
    assert ended[0].status.status_code is StatusCode.ERROR
    assert traces.decided(_decision("a")) == [] and traces.decided(_decision("c")) != []
