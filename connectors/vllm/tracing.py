"""The connector's part of a request's trace: its decision and its load, under vLLM's request.

vLLM carries a request's W3C ``traceparent`` (its OpenAI endpoint's header) on the request
(``Request.trace_headers``, set when the engine runs with ``--otlp-traces-endpoint``).
:class:`RequestTraces` keeps that context per request and emits, as children of it:

* ``connector.decide`` — the decision the scheduler side acted on (its action, tier, reused
  tokens, predicted EG); the decision record it publishes carries this span's context in its
  Kafka headers, so the decision sink's ``record.decisions`` span joins the same trace;
* ``connector.load`` — from vLLM's allocation of the blocks to load until the worker reports them
  in place (or failed: the span then has an error status), with the tier and the tokens.

OpenTelemetry API only (:mod:`streams.bus.tracing`): the spans go to whatever tracer provider the
engine process has — vLLM's own when it exports its request spans — and are no-ops otherwise.
A request that came without a trace context gets no span. Bounded: at most ``capacity``
requests are held (the oldest forgotten first), since vLLM finishes every request it starts.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from nexuskv.contracts.decisions import Decision
from streams.bus.tracing import finite_attributes, tracer

__all__ = ["RequestTraces"]

SERVICE = "vllm-connector"


class RequestTraces:
    """The trace context of each request vLLM handed the connector, and the connector's spans in it."""

    def __init__(self, *, capacity: int = 4096, tracer_: trace.Tracer | None = None) -> None:
        self.capacity = capacity
        self._tracer = tracer_ or tracer(SERVICE)
        self._contexts: OrderedDict[str, otel_context.Context] = OrderedDict()
        self._loads: dict[str, trace.Span] = {}
        self._lock = threading.Lock()  # the scheduler's thread and the bus thread's callbacks

    def track(self, request_id: str, trace_headers: Mapping[str, str] | None) -> None:
        """Remember the context ``trace_headers`` carry (nothing when they carry none)."""
        if not trace_headers or "traceparent" not in trace_headers:
            return
        ctx = propagate.extract(dict(trace_headers))
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            return
        evicted: list[str] = []
        with self._lock:
            if request_id in self._contexts:
                return
            self._contexts[request_id] = ctx
            while len(self._contexts) > self.capacity:
                evicted.append(self._contexts.popitem(last=False)[0])
        for old in evicted:
            self._end_load(old, ok=False, why="forgotten: more requests in flight than the connector holds")

    def _context(self, request_id: str) -> otel_context.Context | None:
        with self._lock:
            return self._contexts.get(request_id)

    def decided(self, decision: Decision) -> list[tuple[str, bytes]]:
        """A ``connector.decide`` span for ``decision``; the Kafka headers that continue it (none untraced)."""
        ctx = self._context(decision.request_id)
        if ctx is None:
            return []
        span = self._tracer.start_span("connector.decide", context=ctx, kind=trace.SpanKind.INTERNAL,
                                       attributes=_decision_attributes(decision))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span, ctx))
        span.end()
        return [(k, v.encode("ascii")) for k, v in carrier.items()]

    def load_started(self, request_id: str, *, tier: str | None, tokens: int) -> None:
        ctx = self._context(request_id)
        if ctx is None:
            return
        span = self._tracer.start_span("connector.load", context=ctx, kind=trace.SpanKind.INTERNAL,
                                       attributes={"nexuskv.service": SERVICE, "nexuskv.request_id": request_id,
                                                   "nexuskv.tier": tier or "none", "nexuskv.load_tokens": tokens},
                                       start_time=time.time_ns())
        with self._lock:
            prior = self._loads.pop(request_id, None)
            self._loads[request_id] = span
        if prior is not None:
            prior.end()

    def load_finished(self, request_id: str, *, ok: bool, blocks: int | None = None) -> None:
        if blocks is not None:
            with self._lock:
                span = self._loads.get(request_id)
            if span is not None:
                span.set_attribute("nexuskv.load_blocks", blocks)
        self._end_load(request_id, ok=ok, why=None if ok else "the load of its blocks failed; vLLM recomputes them")

    def forget(self, request_id: str) -> None:
        """The request finished: a load still open ends unconfirmed, its context is dropped."""
        self._end_load(request_id, ok=False, why="the request finished before the worker confirmed the load")
        with self._lock:
            self._contexts.pop(request_id, None)

    def _end_load(self, request_id: str, *, ok: bool, why: str | None) -> None:
        with self._lock:
            span = self._loads.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("nexuskv.load_ok", ok)
        if not ok:
            span.set_status(Status(StatusCode.ERROR, why or "load failed"))
        span.end()


def _decision_attributes(d: Decision) -> dict[str, Any]:
    attrs: dict[str, Any] = {"nexuskv.service": SERVICE, "nexuskv.request_id": d.request_id,
                             "nexuskv.revision": d.revision, "nexuskv.action": d.action.value,
                             "nexuskv.worker": d.worker, "nexuskv.prompt_tokens": d.prompt_tokens,
                             "nexuskv.reused_tokens": d.reused_tokens, "nexuskv.eg_s": d.eg_s,
                             "nexuskv.t_compute_s": d.t_compute_s, "nexuskv.t_with_reuse_s": d.t_with_reuse_s,
                             "nexuskv.tier": d.source.tier.value if d.source is not None else "none",
                             "nexuskv.reason": d.reason[:256]}
    return finite_attributes(attrs)
