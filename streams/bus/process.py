"""Child processes that never outlive NexusKV, and a Kafka readiness probe.

A broker started by NexusKV runs in its own session (so it and its children stop as a group)
and is bound to its parent with ``PR_SET_PDEATHSIG``: if the parent is SIGKILLed, the kernel
kills the broker too. ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child
exits, so start children from a thread that lives as long as they should (the main thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nexuskv.errors import BrokerError

__all__ = ["ManagedProcess", "free_port", "kafka_api_versions_ok", "wait_for_kafka", "freeze_startup_heap"]

_PR_SET_PDEATHSIG = 1


def _bind_to_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets: how a service's main loop learns to stop and clean
    up (call it inside the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def freeze_startup_heap() -> int:
    """Move every object alive now out of the garbage collector's scans (``gc.freeze``); returns how many.

    A service calls it once, when it has started (modules imported, settings read, replicas
    restored). A full collection then scans only what the service allocated since: decoding one
    large record (65,536 events) triggers full collections, and with every module's objects in
    the scan each one held the event loop for 100-170 ms here; frozen, the pause is what the
    record itself allocated. Frozen objects are never freed, which for start-up state (modules,
    classes, settings) they would not be anyway."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedProcess:
    """A child process with its own process group, stopped (TERM, then KILL) as a whole."""

    def __init__(self, argv: Sequence[str], *, name: str, log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.argv = list(argv)
        self.name = name
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal); else None."""
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        try:
            self._proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, preexec_fn=_bind_to_parent, close_fds=True,
            )
        except OSError as exc:
            raise BrokerError(f"cannot start {self.name}: {exc}") from None
        finally:
            log.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the whole process group; waits until the process is gone."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout_s)
        # Reap stragglers of the group (children that ignored TERM).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self._proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def kafka_api_versions_ok(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when a Kafka-protocol broker answers ApiVersions (v0) on host:port."""
    client = b"nexuskv-probe"
    body = struct.pack(">hhih", 18, 0, 7, len(client)) + client
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(struct.pack(">i", len(body)) + body)
            head = _recv_exact(s, 4)
            size = struct.unpack(">i", head)[0]
            if not 6 <= size <= 1 << 20:
                return False
            resp = _recv_exact(s, size)
    except OSError:
        return False
    correlation, error = struct.unpack(">ih", resp[:6])
    return correlation == 7 and error == 0


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return bytes(buf)


def wait_for_kafka(host: str, port: int, *, timeout_s: float, process: ManagedProcess | None = None,
                   what: str = "broker") -> float:
    """Block until the broker answers; returns seconds waited. Raises BrokerError on timeout or exit."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise BrokerError(f"{what} exited during start-up; log tail:\n{process.log_tail()}")
        if kafka_api_versions_ok(host, port):
            return time.monotonic() - start
        time.sleep(0.1)
    raise BrokerError(f"{what} at {host}:{port} did not answer within {timeout_s:.0f}s")
