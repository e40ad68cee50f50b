"""Every service of ``nexuskv up`` serves ``/metrics`` that Prometheus's own parser reads.

``nexuskv up`` on the session's Apache Kafka with ``NEXUSKV_METRICS_PORT`` set: each service gets
its own port (the base, +1, ... in start order). Each endpoint is scraped and parsed with
``prometheus_client.parser`` (the reference implementation of the text exposition format); the
metrics the README tells operators to alert on are present in the families every service declares.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streams.app.services import SERVICES

NEXUSKV = [sys.executable, "-m", "streams.app.cli"]

#: What the README's "Metrics to alert on" list names; every service declares them (one registry).
ALERTED = {"nexuskv_consumer_lag", "nexuskv_events_rejected", "nexuskv_transfer_outcomes",
           "nexuskv_decisions", "nexuskv_service_alive", "nexuskv_service_ready", "nexuskv_spans_dropped",
           "nexuskv_records_refused", "nexuskv_hints_refused",
           "nexuskv_index_unrecoverable_records"}


def _free_run(n: int) -> int:
    """A base port with the n ports from it free (checked by binding each)."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        if base + n >= 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                t.bind(("127.0.0.1", p))
                held.append(t)
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError("no run of free ports")


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.mark.broker
def test_every_service_metrics_parse_with_the_exposition_parser(kafka_url, tmp_path):
    from streams.bus.process import free_port

    base = _free_run(len(SERVICES))
    env = {**os.environ, "NEXUSKV_BROKER": str(kafka_url), "NEXUSKV_DATA_DIR": str(tmp_path),
           "NEXUSKV_INDEX_API_PORT": str(free_port()), "NEXUSKV_METRICS_PORT": str(base)}
    proc = subprocess.Popen(NEXUSKV + ["up"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "Ctrl-C to stop" in line or not line:
                break
        assert proc.poll() is None, proc.stdout.read()
        texts: dict[str, str] = {}  # each service's first scrape that reports it alive (1)
        deadline = time.monotonic() + 120
        while len(texts) < len(SERVICES) and time.monotonic() < deadline:
            for i, svc in enumerate(SERVICES):
                if svc.name not in texts and (text := _scrape(base + i)) is not None:
                    if re.search(r'^nexuskv_service_alive\{service="[^"]+"\} 1\.0$', text, re.M):
                        texts[svc.name] = text
            time.sleep(0.5)
        missing = sorted({s.name for s in SERVICES} - set(texts))
        tails = {m: (tmp_path / "logs" / f"{m}.log").read_text()[-1500:] for m in missing
                 if (tmp_path / "logs" / f"{m}.log").exists()}
        assert not missing, f"no /metrics reporting alive from {missing}: {tails}"
        for name, text in texts.items():
            families = {f.name: f for f in text_string_to_metric_families(text)}  # raises on a malformed line
            # Counters are exposed as NAME_total; the parser names the family NAME.
            assert ALERTED <= set(families), (name, sorted(ALERTED - set(families)))
            alive = [s for s in families["nexuskv_service_alive"].samples if s.value == 1.0]
            assert len(alive) == 1, f"{name} reports {families['nexuskv_service_alive'].samples}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
