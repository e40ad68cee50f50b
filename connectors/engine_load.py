"""What a vLLM engine reports about its own load: its scheduler's gauges on ``/metrics``.

vLLM's OpenAI server exports Prometheus text (``vllm/v1/metrics/loggers.py``): the scheduler's
``vllm:num_requests_running`` (requests in the execution batches: prefilling or decoding) and
``vllm:num_requests_waiting`` (not scheduled yet), and ``vllm:kv_cache_usage_perc`` (the share of
the engine's KV blocks held by running requests; cached blocks no request holds are free). The
same gauges are what llm-d's queue and KV-utilisation scorers read, and what vLLM puts in its ORCA
``endpoint-load-metrics`` header. A router sees only the requests it sent; the engine counts
every request, whoever sent it, and how long each stays (decoding, preempted, waiting).

:func:`parse_vllm_metrics` reads one scrape (pure); :class:`EngineLoadPoller` scrapes each
engine every ``interval_s`` and keeps the latest report with its age. A scrape that fails or
lacks the gauges (an engine started with ``--disable-log-stats``) leaves that engine unreported:
its load is then the router's count alone, never a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from nexuskv.errors import ContractError

__all__ = ["EngineLoad", "EngineLoadPoller", "parse_vllm_metrics"]

log = logging.getLogger("nexuskv.engine_load")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's gauges at ``at`` (seconds since the epoch)."""

    running: int
    waiting: int
    kv_usage: float  # 0..1
    at: float


def parse_vllm_metrics(text: str, *, at: float) -> EngineLoad:
    """The scheduler gauges of one ``/metrics`` scrape, summed over its engines (data parallel
    ranks are label sets of one gauge; KV usage is the fullest rank's). Raises ContractError when
    the running or waiting gauge is absent or not a number."""
    values: dict[str, list[float]] = {RUNNING: [], WAITING: [], KV_USAGE: []}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        bucket = values.get(name)
        if bucket is None:
            continue
        rest = line[line.rindex("}") + 1:] if brace >= 0 else line[len(name):]
        parts = rest.split()
        try:
            value = float(parts[0])
        except (IndexError, ValueError) as exc:
            raise ContractError(f"{name}: not a number in {line[:120]!r}", path=name) from exc
        if value != value or value < 0:  # NaN or negative
            raise ContractError(f"{name}: {value} is no gauge value", path=name)
        bucket.append(value)
    for name in (RUNNING, WAITING):
        if not values[name]:
            raise ContractError(f"{name}: absent from the scrape (is the engine's stats logging off?)", path=name)
    return EngineLoad(running=int(sum(values[RUNNING])), waiting=int(sum(values[WAITING])),
                      kv_usage=min(1.0, max(values[KV_USAGE], default=0.0)), at=at)


@dataclass(slots=True)
class EngineLoadPoller:
    """Scrapes ``{url}/metrics`` of each engine every ``interval_s`` (an ``aiohttp`` session given);
    :meth:`latest` is the newest report of an engine, or None when it is older than ``max_age_s``
    or the engine never answered one."""

    urls: Sequence[str]
    session: aiohttp.ClientSession
    interval_s: float = 0.05
    max_age_s: float = 0.5
    timeout_s: float = 0.5
    clock: Callable[[], float] = time.time
    stats: dict[str, int] = field(default_factory=lambda: {"scrapes": 0, "failed": 0})
    _latest: list[EngineLoad | None] = field(default_factory=list)
    _task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not self.max_age_s > 0 or not self.timeout_s > 0:
            raise ValueError("interval_s, max_age_s and timeout_s: must be positive")
        self._latest = [None] * len(self.urls)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-load-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def latest(self, engine: int) -> EngineLoad | None:
        report = self._latest[engine]
        if report is None or self.clock() - report.at > self.max_age_s:
            return None
        return report

    async def scrape(self, engine: int) -> EngineLoad | None:
        """One scrape of one engine; a failure is counted and logged (the first, then every 100th)."""
        self.stats["scrapes"] += 1
        try:
            async with self.session.get(self.urls[engine] + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    raise ContractError(f"/metrics answered HTTP {resp.status}")
                text = await resp.text()
            report = parse_vllm_metrics(text, at=self.clock())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ContractError) as exc:
            self.stats["failed"] += 1
            if self.stats["failed"] in (1, 10) or self.stats["failed"] % 100 == 0:
                log.warning("engine %s: no load report (%d failed so far): %s", self.urls[engine],
                            self.stats["failed"], exc)
            return None
        self._latest[engine] = report
        return report

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self.scrape(i) for i in range(len(self.urls))))
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
