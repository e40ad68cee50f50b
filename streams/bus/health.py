"""This process's liveness and readiness, as ``/livez`` and ``/readyz`` report them.

*Alive*: no supervised task has failed and the event loop answered its heartbeat within
:data:`LOOP_STALL_S` (a loop held by one piece of work is not alive). *Ready*: every readiness
condition the process declared is met (its consumer got partitions, its replica caught up, the
broker is reachable, ...). The bus clients declare the broker's condition themselves
(:func:`streams.bus.clients.retry_transient`), so the state lives in the bus layer; services serve
it (:func:`streams.telemetry.serve_metrics`). Also the gauges ``nexuskv_service_alive`` and
``nexuskv_service_ready``.
"""

from __future__ import annotations

import threading
import time

from streams.bus.metrics import METRICS

__all__ = ["HEALTH", "Health", "LOOP_STALL_S"]

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
        """The process's loop answered (an event loop's heartbeat task, or a service's own watch loop)."""
        self._beat = time.monotonic()
        METRICS.alive.labels(self.service).set(1 if self.alive()[0] else 0)

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
            await asyncio.sleep(interval_s)


HEALTH = Health()
