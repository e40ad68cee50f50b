"""Tracing and metrics for every NexusKV service process: the SDK's exporter, the metrics endpoint.

**Traces.** A request is one OpenTelemetry trace across every hop — plan request, index match,
decision, transfer, outcome record — because the context travels in Kafka record headers
(:mod:`streams.bus.tracing`, API only, so engine processes can carry it too). This module installs
the SDK's tracer provider in a service: export is OTLP over HTTP when ``NEXUSKV_OTLP_ENDPOINT`` is
set (e.g. ``http://collector:4318``), off otherwise; tests install an in-memory exporter with
:func:`install_tracer_provider`. Decision numbers go on spans as attributes
(:func:`decision_attributes`), never token ids or prompt text.

**Metrics and health.** :data:`streams.bus.metrics.METRICS` (events applied and rejected,
consumer lag, decisions by action and reason, transfer outcomes, index size) and
:data:`streams.bus.health.HEALTH` are served by :func:`serve_metrics` on ``NEXUSKV_METRICS_PORT``
(0: off), bound to ``NEXUSKV_METRICS_HOST`` (loopback unless configured otherwise): ``GET /metrics``, and ``GET /livez`` and ``/readyz`` (200 with ``{"ok": true, ...}``, or
503 with the reason).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, make_wsgi_app

from streams.bus.health import HEALTH, Health
from streams.bus.metrics import METRICS, REGISTRY
from streams.bus.tracing import finite_attributes

__all__ = [
    "BoundedSpanProcessor",
    "CountingExporter",
    "otlp_processor",
    "decision_attributes",
    "health_wsgi_app",
    "init_service",
    "install_tracer_provider",
    "quiet_libraries",
    "reason_code",
    "serve_metrics",
    "setup_tracing",
]

log = logging.getLogger(__name__)

_TRACER_NAME = "nexuskv"


def install_tracer_provider(provider: TracerProvider) -> None:
    """Make ``provider`` the process's tracer provider (OpenTelemetry allows one per process)."""
    trace.set_tracer_provider(provider)


#: Most ended spans waiting for export; past it a span is dropped (counted), never waited for.
EXPORT_QUEUE_SPANS = 4096
#: Most seconds one export call may take, its retries included (the SDK's default is 10 s).
EXPORT_TIMEOUT_S = 2.0


class CountingExporter(SpanExporter):
    """An exporter that counts what it hands on and what fails (``nexuskv_spans_exported`` and
    ``nexuskv_spans_dropped{reason="export_failed"}``), and knows how many spans it was given."""

    def __init__(self, inner: SpanExporter, service: str) -> None:
        self.inner = inner
        self.service = service
        self.handed = 0  # spans passed to export(), whatever became of them

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter must not raise; if it does, the spans are lost, counted
            log.warning("span export raised %s: %d spans dropped", type(exc).__name__, len(spans))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            METRICS.spans_exported.labels(self.service).inc(len(spans))
        else:
            METRICS.spans_dropped.labels(self.service, "export_failed").inc(len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedSpanProcessor(SpanProcessor):
    """Batch export that never holds a request: ``on_end`` only enqueues, and a span that finds
    ``max_queue`` spans already waiting is dropped and counted
    (``nexuskv_spans_dropped{reason="queue_full"}``), so a collector that is down or hangs costs
    the traced code nothing but the spans (the SDK's own batch processor also drops, but
    uncounted). Export runs on the SDK's worker thread, each call bounded by the exporter's
    timeout."""

    def __init__(self, exporter: SpanExporter, service: str, *, max_queue: int = EXPORT_QUEUE_SPANS,
                 schedule_delay_ms: float = 500.0, max_batch: int = 512) -> None:
        self.exporter = CountingExporter(exporter, service)
        self.service = service
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._queued = 0  # spans passed to the batch processor
        # The inner queue is one batch larger than ours: it never drops on its own.
        self._batch = BatchSpanProcessor(self.exporter, max_queue_size=max_queue + max_batch,
                                         schedule_delay_millis=schedule_delay_ms,
                                         max_export_batch_size=min(max_batch, max_queue))

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._batch.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._lock:
            if self._queued - self.exporter.handed >= self.max_queue:
                full = True
            else:
                full = False
                self._queued += 1
        if full:
            METRICS.spans_dropped.labels(self.service, "queue_full").inc()
            return
        self._batch.on_end(span)

    def waiting(self) -> int:
        """Spans enqueued and not yet handed to the exporter."""
        return self._queued - self.exporter.handed

    def shutdown(self) -> None:
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


def otlp_processor(service: str, otlp_endpoint: str, *, timeout_s: float = EXPORT_TIMEOUT_S,
                   max_queue: int = EXPORT_QUEUE_SPANS) -> BoundedSpanProcessor:
    """OTLP/HTTP export of ``service``'s spans to ``otlp_endpoint`` (a collector's base URL), bounded."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces", timeout=timeout_s)
    return BoundedSpanProcessor(exporter, service, max_queue=max_queue)


def setup_tracing(service: str, otlp_endpoint: str | None, *, extra: Sequence[SpanProcessor] = ()) -> TracerProvider | None:
    """Configure this process to export spans of ``service``; None when tracing stays off.

    Export is bounded (:class:`BoundedSpanProcessor`): a collector that is down, slow or hung never
    slows or fails a request; what could not be exported is counted on ``nexuskv_spans_dropped``.
    """
    processors: list[SpanProcessor] = list(extra)
    if otlp_endpoint:
        processors.append(otlp_processor(service, otlp_endpoint))
    if not processors:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for p in processors:
        provider.add_span_processor(p)
    install_tracer_provider(provider)
    return provider


def reason_code(reason: str) -> str:
    """A bounded metric label for a decision reason: its text up to the first ':' or digit."""
    head = reason.split(":", 1)[0]
    for i, ch in enumerate(head):
        if ch.isdigit():
            head = head[:i]
            break
    return head.strip()[:40] or "unspecified"


def decision_attributes(decision: Any) -> dict[str, Any]:
    """A decision's numbers as span attributes (formula terms, no tokens)."""
    attrs: dict[str, Any] = {
        "nexuskv.request_id": decision.request_id,
        "nexuskv.tenant": decision.tenant_namespace,
        "nexuskv.action": decision.action.value,
        "nexuskv.worker": decision.worker,
        "nexuskv.prompt_tokens": decision.prompt_tokens,
        "nexuskv.reused_tokens": decision.reused_tokens,
        "nexuskv.t_compute_s": decision.t_compute_s,
        "nexuskv.t_with_reuse_s": decision.t_with_reuse_s,
        "nexuskv.eg_s": decision.eg_s,
        "nexuskv.eg_lower_s": decision.eg_lower_s,
        "nexuskv.t_cache_s": decision.terms.total_s,
        "nexuskv.transfer_s": decision.terms.transfer_s,
        "nexuskv.policy_version": decision.policy_version,
        "nexuskv.cost_model_version": decision.cost_model_version,
        "nexuskv.reason": decision.reason[:256],
    }
    if decision.source is not None:
        attrs["nexuskv.source"] = str(decision.source)
    return finite_attributes(attrs)


def quiet_libraries(level: str) -> None:
    """Client libraries log every group join and rebalance at INFO: keep them to warnings unless debugging."""
    if level != "DEBUG":
        for name in ("aiokafka", "kafka", "faust", "mode"):
            logging.getLogger(name).setLevel(logging.WARNING)


def init_service(service: str, settings: Any) -> None:
    """What every service process does first: logging, trace export, the metrics and health endpoint."""
    HEALTH.service = service
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries(settings.log_level)
    setup_tracing(service, settings.otlp_endpoint)
    serve_metrics(settings.metrics_port, host=settings.metrics_host)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def health_wsgi_app(registry: CollectorRegistry = REGISTRY, health: Health = HEALTH) -> Any:
    """``/livez`` and ``/readyz`` from ``health``; every other path the Prometheus metrics."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/livez", "/readyz"):
            ok, detail = health.alive() if path == "/livez" else health.ready()
            body = json.dumps({"ok": ok, "service": health.service, "detail": detail}).encode()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics(environ, start_response)

    return app


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


def serve_metrics(port: int, *, host: str = "127.0.0.1") -> bool:
    """Expose :data:`REGISTRY` and :data:`HEALTH` on ``host``:``port`` (0: off; loopback unless
    ``NEXUSKV_METRICS_HOST`` says otherwise). Returns whether a server was started."""
    if port <= 0:
        return False
    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    server = make_server(host, port, health_wsgi_app(), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="nexuskv-metrics", daemon=True).start()
    log.info("metrics on %s:%d/metrics, health on /livez and /readyz", host, port)
    return True
