"""The node's index sidecar for tests: ``python -m streams.index_sidecar``, as ``nexuskv up`` runs it.

:func:`start_sidecar` starts the real service on the session's Kafka (its socket in a short
folder under /tmp: a Unix socket path has at most 107 bytes, pytest's folders can be longer) and
returns once ``/readyz`` answers 200 (the socket listens and the replica caught up with the log).
Engine processes and connector wirings reach it with ``NEXUSKV_INDEX_SOCKET``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from streams.bus.process import ManagedProcess, free_port

__all__ = ["Sidecar", "start_sidecar"]


@dataclass
class Sidecar:
    process: ManagedProcess
    socket: Path
    metrics_port: int
    folder: Path

    @property
    def env(self) -> dict[str, str]:
        return {"NEXUSKV_INDEX_SOCKET": str(self.socket)}

    def readyz(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=2) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError as exc:
            return 0, str(exc)

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_sidecar(url, data_dir: Path, *, timeout_s: float = 90.0, env: dict[str, str] | None = None,
                  socket: Path | None = None) -> Sidecar:
    """Start the service (on ``socket`` when given: a restart on the same path) and wait until it is ready."""
    folder = Path(tempfile.mkdtemp(prefix="nkv-", dir="/tmp"))
    sock = socket or folder / "index.sock"
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    own = dict(os.environ, NEXUSKV_BROKER=str(url), NEXUSKV_DATA_DIR=str(data_dir), NEXUSKV_INDEX_SOCKET=str(sock),
               NEXUSKV_METRICS_PORT=str(port), **(env or {}))
    own["PYTHONPATH"] = os.pathsep.join([str(root), own.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = ManagedProcess([sys.executable, "-m", "streams.index_sidecar"], name="index-sidecar",
                          log_path=data_dir / "logs" / "index-sidecar.log", env=own)
    proc.start()
    sidecar = Sidecar(proc, sock, port, folder)
    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.alive():
            raise RuntimeError(f"the index sidecar exited ({proc.exit_code}):\n{proc.log_tail()}")
        status, body = sidecar.readyz()
        if status == 200:
            return sidecar
        if time.monotonic() > deadline:
            sidecar.stop()
            raise RuntimeError(f"the index sidecar was not ready in {timeout_s:.0f} s ({status} {body}):\n"
                               f"{proc.log_tail()}")
        time.sleep(0.2)


class ThreadReplica:
    """The test's own index replica on a loop thread, for checks an engine's ask cannot make
    (a publisher's incarnation and certainty): ``lookup``, ``wait_caught_up``, ``_replica.index``.
    Tests hold one; engines never do (they ask the sidecar)."""

    def __init__(self, url, *, client_id: str) -> None:
        import asyncio
        import threading

        from streams.replica import IndexReplica

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=client_id, daemon=True)
        self._thread.start()
        self._replica = IndexReplica(url, client_id=client_id)
        self._call(self._replica.start())

    def _call(self, coro, timeout: float = 60.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def lookup(self, scope, keys):
        async def ask():
            return self._replica.lookup(scope, keys)
        return self._call(ask())

    def wait_caught_up(self, timeout_s: float = 30.0) -> None:
        self._call(self._replica.wait_caught_up(timeout_s=timeout_s), timeout_s + 5.0)

    def stop(self) -> None:
        try:
            self._call(self._replica.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
