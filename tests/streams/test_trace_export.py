"""Trace export never holds a request: a collector that is down or hung costs spans, counted.

Real OTLP/HTTP exporter (the one ``NEXUSKV_OTLP_ENDPOINT`` configures) against a port nothing
listens on and against a server that accepts connections and never answers.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider

from streams.bus.metrics import METRICS
from streams.telemetry import BoundedSpanProcessor, otlp_processor


def _dropped(service: str, reason: str) -> float:
    return METRICS.spans_dropped.labels(service, reason)._value.get()


def _exported(service: str) -> float:
    return METRICS.spans_exported.labels(service)._value.get()


@pytest.fixture
def hung_collector():
    """A TCP server that accepts every connection and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    srv.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _end_spans(processor: BoundedSpanProcessor, n: int) -> None:
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    for i in range(n):
        with tracer.start_as_current_span("request") as span:
            span.set_attribute("i", i)


def test_a_hung_collector_costs_spans_counted_never_the_caller(hung_collector):
    service = "test-hung"
    processor = otlp_processor(service, hung_collector, timeout_s=1.0, max_queue=100)
    before = _dropped(service, "queue_full")
    _end_spans(processor, 2000)
    # The export thread is stuck in its first call (1 s, then retries) while 2000 spans end: a
    # processor that waited for room would have dropped none; this one dropped all but the queue
    # and the one batch in flight, and counted them.
    dropped = _dropped(service, "queue_full") - before
    assert dropped >= 2000 - 100 - 512, dropped
    assert processor.waiting() <= 100
    processor.shutdown()


def test_a_collector_that_is_down_fails_exports_counted():
    service = "test-down"
    processor = otlp_processor(service, f"http://127.0.0.1:{_closed_port()}", timeout_s=0.5, max_queue=1000)
    before = _dropped(service, "export_failed")
    _end_spans(processor, 50)
    processor.force_flush(5000)
    deadline = time.monotonic() + 10
    while _dropped(service, "export_failed") - before < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dropped(service, "export_failed") - before == 50
    assert _exported(service) == 0
    processor.shutdown()


def test_a_live_collector_gets_every_span(jaeger):
    service = "test-export-live"
    processor = otlp_processor(service, jaeger.otlp_http_url)
    _end_spans(processor, 20)
    assert processor.force_flush(10_000)
    assert _exported(service) == 20
    assert _dropped(service, "queue_full") == 0 and _dropped(service, "export_failed") == 0
    processor.shutdown()


def test_a_non_finite_attribute_leaves_the_trace_readable_in_jaeger(jaeger):
    """An unknown index lag is ``inf``: Jaeger stores such a span but its query API then answers 500
    for every trace of the service; NexusKV's spans carry it as text, and the trace stays readable."""
    from opentelemetry.sdk.resources import Resource

    from nexuskv.errors import JaegerError
    from streams.bus.tracing import finite_attributes

    def export(service: str, attributes: dict) -> None:
        processor = otlp_processor(service, jaeger.otlp_http_url)
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(processor)
        with provider.get_tracer("test").start_as_current_span("index.match", attributes=attributes):
            pass
        assert processor.force_flush(10_000)
        processor.shutdown()

    lag = {"nexuskv.index_lag_ms": float("inf"), "nexuskv.eg_lower_s": float("-inf"), "nexuskv.blocks": 3}
    export("test-raw-inf", lag)
    with pytest.raises(JaegerError, match="500"):  # what the conversion is for
        jaeger.wait_for_spans("test-raw-inf", 1)
    export("test-finite-inf", finite_attributes(lag))
    traces = jaeger.wait_for_spans("test-finite-inf", 1)
    tags = {t["key"]: t["value"] for t in traces[0]["spans"][0]["tags"]}
    assert tags["nexuskv.index_lag_ms"] == "inf" and tags["nexuskv.eg_lower_s"] == "-inf"
    assert tags["nexuskv.blocks"] == 3
