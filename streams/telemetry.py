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
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry, make_wsgi_app

from streams.bus.health import HEALTH, Health
from streams.bus.metrics import REGISTRY

__all__ = [
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
