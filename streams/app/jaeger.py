"""A local Jaeger for NexusKV's traces: built from its pinned Go module, started on loopback.

* :func:`provision_jaeger` builds Jaeger's backend (v2, ``cmd/jaeger``) with the machine's Go from
  the module pinned in ``infra/jaeger/go.mod`` (``go.sum`` fixes every dependency), once, into
  ``$XDG_CACHE_HOME/nexuskv/jaeger/<version>/jaeger`` (``~/.cache`` without XDG). Go's module and
  build caches live beside it (``.../jaeger/go/``), so a rebuild, or the next version, is quick.
  A file lock makes concurrent test sessions and processes build once; the binary appears
  atomically when whole. Nothing of Jaeger is vendored into the repository.
* :class:`JaegerServer` runs that binary with a config written into its work folder: OTLP
  receivers (gRPC and HTTP) and the query service (HTTP API, gRPC) on free loopback ports, memory
  storage, no other listener (no self-tracing, no metrics port), so two sessions never collide.
  It is ready when the query API answers and both receivers accept connections.
* :class:`JaegerEndpoints` is where a Jaeger is (started here or given), and asks its query API
  for a service's traces (``/api/traces``) with plain ``urllib``.

The server is a child bound to its parent (:mod:`streams.bus.process`): it never outlives NexusKV.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from nexuskv.errors import BrokerError, ConfigError, JaegerError
from streams.bus.process import ManagedProcess

__all__ = [
    "GO_MODULE",
    "JAEGER_VERSION",
    "JaegerEndpoints",
    "JaegerPorts",
    "JaegerServer",
    "jaeger_cache_dir",
    "provision_jaeger",
]

log = logging.getLogger(__name__)

JAEGER_VERSION = "v1.76.0"  # must equal infra/jaeger/go.mod's requirement (a test checks)
GO_MODULE = Path(__file__).resolve().parents[2] / "infra" / "jaeger"
_PACKAGE = "github.com/jaegertracing/jaeger/cmd/jaeger"
_BUILD_TIMEOUT_S = 1800.0
# Measured with empty caches on 2 cores: about 5 min (a scratch build), 16 min beside other test runs
# (downloading 215 MB of modules included); 9 s again with the caches and no binary.
_FIRST_BUILD = "the first build takes 5-16 minutes on two cores"


def jaeger_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/nexuskv/jaeger`` (``~/.cache/nexuskv/jaeger`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nexuskv" / "jaeger"


def provision_jaeger(cache: Path | None = None, *, niceness: int = 0, timeout_s: float = _BUILD_TIMEOUT_S,
                     cancel: threading.Event | None = None) -> Path:
    """The Jaeger binary of :data:`JAEGER_VERSION`, built with ``go build`` on first use (cached).

    ``niceness`` > 0 runs the build under ``nice`` (a build in the background of a test session
    yields the CPU to the tests); setting ``cancel`` stops a build (go and its compilers) within
    half a second. Raises :class:`JaegerError` naming ``go`` when Go is not on PATH or the build
    fails (with the build log's tail), is cancelled or takes longer than ``timeout_s``."""
    root = cache or jaeger_cache_dir()
    home = root / JAEGER_VERSION
    binary = home / "jaeger"
    if _is_executable(binary):
        return binary
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building waits here, then finds the binary
        if _is_executable(binary):
            return binary
        _build(root, binary, niceness=niceness, timeout_s=timeout_s, cancel=cancel)
    return binary


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _build(root: Path, binary: Path, *, niceness: int, timeout_s: float, cancel: threading.Event | None) -> None:
    if not (GO_MODULE / "go.mod").is_file() or not (GO_MODULE / "go.sum").is_file():
        raise JaegerError(f"building Jaeger needs a source checkout: {GO_MODULE}/go.mod and go.sum are missing")
    go = shutil.which("go")
    if go is None:
        raise JaegerError(f"building Jaeger {JAEGER_VERSION} needs Go (go) on PATH, 1.24.6 or newer "
                          f"(https://go.dev/dl/); {_FIRST_BUILD}")
    for stale in binary.parent.glob("jaeger.tmp*"):  # left by a process that died building (we hold the lock)
        stale.unlink(missing_ok=True)
    tmp = binary.with_name(f"jaeger.tmp{os.getpid()}")
    build_log = binary.with_name("build.log")
    env = dict(os.environ, GOMODCACHE=str(root / "go" / "mod"), GOCACHE=str(root / "go" / "build"),
               GOWORK="off", CGO_ENABLED="0",
               # -modcacherw: a module cache that `rm -rf` can remove; -mod=readonly: go.sum is the pin.
               GOFLAGS=" ".join(filter(None, [os.environ.get("GOFLAGS", ""), "-modcacherw", "-mod=readonly"])))
    argv = [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(tmp), _PACKAGE]
    if niceness > 0 and (nice := shutil.which("nice")):
        argv = [nice, "-n", str(niceness), *argv]
    log.info("building Jaeger %s with %s into %s (%s; log: %s)", JAEGER_VERSION, go, binary, _FIRST_BUILD,
             build_log)
    started = time.monotonic()
    with open(build_log, "wb") as out:
        try:
            proc = subprocess.Popen(argv, cwd=GO_MODULE, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise JaegerError(f"cannot run go to build Jaeger {JAEGER_VERSION}: {exc}") from None
        deadline = started + timeout_s
        try:
            while (code := proc.poll()) is None:
                if cancel is not None and cancel.is_set():
                    _stop_build(proc, tmp)
                    raise JaegerError(f"go build of Jaeger {JAEGER_VERSION} was cancelled")
                if time.monotonic() > deadline:
                    _stop_build(proc, tmp)
                    raise JaegerError(f"go build of Jaeger {JAEGER_VERSION} did not finish within {timeout_s:.0f}s; "
                                      f"log {build_log}, tail:\n{_tail(build_log)}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.5)
        except BaseException:  # the caller was interrupted (or the above): the build stops with it
            _stop_build(proc, tmp)
            raise
    if code != 0 or not _is_executable(tmp):
        tmp.unlink(missing_ok=True)
        tail = _tail(build_log)
        raise JaegerError(f"go build of Jaeger {JAEGER_VERSION} failed (exit {code}): {_last_line(tail)}; "
                          f"log {build_log}, tail:\n{tail}")
    os.replace(tmp, binary)
    log.info("built Jaeger %s in %.0fs: %s (%.0f MB)", JAEGER_VERSION, time.monotonic() - started, binary,
             binary.stat().st_size / 1e6)


def _stop_build(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    """Kill the build's whole process group (go and its compilers) and drop its partial output."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        proc.wait()
    tmp.unlink(missing_ok=True)


def _last_line(text: str, prefix: str = "") -> str:
    """The last non-empty line of ``text`` (starting with ``prefix``, which is dropped): the error
    itself, for an error's first line, which is all the CLI prints."""
    for line in reversed(text.splitlines()):
        if line.strip() and line.startswith(prefix):
            return line[len(prefix):].strip()
    return "(no output)"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class JaegerEndpoints:
    """Where a Jaeger listens, and its query API's answers.

    ``otlp_http_url`` is what ``NEXUSKV_OTLP_ENDPOINT`` takes (``http://host:port``, the exporter
    adds ``/v1/traces``); ``query_url`` serves ``/api/services`` and ``/api/traces``. A Jaeger
    built with ``go build`` has no UI assets (they come from a separate npm build): its
    ``ui_url`` answers with a placeholder page, while the API works."""

    otlp_http_url: str
    query_url: str

    @property
    def ui_url(self) -> str:
        return self.query_url + "/"

    @classmethod
    def parse(cls, value: str, *, field: str) -> JaegerEndpoints:
        """``http://host:otlp-http-port,http://host:query-port`` (e.g. a NEXUSKV_TEST_JAEGER override)."""
        parts = [p.strip().rstrip("/") for p in value.split(",")]
        if len(parts) != 2:
            raise ConfigError(field, f"expected 'OTLP_HTTP_URL,QUERY_URL' (two http:// URLs), got {value!r}")
        for part in parts:
            url = urllib.parse.urlsplit(part)
            if url.scheme not in ("http", "https") or not url.hostname or url.port is None:
                raise ConfigError(field, f"{part!r} is not an http://host:port URL")
        return cls(otlp_http_url=parts[0], query_url=parts[1])

    def services(self, *, timeout_s: float = 5.0) -> list[str]:
        """The service names Jaeger holds spans of."""
        return list(self._get("/api/services", {}, timeout_s).get("data") or [])

    def traces(self, service: str, *, limit: int = 100, lookback: str = "1h",
               timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """``service``'s traces as the query API returns them (Jaeger's JSON: ``traceID``, ``spans``
        with ``references`` and ``tags``, ``processes``); an empty list for an unknown service."""
        return list(self._get("/api/traces", {"service": service, "limit": str(limit), "lookback": lookback},
                              timeout_s).get("data") or [])

    def wait_for_spans(self, service: str, count: int, *, timeout_s: float = 15.0) -> list[dict[str, Any]]:
        """``service``'s traces once they hold at least ``count`` spans in all (export is batched)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.traces(service)
            if sum(len(t.get("spans", ())) for t in found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def _get(self, path: str, query: dict[str, str], timeout_s: float) -> dict[str, Any]:
        url = self.query_url + path + (("?" + urllib.parse.urlencode(query)) if query else "")
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and path == "/api/traces":
                return {}  # Jaeger answers 404 for a service it has no spans of
            raise JaegerError(f"Jaeger query {url} answered {exc.code}: {exc.read()[:300]!r}") from None
        except (OSError, ValueError) as exc:
            raise JaegerError(f"Jaeger query {url} failed: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class JaegerPorts:
    """The four ports a :class:`JaegerServer` listens on."""

    otlp_grpc: int
    otlp_http: int
    query_http: int
    query_grpc: int

    @classmethod
    def free(cls, host: str = "127.0.0.1", *, otlp_http: int | None = None,
             query_http: int | None = None) -> JaegerPorts:
        """Ports free a moment ago on ``host`` (distinct: all are held while chosen), or those given."""
        with contextlib.ExitStack() as held:
            picked = []
            for _ in range(4):
                s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                s.bind((host, 0))
                picked.append(int(s.getsockname()[1]))
        return cls(otlp_grpc=picked[0], otlp_http=otlp_http or picked[1], query_http=query_http or picked[2],
                   query_grpc=picked[3])


def jaeger_config(host: str, ports: JaegerPorts) -> dict[str, Any]:
    """Jaeger v2's config (an OpenTelemetry Collector config, as in its ``cmd/jaeger/internal/
    all-in-one.yaml``): OTLP in, memory storage, the query extension; every listener on ``host``."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                     "exporters": ["jaeger_storage_exporter"]}},
            "telemetry": {"resource": {"service.name": "jaeger"},
                          "metrics": {"level": "none"},  # no Prometheus port (8888 by default)
                          "logs": {"level": "info"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memory_store": {"memory": {"max_traces": 100000}}}},
            "jaeger_query": {
                "storage": {"traces": "memory_store"},
                "enable_tracing": False,  # its own spans would go to OTEL_EXPORTER_OTLP_ENDPOINT (localhost:4318)
                "http": {"endpoint": f"{host}:{ports.query_http}"},
                "grpc": {"endpoint": f"{host}:{ports.query_grpc}"},
            },
        },
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"{host}:{ports.otlp_grpc}"},
                                             "http": {"endpoint": f"{host}:{ports.otlp_http}"}}}},
        "processors": {"batch": {}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory_store"}},
    }


class JaegerServer:
    """Jaeger on loopback for the life of a ``with`` block (memory storage: traces go with it)."""

    def __init__(self, *, binary: Path | None = None, host: str = "127.0.0.1", ports: JaegerPorts | None = None,
                 start_timeout_s: float = 60.0, work_dir: Path | None = None) -> None:
        self.binary = binary
        self.host = host
        self.ports = ports or JaegerPorts.free(host)
        self.start_timeout_s = start_timeout_s
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="nexuskv-jaeger-"))
        self.process: ManagedProcess | None = None
        self.startup_s: float | None = None

    @property
    def endpoints(self) -> JaegerEndpoints:
        return JaegerEndpoints(otlp_http_url=f"http://{self.host}:{self.ports.otlp_http}",
                               query_url=f"http://{self.host}:{self.ports.query_http}")

    @property
    def otlp_http_url(self) -> str:
        return self.endpoints.otlp_http_url

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"{self.host}:{self.ports.otlp_grpc}"

    @property
    def query_url(self) -> str:
        return self.endpoints.query_url

    @property
    def ui_url(self) -> str:
        return self.endpoints.ui_url

    @property
    def log_path(self) -> Path:
        return self.work_dir / "jaeger.log"

    def traces(self, service: str, *, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """``service``'s traces from this server's query API."""
        return self.endpoints.traces(service, timeout_s=timeout_s)

    def start(self) -> Self:
        binary = self.binary or provision_jaeger()
        config = self.work_dir / "config.yaml"
        # JSON is YAML: the collector's YAML reader takes it, and it needs no YAML writer here.
        config.write_text(json.dumps(jaeger_config(self.host, self.ports), indent=2) + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.process = ManagedProcess([str(binary), "--config", str(config)], name="jaeger", log_path=self.log_path,
                                      env=env, cwd=self.work_dir)
        try:
            self.process.start()
        except BrokerError as exc:  # ManagedProcess's error for a process that cannot be started
            self._stop_process()
            raise JaegerError(f"cannot start Jaeger {binary}: {exc}") from None
        try:
            self.startup_s = self._wait_ready()
        except JaegerError:
            self._stop_process()  # the work folder stays: the error names its log
            raise
        log.info("Jaeger ready in %.1fs: OTLP/HTTP %s, query %s", self.startup_s, self.otlp_http_url, self.query_url)
        return self

    def _wait_ready(self) -> float:
        process = self.process
        if process is None:
            raise JaegerError("Jaeger was not started")
        started = time.monotonic()
        deadline = started + self.start_timeout_s
        while time.monotonic() < deadline:
            if not process.alive():
                tail = process.log_tail()
                raise JaegerError(f"Jaeger exited during start-up (status {process.exit_code}): "
                                  f"{_last_line(tail, 'Error: ')}; log {self.log_path}, tail:\n{tail}")
            if self._answers():
                return time.monotonic() - started
            time.sleep(0.1)
        raise JaegerError(f"Jaeger did not answer on {self.query_url} within {self.start_timeout_s:.0f}s; "
                          f"log {self.log_path}, tail:\n{process.log_tail()}")

    def _answers(self) -> bool:
        for port in (self.ports.otlp_http, self.ports.otlp_grpc):
            try:
                socket.create_connection((self.host, port), timeout=0.5).close()
            except OSError:
                return False
        try:
            self.endpoints.services(timeout_s=1.0)
        except JaegerError:
            return False
        return True

    def _stop_process(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def stop(self) -> None:
        self._stop_process()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

