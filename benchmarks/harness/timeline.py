"""Time on the simulated workers: prefill slots, in-flight decode, and busy links.

* :class:`Engine` — one worker's prefill engine: non-preemptive, earliest arrival first among
  the jobs that are ready (a job waiting for its copied state does not hold up the others).
* :class:`DecodeLoad` — requests decoding on a worker, as KV blocks (what decode costs a prefill).
* :class:`Links` — when each link resource (a worker's PCIe, NVMe, NIC) is next free: copies on
  one resource queue behind each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Job", "Engine", "DecodeLoad", "Links"]


@dataclass(slots=True)
class Job:
    """A prefill waiting for (or holding) a worker's engine."""

    position: int  # arrival order: the earlier arrival goes first among ready jobs
    ready: float  # when its state is in (or its copy was given up)
    duration: float
    tokens: int  # uncached tokens (what the worker reports as queued work)
    on_start: Callable[[float], None]
    context: int = 0  # the prompt's tokens (uncached x context is the attention part of the work)


class Engine:
    """One worker's prefill engine: one job at a time, to completion; when it frees up it takes the
    earliest-arrived job that is ready. A job whose state is still being copied waits without
    blocking the jobs behind it, and gets its place back when its state is in (vLLM's waiting queue
    with ``WAITING_FOR_REMOTE_KVS``). The engine idles only when no job is ready.

    ``schedule(when, action)`` runs ``action`` at simulated time ``when`` (the run's event queue).
    """

    __slots__ = ("_schedule", "_waiting", "_running", "_wake")

    def __init__(self, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        self._schedule = schedule
        self._waiting: list[Job] = []
        self._running: tuple[float, float, int, int] | None = None  # (start, end, tokens, tokens x context)
        self._wake: float | None = None  # a wake-up already scheduled for the next ready job

    def start_of(self, now: float, ready: float, duration: float, position: int) -> float:
        """When a job arriving now (after every waiting one) would start, if nothing else arrives."""
        t = now
        if self._running is not None and self._running[1] > t:
            t = self._running[1]
        waiting = sorted((j.position, j.ready, j.duration) for j in self._waiting)
        mine = (position, ready, duration)
        queue = waiting + [mine]
        while True:
            ready_now = [j for j in queue if j[1] <= t]
            if not ready_now:
                t = min(j[1] for j in queue)
                continue
            job = min(ready_now)
            if job is mine:
                return t
            queue.remove(job)
            t += job[2]

    def submit(self, job: Job, now: float) -> None:
        self._waiting.append(job)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        if self._running is not None:
            if self._running[1] > now:
                return
            self._running = None
        ready = [j for j in self._waiting if j.ready <= now]
        if not ready:
            nxt = min((j.ready for j in self._waiting), default=None)
            if nxt is not None and self._wake != nxt:
                self._wake = nxt
                self._schedule(nxt, lambda: self._dispatch(nxt))
            return
        job = min(ready, key=lambda j: j.position)
        self._waiting.remove(job)
        end = now + job.duration
        self._running = (now, end, job.tokens, job.tokens * job.context)
        self._schedule(end, lambda: self._dispatch(end))
        job.on_start(now)

    def queued_tokens(self, now: float) -> int:
        """Prefill tokens not yet computed at ``now``: every waiting job's (parked ones too) and the
        remaining share of the running one's."""
        return self.queued_work(now)[1]

    def queued_work(self, now: float) -> tuple[int, int, int]:
        """The work ahead of a request arriving at ``now``, as an engine reports it: prefills
        waiting or running, their uncached tokens and their uncached x context tokens (the running
        one's tokens and products by the share of it not yet done)."""
        jobs = len(self._waiting)
        tokens = float(sum(j.tokens for j in self._waiting))
        products = float(sum(j.tokens * j.context for j in self._waiting))
        if self._running is not None:
            start, end, run_tokens, run_products = self._running
            if end > now:
                left = (end - now) / (end - start) if end > start else 0.0
                jobs += 1
                tokens += run_tokens * left
                products += run_products * left
        return jobs, int(tokens), int(products)

    def jobs(self, now: float) -> int:
        running = 1 if self._running is not None and self._running[1] > now else 0
        return running + len(self._waiting)


class DecodeLoad:
    """Requests decoding on one worker: ``(start, end, blocks)`` each."""

    __slots__ = ("_spans",)

    def __init__(self) -> None:
        self._spans: list[tuple[float, float, int]] = []

    def add(self, start: float, end: float, blocks: int) -> None:
        self._spans.append((start, end, blocks))

    def blocks(self, now: float) -> int:
        """KV blocks of the requests decoding at ``now``."""
        live = [s for s in self._spans if s[1] > now]
        if len(live) != len(self._spans):
            self._spans = live
        return sum(b for start, _end, b in live if start <= now)

    def requests(self, now: float) -> int:
        return sum(1 for start, end, _b in self._spans if start <= now < end)


class Links:
    """When each link resource is next free, seconds."""

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: dict[str, float] = {}

    def free_at(self, resources: tuple[str, ...]) -> float:
        return max((self._free.get(r, 0.0) for r in resources), default=0.0)

    def hold(self, resources: tuple[str, ...], until: float) -> None:
        for r in resources:
            if self._free.get(r, 0.0) < until:
                self._free[r] = until
