"""The calibration agent: ``nexuskv.observations`` in, fitted cost-model entries out.

A Faust app (built by :func:`streams.faust_app.make_faust_app`) with one agent over the
observations topic. Each observation is decoded with the topic contract (a malformed one goes to
``nexuskv.dead-letter`` with the reason) and folded into the pure
:class:`~nexuskv.calibration.Calibrator` — weighted recursive least squares, a few microseconds per
observation, so it runs on the event loop. An entry with at least
``NEXUSKV_CALIBRATION_MIN_OBSERVATIONS`` observations and something new is published to
``nexuskv.cost-models`` (keyed by entry id, a complete posterior with a version that grows) at most
every ``NEXUSKV_CALIBRATION_PUBLISH`` seconds; a timer publishes what arrived since, so a quiet
stream still gets its last observations out.

State: a published entry is the whole state of its fit (mean, covariance, residual noise,
observation count), so the agent keeps no second copy. At start it reads the latest entry per key
back from ``nexuskv.cost-models`` (:func:`streams.bus.cost_models.read_cost_models`) and resumes those
fits and their version numbers. A Faust table was the first design and was dropped: Faust refuses
table writes outside stream iteration, so the timer's publications of a quiet stream's last
observations could never be snapshotted, and a restart resumed a stale fit. What is lost on a crash
is what arrived after the last publication (at most ``NEXUSKV_CALIBRATION_PUBLISH`` seconds; offsets
not yet committed are redelivered, so some of it is folded in again). Observations are keyed by
(model, link or tier), so every observation of one entry reaches the same worker.

Supervision: an error in the agent other than a malformed observation crashes the Faust app
(Faust would otherwise stop only the agent and leave a process that answers ``/metrics`` but
calibrates nothing), so the process exits non-zero; ``/livez`` and ``/readyz`` report it.

Run: ``python -m streams.calibration_agent`` (``nexuskv up`` starts it).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import faust

from nexuskv.calibration import Calibrator, FitKey
from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts import codec
from nexuskv.contracts.cost_models import CostModelEntry
from nexuskv.contracts.observations import ObservationRecord
from nexuskv.contracts.topics import COST_MODELS, DEAD_LETTER, OBSERVATIONS
from nexuskv.cost import CostModel
from nexuskv.errors import ContractError
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import dead_letter_for
from streams.bus.health import HEALTH
from streams.bus.policy_file import load_policy
from streams.faust_app import make_faust_app
from streams.telemetry import init_service

__all__ = ["SERVICE", "CalibrationWorker", "build_app", "main"]

SERVICE = "nexuskv-calibration"
log = logging.getLogger(__name__)


class CalibrationWorker:
    """What the agent does per observation and per tick, free of Faust (tested directly)."""

    def __init__(self, calibrator: Calibrator, *, min_observations: int, publish_s: float, publisher: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.calibrator = calibrator
        self.min_observations = min_observations
        self.publish_s = publish_s
        self.publisher = publisher
        self.clock = clock
        self._published_at: dict[FitKey, float] = {}
        self._published_n: dict[FitKey, int] = {}
        self.observed = 0
        self.rejected = 0

    @staticmethod
    def decode(raw: bytes) -> ObservationRecord:
        """The record, or ContractError with the reason (it then goes to the dead-letter topic)."""
        return cast(ObservationRecord, codec.decode(OBSERVATIONS, raw))

    def fold(self, record: ObservationRecord) -> FitKey | None:
        key = self.calibrator.observe(record)
        self.observed += 1
        return key

    def due(self) -> list[FitKey]:
        """Entries with enough observations, something new, and the publish interval passed."""
        now = self.clock()
        out = []
        for key, fit in self.calibrator.fits.items():
            n = fit.observations
            if n < self.min_observations or n == self._published_n.get(key, 0):
                continue
            if now - self._published_at.get(key, -1e18) >= self.publish_s:
                out.append(key)
        return out

    def resume(self, entries: Iterable[CostModelEntry]) -> int:
        """Resume fits from their last published entries; returns how many."""
        n = 0
        for entry in entries:
            key = self.calibrator.resume(entry)
            self._published_n[key] = entry.observations
            n += 1
        return n

    def publish(self, key: FitKey) -> CostModelEntry:
        """The entry to send; marks it published."""
        entry = self.calibrator.entry(key, now=self.clock(), publisher=self.publisher)
        self._published_at[key] = self.clock()
        self._published_n[key] = entry.observations
        return entry


def build_app(url: BrokerUrl, *, base: CostModel, policy: ExecutionPolicy, min_observations: int,
              publish_s: float, forgetting: float, partitions: int, name: str = SERVICE,
              data_dir: Path | None = None, publisher: str | None = None,
              resume: Iterable[CostModelEntry] = (),
              clock: Callable[[], float] = time.time) -> tuple[faust.App, CalibrationWorker]:
    """The calibration Faust app and its worker (not started), resuming the ``resume`` entries."""
    if data_dir is not None:
        Path(data_dir).parent.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    app = make_faust_app(name, url, data_dir=data_dir, topic_partitions=partitions)
    worker = CalibrationWorker(
        Calibrator(base, default_profile=policy.planner.default_hardware_profile, forgetting=forgetting),
        min_observations=min_observations, publish_s=publish_s,
        publisher=publisher or f"{name}@{socket.gethostname()}:{os.getpid()}", clock=clock)
    worker.resume(resume)
    observations = app.topic(OBSERVATIONS.name, key_type=bytes, value_type=bytes, partitions=partitions)
    cost_models = app.topic(COST_MODELS.name, key_type=bytes, value_type=bytes)
    dead_letters = app.topic(DEAD_LETTER.name, key_type=bytes, value_type=bytes)

    async def send(entry: CostModelEntry) -> None:
        await cost_models.send(key=entry.key.encode(), value=codec.encode(COST_MODELS, entry))

    async def take(event: Any) -> None:
        try:
            record = worker.decode(event.value)
        except ContractError as exc:
            worker.rejected += 1
            letter = dead_letter_for(OBSERVATIONS.name, event.message, exc, service=name, now=worker.clock())
            await dead_letters.send(key=OBSERVATIONS.name.encode(), value=codec.encode(DEAD_LETTER, letter))
            return
        worker.fold(record)
        for due in worker.due():
            await send(worker.publish(due))

    @app.agent(observations)
    async def calibrate(stream: Any) -> None:
        HEALTH.set_ready("observations", True)
        async for event in stream.events():
            try:
                await take(event)
            except Exception as exc:  # noqa: BLE001 - a dead agent must take the process with it
                log.exception("%s: calibration failed; stopping", name)
                HEALTH.fail(f"{type(exc).__name__}: {exc}")
                await app.crash(exc)
                raise

    @app.timer(interval=publish_s)
    async def publish_tail() -> None:  # a quiet stream's last observations
        HEALTH.beat()  # this loop answers (a held loop is not alive: /livez)
        for due in worker.due():
            await send(worker.publish(due))

    return app, worker


def main() -> None:  # pragma: no cover - exercised by `nexuskv up`
    import asyncio

    from streams.bus.broker import open_bus
    from streams.bus.cost_models import read_cost_models
    from streams.bus.topics import list_topics

    settings = Settings.from_env()
    init_service(SERVICE, settings)
    policy = load_policy(settings.policy_file) if settings.policy_file else ExecutionPolicy(version="builtin")
    with open_bus(settings.broker, start_timeout_s=settings.broker_start_timeout_s) as url:
        counts = asyncio.run(list_topics(url))
        partitions = counts.get(OBSERVATIONS.name) or settings.topic_partitions
        resume = asyncio.run(read_cost_models(url)).values()
        app, worker = build_app(url, base=shipped_cost_model(), policy=policy,
                                min_observations=settings.calibration_min_observations,
                                publish_s=settings.calibration_publish_s, forgetting=settings.calibration_forgetting,
                                partitions=partitions, data_dir=Path(settings.data_dir) / "faust" / SERVICE,
                                resume=resume)
        log.info("calibration: resumed %d fitted entries", len(worker.calibrator.fits))
        faust.Worker(app, loglevel=settings.log_level).execute_from_commandline()


if __name__ == "__main__":  # pragma: no cover
    main()
