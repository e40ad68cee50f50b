"""A real Jaeger: built from the pinned Go module, started on loopback, fed by NexusKV's own tracing.

The tests that need Jaeger's binary wait for the build the session started at collection
(``tests/conftest.py``); a cold build takes minutes, a cached one nothing. The error paths run
against empty cache folders in ``tmp_path``: the real cache is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from nexuskv.errors import ConfigError, JaegerError
from streams.app.jaeger import GO_MODULE, JAEGER_VERSION, JaegerEndpoints, JaegerPorts, JaegerServer, provision_jaeger

REPO = Path(__file__).resolve().parents[3]


def test_the_go_module_pins_the_version_the_code_builds():
    go_mod = (GO_MODULE / "go.mod").read_text()
    assert "tool github.com/jaegertracing/jaeger/cmd/jaeger" in go_mod
    assert f"\tgithub.com/jaegertracing/jaeger {JAEGER_VERSION} " in go_mod
    go_sum = (GO_MODULE / "go.sum").read_text().splitlines()
    assert any(line.startswith(f"github.com/jaegertracing/jaeger {JAEGER_VERSION} h1:") for line in go_sum)


def test_an_override_names_its_variable_when_malformed():
    ok = JaegerEndpoints.parse("http://10.0.0.5:4318/, http://10.0.0.5:16686", field="NEXUSKV_TEST_JAEGER")
    assert ok == JaegerEndpoints(otlp_http_url="http://10.0.0.5:4318", query_url="http://10.0.0.5:16686")
    assert ok.ui_url == "http://10.0.0.5:16686/"
    for bad in ("http://10.0.0.5:4318", "kafka://h:1,http://h:2", "http://h,http://h:2"):
        with pytest.raises(ConfigError) as err:
            JaegerEndpoints.parse(bad, field="NEXUSKV_TEST_JAEGER")
        assert err.value.field == "NEXUSKV_TEST_JAEGER"


def test_without_go_the_cli_fails_in_one_line_naming_go(tmp_path):
    cache = tmp_path / "cache"
    bare = tmp_path / "bin"  # a PATH without go (python is started by its full path)
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare), "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "streams.app.cli", "jaeger"], capture_output=True, text=True,
                          env=env, timeout=60, cwd=REPO, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        (f"nexuskv: error: building Jaeger {JAEGER_VERSION} needs Go (go) on PATH, 1.24.6 or newer "
         "(https://go.dev/dl/); the first build takes 5-16 minutes on two cores")]
    assert not (cache / "nexuskv" / "jaeger" / JAEGER_VERSION / "jaeger").exists()


def _fake_go(folder: Path, body: str) -> Path:
    """A ``go`` on PATH that plays a build: ``body`` runs with the build's arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    go = folder / "go"
    go.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    go.chmod(0o755)
    return folder


def test_a_failing_build_raises_with_the_log_tail_and_leaves_no_binary(tmp_path, monkeypatch):
    bin_dir = _fake_go(tmp_path / "bin", """\
        echo "go: downloading github.com/jaegertracing/jaeger"
        echo "cmd/jaeger/main.go:1:1: simulated compile error" >&2
        exit 3
    """)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    with pytest.raises(JaegerError) as err:
        provision_jaeger(tmp_path / "cache")
    message = str(err.value)
    assert message.splitlines()[0].startswith(
        f"go build of Jaeger {JAEGER_VERSION} failed (exit 3): cmd/jaeger/main.go:1:1: simulated compile error; log ")
    assert "go: downloading github.com/jaegertracing/jaeger" in message  # the tail, beyond the first line
    assert sorted(p.name for p in (tmp_path / "cache" / JAEGER_VERSION).iterdir()) == [".lock", "build.log"]


_PLAYED_BUILD = """\
    echo build >> "$BUILD_COUNT"
    sleep 1
    while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
    printf '#!/bin/sh\\n' > "$out" && chmod +x "$out"
"""


def test_concurrent_processes_build_once(tmp_path):
    bin_dir = _fake_go(tmp_path / "bin", _PLAYED_BUILD)
    count = tmp_path / "builds"
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "BUILD_COUNT": str(count), "PYTHONPATH": str(REPO)}
    code = ("import sys; from pathlib import Path; from streams.app.jaeger import provision_jaeger; "
            "print(provision_jaeger(Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "cache" / JAEGER_VERSION / "jaeger")}
    assert count.read_text().splitlines() == ["build"]


def test_a_cancelled_build_stops_go_and_its_children(tmp_path, monkeypatch):
    pid_file = tmp_path / "compiler.pid"
    bin_dir = _fake_go(tmp_path / "bin", f"""\
        sleep 60 &
        echo $! > {pid_file}
        wait
    """)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    with pytest.raises(JaegerError, match="was cancelled"):
        provision_jaeger(tmp_path / "cache", cancel=cancel)
    compiler = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(compiler):
        time.sleep(0.1)
    assert not _alive(compiler), "the build's child outlived the cancelled build"
    assert not list((tmp_path / "cache" / JAEGER_VERSION).glob("jaeger*"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_provisioning_again_returns_the_cached_binary_without_go(jaeger_binary, monkeypatch, tmp_path):
    before = jaeger_binary.stat()
    build_log = jaeger_binary.with_name("build.log").stat()
    monkeypatch.setenv("PATH", str(tmp_path))  # no go: a build would fail
    started = time.monotonic()
    assert provision_jaeger() == jaeger_binary
    print(f"warm provisioning: {(time.monotonic() - started) * 1e3:.2f} ms")
    after = jaeger_binary.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert jaeger_binary.with_name("build.log").stat().st_mtime_ns == build_log.st_mtime_ns


_EXPORT_TWO_SPANS = """\
import json, sys
from opentelemetry import trace
from nexuskv.config import Settings
from streams.bus.tracing import carrier_headers, span_from_record, tracer
from streams.telemetry import init_service

service = sys.argv[1]
init_service(service, Settings.from_env())
with tracer(service).start_as_current_span("plan-request", attributes={"nexuskv.request_id": "req-7"}) as parent:
    headers = carrier_headers()  # what streams.bus.clients.send puts on a Kafka record
    with span_from_record(service, "decide", headers, {"nexuskv.action": "recompute", "nexuskv.eg_s": -0.25}) as child:
        pass
trace.get_tracer_provider().shutdown()  # flushes the batch exporter
print(json.dumps({"trace": format(parent.get_span_context().trace_id, "032x"),
                  "parent": format(parent.get_span_context().span_id, "016x"),
                  "child": format(child.get_span_context().span_id, "016x")}))
"""


@pytest.mark.slow
def test_spans_exported_by_nexuskv_tracing_arrive_as_one_trace(jaeger):
    service = f"nexuskv-test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "NEXUSKV_OTLP_ENDPOINT": jaeger.otlp_http_url, "NEXUSKV_METRICS_PORT": "0",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _EXPORT_TWO_SPANS, service], capture_output=True, text=True,
                          env=env, timeout=60, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stdout.strip().splitlines()[-1])

    traces = jaeger.wait_for_spans(service, 2)
    assert [t["traceID"] for t in traces] == [ids["trace"]]
    spans = {s["operationName"]: s for s in traces[0]["spans"]}
    assert sorted(spans) == ["decide", "plan-request"]
    parent, child = spans["plan-request"], spans["decide"]
    assert parent["spanID"] == ids["parent"] and child["spanID"] == ids["child"]
    assert parent["references"] == []
    assert child["references"] == [{"refType": "CHILD_OF", "traceID": ids["trace"], "spanID": ids["parent"]}]
    tags = {name: {t["key"]: t["value"] for t in span["tags"]} for name, span in spans.items()}
    assert tags["plan-request"]["nexuskv.request_id"] == "req-7"
    assert tags["decide"]["nexuskv.action"] == "recompute"
    assert tags["decide"]["nexuskv.eg_s"] == -0.25
    assert tags["decide"]["nexuskv.service"] == service
    assert tags["decide"]["span.kind"] == "consumer"
    assert {p["serviceName"] for p in traces[0]["processes"].values()} == {service}
    assert service in jaeger.services()


def _listening_ports(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)
                if family == socket.AF_INET:
                    raw = raw[::-1]
                else:
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


@pytest.mark.slow
def test_the_server_listens_on_its_loopback_ports_only_and_stops(jaeger_binary):
    with JaegerServer(binary=jaeger_binary) as server:
        pid = server.process.pid
        ports = server.ports
        assert _listening_ports(pid) == {("127.0.0.1", p) for p in
                                         (ports.otlp_grpc, ports.otlp_http, ports.query_http, ports.query_grpc)}
        assert server.otlp_grpc_endpoint == f"127.0.0.1:{ports.otlp_grpc}"
        assert server.traces("no-such-service") == []
        with urllib.request.urlopen(server.ui_url, timeout=5) as page:
            assert page.status == 200
        work = server.work_dir
    assert not _alive(pid)
    assert not work.exists()


@pytest.mark.slow
def test_a_taken_port_fails_the_start_with_the_log_tail(jaeger_binary):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = JaegerPorts.free(otlp_http=taken.getsockname()[1])
        server = JaegerServer(binary=jaeger_binary, ports=ports)
        with pytest.raises(JaegerError) as err:
            server.start()
    first = str(err.value).splitlines()[0]
    assert first.startswith("Jaeger exited during start-up (status 1): ")
    assert f"listen tcp 127.0.0.1:{ports.otlp_http}: bind: address already in use; log {server.log_path}" in first
    assert server.process is None
    assert "address already in use" in server.log_path.read_text()  # the log it names is kept
    server.stop()
    assert not server.work_dir.exists()


@pytest.mark.slow
def test_the_cli_prints_the_endpoints_and_stops_on_sigterm(jaeger_binary):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "streams.app.cli", "jaeger"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(line.startswith("query API:") for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        otlp = next(line.split("=", 1)[1].strip() for line in lines if line.startswith("NEXUSKV_OTLP_ENDPOINT="))
        query = next(line.split()[2] for line in lines if line.startswith("query API:")).split("/api/")[0]
        endpoints = JaegerEndpoints.parse(f"{otlp},{query}", field="output")
        assert endpoints.services() == []
        jaeger_pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_jaeger_child(int(p), proc.pid)]
        assert len(jaeger_pids) == 1, lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _alive(jaeger_pids[0]), "Jaeger outlived nexuskv jaeger"


def _is_jaeger_child(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        return ppid == parent and Path(f"/proc/{pid}/exe").resolve().name == "jaeger"
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
