"""One OpenTelemetry trace per replayed request, vLLM's own request span included.

With an OTLP/HTTP endpoint (``nexuskv replay --trace-to URL``, else ``NEXUSKV_OTLP_ENDPOINT``) every
process of the replay exports to it, in both runs:

* this process: a root span ``replay.request`` per request (the user's view: arrival to last
  token), its ``router.plan`` span in the NexusKV run (the plan request on the bus and the
  decision it waited for) and an ``engine.completion`` client span around the HTTP request, whose
  context goes to vLLM's OpenAI endpoint as a W3C ``traceparent`` header; the decision sink's
  ``record.decisions`` spans (it runs here);
* the services (:data:`SERVICE_ENV`): the planner's ``planner.decide`` and ``index.match``, which
  continue the trace the plan request carries in its Kafka headers;
* the engines (:func:`engine_args`): vLLM's ``llm_request`` span (``--otlp-traces-endpoint``; vLLM
  takes the parent from the request's ``traceparent``), and in the NexusKV run the connector's
  ``connector.decide`` and ``connector.load`` spans, in the engine's process, under the same parent.

vLLM 0.32's ``--collect-detailed-traces`` is not passed: it only requires the endpoint, and no
code of vLLM 0.32 reads what it enables (its ``time_in_model_forward`` and ``..._execute``
attributes are declared, never set).

Without an endpoint nothing is exported and nothing changes: the replay's spans are no-ops.

Export is bounded (:func:`streams.telemetry.setup_tracing`): a collector that is down or dies
mid-replay costs spans, never a request. This process's spans exported and dropped are counted on
``nexuskv_spans_exported`` / ``nexuskv_spans_dropped`` (:meth:`ReplayTracing.export_counts`); the
replay prints them after each run. The services count theirs on the same metrics, on their own
``/metrics``; vLLM's exporter counts nothing NexusKV can read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace

from streams.bus.metrics import REGISTRY
from streams.telemetry import setup_tracing

__all__ = ["REPLAY_SERVICE", "ExportCounts", "ReplayTracing", "engine_args", "engine_trace_env", "service_trace_env",
           "trace_id_of"]

REPLAY_SERVICE = "nexuskv-replay"
#: The engines and services export their batches every second (the SDK's default is 5 s), so the
#: last requests' spans leave before a run stops them; this process flushes at the end of each run.
_EXPORT_DELAY_MS = "1000"


def trace_id_of(span: trace.Span) -> str | None:
    """The span's trace id as Jaeger shows it (32 hex digits); None for a span that is not recorded."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def engine_args(endpoint: str | None) -> list[str]:
    """vLLM's flags to export its request spans to ``endpoint`` (an OTLP/HTTP base URL)."""
    return [] if endpoint is None else ["--otlp-traces-endpoint", endpoint.rstrip("/") + "/v1/traces"]


def engine_trace_env(endpoint: str | None, name: str) -> dict[str, str]:
    """The environment of a traced vLLM engine: OTLP over HTTP (vLLM's default is gRPC), named ``name``."""
    if endpoint is None:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm",
            "OTEL_RESOURCE_ATTRIBUTES": f"nexuskv.engine={name}", "OTEL_BSP_SCHEDULE_DELAY": _EXPORT_DELAY_MS}


def service_trace_env(endpoint: str | None) -> dict[str, str]:
    """The environment of a traced NexusKV service."""
    if endpoint is None:
        return {}
    return {"NEXUSKV_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": _EXPORT_DELAY_MS}


@dataclass(frozen=True, slots=True)
class ExportCounts:
    """This process's spans of the replay: exported, and dropped by reason (the metric's counters)."""

    exported: int = 0
    export_failed: int = 0  # the collector refused, timed out or was unreachable
    queue_full: int = 0  # the export queue was full (the collector behind or hung)

    @property
    def dropped(self) -> int:
        return self.export_failed + self.queue_full

    def __sub__(self, other: ExportCounts) -> ExportCounts:
        return ExportCounts(self.exported - other.exported, self.export_failed - other.export_failed,
                            self.queue_full - other.queue_full)

    def describe(self) -> str:
        return (f"{self.exported} spans exported, {self.dropped} dropped (export failed {self.export_failed}, "
                f"queue full {self.queue_full})")


@dataclass(slots=True)
class ReplayTracing:
    """This process's tracer for the replay, exporting to ``endpoint`` (None: off, spans are no-ops).

    The tracer comes from the provider :func:`streams.telemetry.setup_tracing` returns, not from the
    global one: a process that already has a tracer provider (OpenTelemetry allows one) still
    exports the replay's spans to the endpoint asked for.
    """

    endpoint: str | None
    replay_id: str | None = None  # on every root span: which replay a trace belongs to
    _provider: Any = None
    _tracer: trace.Tracer | None = None

    @classmethod
    def start(cls, endpoint: str | None, replay_id: str | None = None) -> ReplayTracing:
        if endpoint is None:
            return cls(None, replay_id, None, trace.NoOpTracer())
        provider = setup_tracing(REPLAY_SERVICE, endpoint)
        return cls(endpoint, replay_id, provider,
                   provider.get_tracer("nexuskv.replay") if provider else trace.NoOpTracer())

    @property
    def tracer(self) -> trace.Tracer:
        return self._tracer or trace.NoOpTracer()

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @contextlib.contextmanager
    def request(self, run: str, request_id: str, attributes: dict[str, Any]) -> Iterator[trace.Span]:
        """The root span of one replayed request, current while open."""
        with self.tracer.start_as_current_span("replay.request", kind=trace.SpanKind.CLIENT,
                                               attributes={"nexuskv.service": REPLAY_SERVICE, "nexuskv.run": run,
                                                           "nexuskv.replay_request": request_id,
                                                           **({"nexuskv.replay_id": self.replay_id}
                                                              if self.replay_id else {}),
                                                           **attributes}) as span:
            yield span

    @contextlib.contextmanager
    def completion(self, url: str) -> Iterator[dict[str, str]]:
        """A client span around one HTTP request to an engine; yields the headers that carry it."""
        with self.tracer.start_as_current_span("engine.completion", kind=trace.SpanKind.CLIENT,
                                               attributes={"server.address": url}):
            carrier: dict[str, str] = {}
            if self.enabled:
                propagate.inject(carrier)
            yield carrier

    def export_counts(self) -> ExportCounts:
        """This process's ``nexuskv_spans_exported`` and ``nexuskv_spans_dropped`` counters, as now."""

        def sample(name: str, **labels: str) -> int:
            value = REGISTRY.get_sample_value(name, {"service": REPLAY_SERVICE, **labels})
            return int(value or 0)

        return ExportCounts(sample("nexuskv_spans_exported_total"),
                            sample("nexuskv_spans_dropped_total", reason="export_failed"),
                            sample("nexuskv_spans_dropped_total", reason="queue_full"))

    def flush(self, timeout_s: float = 10.0) -> None:
        if self._provider is not None:
            self._provider.force_flush(int(timeout_s * 1000))
