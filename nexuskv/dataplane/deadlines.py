"""Calls into a blocking client library that return within their deadline, whatever its transport does.

A native client (Mooncake's) blocks its caller in C++ for as long as its own timeouts say — 65 s
when its transfer port was flooded, against a backend deadline of 10 s. :class:`DeadlineCalls`
runs each call on one of a fixed number of daemon threads and waits for it no longer than its
deadline; a call that overruns is reported as :class:`~nexuskv.errors.TierUnavailableError`
(counted in :attr:`DeadlineCalls.overruns`) while the thread stays with it until the library
returns. So that an abandoned call cannot write into memory its caller has moved on to use, the
caller gives back the buffers a call touches itself when the call returns in time, and leaves
them to ``on_late`` otherwise: ``on_late`` runs only for an abandoned call, once the library has
returned. Calls queue when every thread is busy, and the wait
counts against their deadline; beyond ``max_outstanding`` calls (threads stuck in a stalled
transport plus the queue) a new call fails at once instead of piling up.

Daemon threads, not a ``concurrent.futures`` pool: a pool's workers are joined at interpreter
exit, so one call stuck in the library would hang the process's exit.

A deadline bounds one call; :class:`Breaker` bounds what a dead service costs its callers over
many. Once a call failed for unavailability, calls fail at once for a backoff (1 s, doubling to
30 s) instead of each waiting out its deadline: with its store killed, a vLLM engine's scheduler
thread waited 10 s on every probe of the remote tier (a request every ~10 s, where it served one a
second). When the backoff ends, one cheap check (``alive``: the service's port accepts a
connection) decides whether calls are let through again; the first call that succeeds closes it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from nexuskv.errors import TierUnavailableError

__all__ = ["Breaker", "DeadlineCalls"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Job:
    __slots__ = ("fn", "on_late", "future", "lock", "finished", "abandoned")

    def __init__(self, fn: Callable[[], Any], on_late: Callable[[], None] | None) -> None:
        self.fn = fn
        self.on_late = on_late
        self.future: Future = Future()
        self.lock = threading.Lock()
        self.finished = False
        self.abandoned = False


class DeadlineCalls:
    """A fixed set of daemon threads that run blocking calls; each caller waits at most its deadline."""

    def __init__(self, name: str, *, threads: int = 4, max_outstanding: int = 64) -> None:
        if threads < 1 or max_outstanding < threads:
            raise ValueError(f"threads >= 1 and max_outstanding >= threads, got {threads}, {max_outstanding}")
        self.name = name
        self.max_outstanding = max_outstanding
        self.overruns = 0  # calls whose caller gave up at the deadline
        self.refused = 0  # calls refused at once: max_outstanding calls were already out
        self.late = 0  # overrun calls that have returned since
        self._outstanding = 0
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    @property
    def outstanding(self) -> int:
        """Calls submitted whose library call has not returned (running or queued)."""
        with self._lock:
            return self._outstanding

    def call(self, what: str, fn: Callable[[], T], *, deadline_s: float,
             on_late: Callable[[], None] | None = None) -> T:
        """``fn()``'s result within ``deadline_s`` seconds, or TierUnavailableError naming ``what``.

        ``on_late`` runs only when the caller gave up at the deadline, once ``fn`` has returned:
        give back there the buffers ``fn`` reads or writes (on time, the caller still owns them)."""
        with self._lock:
            stalled = self._outstanding if self._outstanding >= self.max_outstanding else None
            if stalled is None:
                self._outstanding += 1
            else:
                self.refused += 1
        if stalled is not None:
            raise TierUnavailableError(f"{self.name}: {what} not started: {stalled} calls are still out "
                                       "(the transport is stalled)")
        job = _Job(fn, on_late)
        self._work.put(job)
        try:
            return job.future.result(timeout=max(0.0, deadline_s))
        except FutureTimeout:
            with job.lock:
                finished = job.finished
                job.abandoned = not finished
            if finished:  # it returned as the deadline passed: the result is the caller's after all
                return job.future.result()
            with self._lock:
                self.overruns += 1
            raise TierUnavailableError(f"{self.name}: {what} exceeded its {deadline_s:.1f}s deadline") from None

    def _run(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            result: Any = None
            error: BaseException | None = None
            try:
                result = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                error = exc
            with job.lock:
                job.finished = True
                late = job.abandoned
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
            if late:
                with self._lock:
                    self.late += 1
                if job.on_late is not None:
                    try:
                        job.on_late()
                    except Exception:  # noqa: BLE001 - giving buffers back must not kill the thread
                        log.exception("%s: giving back an abandoned call's buffers failed", self.name)
            with self._lock:
                self._outstanding -= 1

    def close(self) -> None:
        """Stop the threads once their current calls return (a stuck call keeps its thread)."""
        for _ in self._threads:
            self._work.put(None)


class Breaker:
    """Fails calls at once while a service is known down; thread-safe; ``clock`` is monotonic seconds."""

    def __init__(self, name: str, *, alive: Callable[[], bool], first_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.alive = alive
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.opened = 0  # times it went from closed to open
        self.short_circuited = 0  # calls failed at once while open
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed
        self._backoff_s = first_backoff_s
        self._reason = ""

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def check(self, what: str) -> None:
        """Raise TierUnavailableError for ``what`` while open; let it through when closed, or when
        the backoff ended and ``alive()`` says the service answers again."""
        if self._open_until is None:  # closed: every call of a healthy store, no lock taken
            return
        with self._lock:
            until = self._open_until
            if until is None:
                return
            now = self.clock()
            if now >= until:
                if self.alive():
                    self._open_until = now + self._backoff_s  # half open: this call tries, others wait
                    return
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
                self._open_until = now + self._backoff_s
            self.short_circuited += 1
            left = self._open_until - now
            reason = self._reason
        raise TierUnavailableError(f"{self.name}: {what} not tried: the service is down ({reason}); "
                                   f"next try in {left:.1f}s")

    def failed(self, reason: str) -> None:
        with self._lock:
            if self._open_until is None:
                self.opened += 1
                self._backoff_s = self.first_backoff_s
                log.warning("%s: down (%s); calls fail at once for %.1fs", self.name, reason, self._backoff_s)
            else:
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
            self._open_until = self.clock() + self._backoff_s
            self._reason = reason

    def succeeded(self) -> None:
        if self._open_until is None:
            return
        with self._lock:
            if self._open_until is not None:
                log.warning("%s: answering again", self.name)
            self._open_until = None
            self._backoff_s = self.first_backoff_s
