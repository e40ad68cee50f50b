"""Trace context in headers, bounded metric labels, and a /metrics endpoint that answers."""

from __future__ import annotations

import urllib.request

from opentelemetry.sdk.trace import TracerProvider

from streams.bus.metrics import METRICS
from streams.bus.process import free_port
from streams.bus.tracing import carrier_headers, span_from_record
from streams.telemetry import reason_code, serve_metrics


def test_reason_codes_are_bounded_labels():
    assert reason_code("EG 0.41 s > 0 with 95% confidence: transfer host->gpu") == "EG"
    assert reason_code("backpressure: no transfer slot left") == "backpressure"
    assert reason_code("") == "unspecified"
    assert len(reason_code("x" * 500)) == 40


def test_headers_carry_the_trace_and_keep_the_callers():
    provider = TracerProvider()  # local provider: the global one may be set by another test
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("outer") as outer:
        headers = carrier_headers([("app", b"x")])
        trace_id = outer.get_span_context().trace_id
    assert headers[0] == ("app", b"x")
    traceparent = dict(headers)["traceparent"].decode()
    assert traceparent.split("-")[1] == f"{trace_id:032x}"
    with span_from_record("svc", "child", headers) as child:
        # Recording or not (that depends on the process's provider), the child continues the trace.
        assert child.get_span_context().trace_id == trace_id


def test_metrics_endpoint_serves_the_collectors():
    port = free_port()
    assert serve_metrics(port)
    assert not serve_metrics(0)
    METRICS.decisions.labels("recompute", "EG").inc()
    METRICS.transfers.labels("completed", "disk->gpu").inc(2)
    METRICS.consumer_lag.labels("test", "nexuskv.kv-events").set(7)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'nexuskv_decisions_total{action="recompute",reason="EG"}' in body
    assert 'nexuskv_transfer_outcomes_total{link="disk->gpu",status="completed"} 2.0' in body
    assert 'nexuskv_consumer_lag{service="test",topic="nexuskv.kv-events"} 7.0' in body
    for name in ("nexuskv_events_applied", "nexuskv_events_rejected", "nexuskv_index_memberships"):
        assert name in body


def _reachable(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _other_address() -> str | None:
    """An address of this host that is not loopback, if it has one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_metrics_bind_loopback_by_default():
    import pytest

    from nexuskv.config import Settings
    from nexuskv.errors import ConfigError

    assert Settings.from_env({}).metrics_host == "127.0.0.1"
    assert Settings.from_env({"NEXUSKV_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"
    assert Settings.from_env({"NEXUSKV_METRICS_HOST": "metrics.internal"}).metrics_host == "metrics.internal"
    with pytest.raises(ConfigError, match="NEXUSKV_METRICS_HOST"):
        Settings.from_env({"NEXUSKV_METRICS_HOST": "0.0.0.0:9000"})
    with pytest.raises(ConfigError, match="NEXUSKV_METRICS_HOST"):
        Settings.from_env({"NEXUSKV_METRICS_HOST": "bad host"})
    port = free_port()
    assert serve_metrics(port)  # the default host
    assert _reachable("127.0.0.1", port)
    other = _other_address()
    if other is not None:  # a host with another interface: the endpoint must not answer there
        assert not _reachable(other, port)
        wide = free_port()
        assert serve_metrics(wide, host="0.0.0.0")
        assert _reachable(other, wide)
