"""The stream workers ``nexuskv up`` runs, each as its own process on the same bus.

A service is a module run with ``python -m``; it reads its settings from the environment
(``NEXUSKV_BROKER`` is set to the bus ``up`` opened). Every process is bound to ``up``: when
``up`` stops (or dies), they stop. A service that exits on its own (every service exits non-zero
when one of its supervised tasks fails) is noticed: :meth:`Running.dead` names it, and ``nexuskv
up`` then stops the others and exits non-zero, so whatever runs ``up`` (systemd, an orchestrator)
sees the failure and restarts the deployment.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from nexuskv.config import BrokerUrl, Settings
from nexuskv.errors import BrokerError
from streams.bus.process import ManagedProcess

__all__ = ["Service", "SERVICES", "Running", "DeadService", "start_services"]


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    module: str  # run as ``python -m module``
    doc: str


#: Registered stream workers, in start order. Later components add themselves here.
SERVICES: tuple[Service, ...] = (
    Service("index-worker", "streams.index_worker",
            "applies nexuskv.kv-events to the global index, dead-letters bad records, checkpoints per partition"),
    Service("index-api", "streams.index_api",
            "an index replica of every partition behind the authenticated, tenant-scoped HTTP lookup endpoint"),
    Service("index-sidecar", "streams.index_sidecar",
            "this node's index replica, asked by its engine processes over a Unix socket (NEXUSKV_INDEX_SOCKET) "
            "instead of each holding an index"),
    Service("remote-tier", "streams.remote_tier",
            "the remote tier's store: Mooncake Store (master and memory segment) at NEXUSKV_REMOTE_TIER"),
    Service("remote-tier-manager", "streams.remote_tier_manager",
            "owns the shared remote tier's capacity: admits or refuses writers' offers by utility and tenant quota, "
            "keeps headroom between watermarks, collects unoffered objects; its tier facts and price"),
    Service("tier-manager", "streams.tier_manager",
            "owns this worker's tiers: admission and eviction by utility, pins, prefetch room, tier facts and "
            "prices; runs the transfer executor on them (results and timings)"),
    Service("calibration", "streams.calibration_agent",
            "fits T_compute and per-link transfer costs from nexuskv.observations; publishes nexuskv.cost-models"),
    Service("planner", "streams.planner_service",
            "plan requests -> decisions, placement hints and transfer commands, by Effective Gain"),
    Service("decision-sink", "streams.sink",
            "decisions, transfer results and observations into the DuckDB decision store (single writer)"),
)


@dataclass(frozen=True, slots=True)
class DeadService:
    service: Service
    exit_code: int | None
    log_tail: str

    def describe(self) -> str:
        code = self.exit_code
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return f"service {self.service.name} {how}; log tail:\n{self.log_tail}"


class Running:
    """The services started, in start order (iterable); :meth:`dead` lists those that ended."""

    def __init__(self, procs: list[tuple[Service, ManagedProcess]]) -> None:
        self._procs = procs

    def __iter__(self) -> Iterator[Service]:
        return iter([svc for svc, _ in self._procs])

    def __len__(self) -> int:
        return len(self._procs)

    def pid(self, name: str) -> int | None:
        return next((proc.pid for svc, proc in self._procs if svc.name == name), None)

    def dead(self) -> list[DeadService]:
        return [DeadService(svc, proc.exit_code, proc.log_tail(30)) for svc, proc in self._procs if not proc.alive()]


@contextlib.contextmanager
def start_services(url: BrokerUrl, settings: Settings, *, enabled: bool = True,
                   services: tuple[Service, ...] | None = None,
                   env: Mapping[str, str] | None = None) -> Iterator[Running]:
    """Start every service; stop all of them (TERM, then KILL) when the block ends.

    ``env`` adds variables to the services' environment (``up`` passes the remote tier's address).
    With ``NEXUSKV_METRICS_PORT`` set, each service gets its own port: the base, then +1, +2, ...
    in the order of :data:`SERVICES`.
    """
    chosen = list(SERVICES if services is None else services) if enabled else []
    env = dict(os.environ, **(env or {}), NEXUSKV_BROKER=str(url))
    log_dir = Path(settings.data_dir) / "logs"
    procs: list[tuple[Service, ManagedProcess]] = []
    try:
        for i, svc in enumerate(chosen):
            own = dict(env)
            if settings.metrics_port:  # one port each: NEXUSKV_METRICS_PORT, +1, +2, ... in start order
                own["NEXUSKV_METRICS_PORT"] = str(settings.metrics_port + i)
            proc = ManagedProcess([sys.executable, "-m", svc.module], name=svc.name,
                                  log_path=log_dir / f"{svc.name}.log", env=own)
            proc.start()
            procs.append((svc, proc))
        time.sleep(0.2 if procs else 0)
        for svc, proc in procs:
            if not proc.alive():
                raise BrokerError(f"service {svc.name} exited at start; log tail:\n{proc.log_tail()}")
        yield Running(procs)
    finally:
        for _svc, proc in reversed(procs):
            proc.stop()
