"""Tracing and metrics for every NexusKV service: one trace per request, Prometheus counters.

**Traces.** A request is one OpenTelemetry trace across every hop — plan request, index match,
decision, transfer, outcome record — because the context travels in Kafka record headers
(W3C ``traceparent``). :func:`streams.bus.send` injects the current context into every record it
sends; a consumer continues the trace with :func:`span_from_record`, so a service only has to
wrap its processing in that span. Decision numbers go on spans as attributes
(:func:`decision_attributes`), never token ids or prompt text. Export is OTLP over HTTP when
``NEXUSKV_OTLP_ENDPOINT`` is set (e.g. ``http://collector:4318``), off otherwise; tests install
an in-memory exporter with :func:`install_tracer_provider`.

We inject by hand rather than with ``opentelemetry-instrumentation-aiokafka``: Faust's consumer
runs in its own thread, so its receive spans would be orphans, and two injectors would write two
``traceparent`` headers (``stack.md`` §3).

**Metrics.** :data:`METRICS` are Prometheus collectors shared by the services (events applied
and rejected, consumer lag, decisions by action and reason, transfer outcomes, index size);
:func:`serve_metrics` exposes them on ``NEXUSKV_METRICS_PORT`` (0: off).

**Health.** :data:`HEALTH` is the process's liveness and readiness, served beside the metrics
as ``GET /livez`` and ``GET /readyz`` (200 with ``{"ok": true, ...}``, or 503 with the reason) and
as the gauges ``nexuskv_service_alive`` and ``nexuskv_service_ready``. *Alive*: no supervised task
has failed and the event loop answered its heartbeat within :data:`LOOP_STALL_S` (a loop held by
one piece of work is not alive). *Ready*: every readiness condition the service declared is met
(its consumer got partitions, its replica caught up, ...).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

__all__ = [
    "HEALTH",
    "Health",
    "LOOP_STALL_S",
    "METRICS",
    "REGISTRY",
    "carrier_headers",
    "decision_attributes",
    "init_service",
    "quiet_libraries",
    "install_tracer_provider",
    "serve_metrics",
    "setup_tracing",
    "reason_code",
    "span_from_record",
    "start_span_from_record",
    "tracer",
]

log = logging.getLogger(__name__)

_TRACER_NAME = "nexuskv"


def install_tracer_provider(provider: TracerProvider) -> None:
    """Make ``provider`` the process's tracer provider (OpenTelemetry allows one per process)."""
    trace.set_tracer_provider(provider)


def setup_tracing(service: str, otlp_endpoint: str | None, *, extra: Sequence[SpanProcessor] = ()) -> TracerProvider | None:
    """Configure this process to export spans of ``service``; None when tracing stays off."""
    processors: list[SpanProcessor] = list(extra)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")))
    if not processors:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for p in processors:
        provider.add_span_processor(p)
    install_tracer_provider(provider)
    return provider


def tracer(service: str) -> trace.Tracer:
    """A tracer whose spans name the service (``nexuskv.service`` attribute is set per span)."""
    return trace.get_tracer(f"{_TRACER_NAME}.{service}")


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
    attrs = {"nexuskv.service": service, **(attributes or {})}
    with tracer(service).start_as_current_span(name, context=parent, kind=trace.SpanKind.CONSUMER,
                                               attributes=attrs) as span:
        yield span


def start_span_from_record(service: str, name: str, headers: Sequence[tuple[str, bytes]] | dict | None,
                           attributes: dict[str, Any] | None = None) -> trace.Span:
    """A started (not current) span continuing a record's trace; end it, or ``trace.use_span`` it."""
    attrs = {"nexuskv.service": service, **(attributes or {})}
    return tracer(service).start_span(name, context=_context_of(headers), kind=trace.SpanKind.CONSUMER,
                                      attributes=attrs)


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
    return attrs


REGISTRY = CollectorRegistry(auto_describe=True)


class _Metrics:
    """Every service's Prometheus collectors, declared once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events_applied = Counter("nexuskv_events_applied", "KV lifecycle batches and block operations applied",
                                      ["service", "unit"], registry=registry)
        self.events_rejected = Counter("nexuskv_events_rejected", "records sent to the dead-letter topic",
                                       ["service", "topic"], registry=registry)
        self.consumer_lag = Gauge("nexuskv_consumer_lag", "records behind the end of the consumed topic",
                                  ["service", "topic"], registry=registry)
        # reason: a short code (the planner's reason up to its first ':'), never free text.
        self.decisions = Counter("nexuskv_decisions", "planner decisions", ["action", "reason"], registry=registry)
        self.transfers = Counter("nexuskv_transfer_outcomes", "transfer results", ["status", "link"],
                                 registry=registry)
        self.index_size = Gauge("nexuskv_index_memberships", "(block, location) memberships in the index",
                                ["service"], registry=registry)
        # kind: capacity, used, reserved (prefetch room and copies landing), pinned.
        self.tier_bytes = Gauge("nexuskv_tier_bytes", "bytes of a managed tier by kind", ["tier", "kind"],
                                registry=registry)
        self.unrecoverable = Counter("nexuskv_index_unrecoverable_records",
                                     "kv-events records that retention removed before this index applied them",
                                     ["service", "topic"], registry=registry)
        self.alive = Gauge("nexuskv_service_alive", "1 while no supervised task failed and the loop answers",
                           ["service"], registry=registry)
        self.ready = Gauge("nexuskv_service_ready", "1 while every readiness condition of the service holds",
                           ["service"], registry=registry)


METRICS = _Metrics(REGISTRY)


LOOP_STALL_S = 10.0  # an event loop that has not answered its heartbeat for this long is not alive


class Health:
    """This process's liveness and readiness (one service per process); thread-safe."""

    def __init__(self) -> None:
        self.service = "nexuskv"
        self._lock = threading.Lock()
        self._ready: dict[str, tuple[bool, str]] = {}
        self._failure: str | None = None
        self._beat: float | None = None  # monotonic time of the loop's last heartbeat; None: not watched

    def set_ready(self, condition: str, ok: bool, detail: str = "") -> None:
        with self._lock:
            self._ready[condition] = (ok, detail)
        METRICS.ready.labels(self.service).set(1 if self.ready()[0] else 0)

    def fail(self, reason: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = reason[:500]
        METRICS.alive.labels(self.service).set(0)

    def beat(self) -> None:
        self._beat = time.monotonic()

    def alive(self) -> tuple[bool, str]:
        with self._lock:
            failure, beat = self._failure, self._beat
        if failure is not None:
            return False, f"failed: {failure}"
        if beat is not None and time.monotonic() - beat > LOOP_STALL_S:
            return False, f"event loop has not answered for {time.monotonic() - beat:.1f}s"
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        alive, why = self.alive()
        if not alive:
            return False, why
        with self._lock:
            waiting = [f"{name}: {detail}" if detail else name for name, (ok, detail) in self._ready.items() if not ok]
        return (not waiting), ("; ".join(waiting) if waiting else "ready")

    async def heartbeat(self, interval_s: float = 1.0) -> None:
        """Beat every ``interval_s`` on the running loop (a supervised task of every service)."""
        import asyncio

        while True:
            self.beat()
            METRICS.alive.labels(self.service).set(1 if self.alive()[0] else 0)
            await asyncio.sleep(interval_s)


HEALTH = Health()


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
    serve_metrics(settings.metrics_port)


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


def serve_metrics(port: int, *, host: str = "0.0.0.0") -> bool:
    """Expose :data:`REGISTRY` and :data:`HEALTH` on ``port`` (0: off). Returns whether a server was started."""
    if port <= 0:
        return False
    server = make_server(host, port, health_wsgi_app(), _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="nexuskv-metrics", daemon=True).start()
    log.info("metrics on :%d/metrics, health on /livez and /readyz", port)
    return True
