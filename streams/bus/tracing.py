"""Trace context on the bus: every record carries its sender's context, every consumer continues it.

A request is one OpenTelemetry trace across every hop because the context travels in Kafka record
headers (W3C ``traceparent``): :func:`streams.bus.clients.send` injects the current context into
every record it sends (:func:`carrier_headers`); a consumer continues the trace with
:func:`span_from_record`, so a service only has to wrap its processing in that span.

This module uses the OpenTelemetry *API* only, so engine processes may import it: without a
tracer provider (engines, tests) its spans are no-ops. Services install the SDK's provider and
its exporter in :mod:`streams.telemetry`.

We inject by hand rather than with ``opentelemetry-instrumentation-aiokafka``: Faust's consumer
runs in its own thread, so its receive spans would be orphans, and two injectors would write two
``traceparent`` headers (``stack.md`` §3).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

__all__ = ["TRACER_NAME", "carrier_headers", "finite_attributes", "span_from_record", "start_span_from_record",
           "tracer"]

TRACER_NAME = "nexuskv"


def tracer(service: str) -> trace.Tracer:
    """A tracer whose spans name the service (``nexuskv.service`` attribute is set per span)."""
    return trace.get_tracer(f"{TRACER_NAME}.{service}")


def finite_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``attributes`` with each non-finite float (an unknown index lag is ``inf``) as its text: "inf",
    "-inf" or "nan". OTLP carries such a double, but Jaeger's query API cannot write it as JSON: one
    span holding one makes ``/api/traces`` answer 500 for every trace of its service
    ("json: unsupported value: +Inf"), so a trace with it could not be read at all."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in attributes.items()}


def carrier_headers(headers: Sequence[tuple[str, bytes]] | None = None) -> list[tuple[str, bytes]]:
    """``headers`` plus the current trace context (W3C traceparent), as Kafka record headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    out = [(k, v) for k, v in (headers or []) if k not in carrier]
    out.extend((k, v.encode("ascii")) for k, v in carrier.items())
    return out


def _context_of(headers: Sequence[tuple[str, bytes]] | dict | None) -> otel_context.Context:
    items = headers.items() if isinstance(headers, dict) else (headers or [])
    carrier = {k: (v.decode("ascii", "replace") if isinstance(v, (bytes, bytearray)) else str(v)) for k, v in items}
    return propagate.extract(carrier)


@contextlib.contextmanager
def span_from_record(service: str, name: str, headers: Sequence[tuple[str, bytes]] | dict | None,
                     attributes: dict[str, Any] | None = None) -> Iterator[trace.Span]:
    """A span continuing the trace carried by a consumed record's headers, current while open."""
    parent = _context_of(headers)
    attrs = finite_attributes({"nexuskv.service": service, **(attributes or {})})
    with tracer(service).start_as_current_span(name, context=parent, kind=trace.SpanKind.CONSUMER,
                                               attributes=attrs) as span:
        yield span


def start_span_from_record(service: str, name: str, headers: Sequence[tuple[str, bytes]] | dict | None,
                           attributes: dict[str, Any] | None = None) -> trace.Span:
    """A started (not current) span continuing a record's trace; end it, or ``trace.use_span`` it."""
    attrs = finite_attributes({"nexuskv.service": service, **(attributes or {})})
    return tracer(service).start_span(name, context=_context_of(headers), kind=trace.SpanKind.CONSUMER,
                                      attributes=attrs)
