"""Supervised service tasks: a task that fails stops its service, which then exits non-zero.

A service's long-running tasks (consume, follow, tick, commit, apply, heartbeat) run under one
:class:`Supervisor`. They are meant to run until the service stops, so a task that raises *or
returns* is a failure: the supervisor records it (:data:`streams.bus.health.HEALTH` is then not
alive, so ``/livez`` answers 503), cancels the other tasks and wakes :meth:`Supervisor.wait`,
which raises :class:`ServiceFailed`. A service's ``main`` runs its loop with :func:`run_service`,
which turns that into exit status 1 — so ``nexuskv up`` or an orchestrator sees a dead service
instead of a process that still answers ``/metrics`` while doing nothing (as Python's bare
``create_task`` would leave it: an exception in a task nobody awaits is only logged when the
task is garbage collected).

:meth:`Supervisor.watch` adds a task someone else started (an index replica's apply task).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nexuskv.errors import ConfigError, NexusKVError
from streams.bus.health import HEALTH, Health
from streams.bus.process import stop_on_signals

__all__ = ["Supervisor", "ServiceFailed", "run_service"]

log = logging.getLogger(__name__)


class ServiceFailed(NexusKVError):
    """A supervised task of a service raised or returned; ``task`` names it, ``__cause__`` is why."""

    def __init__(self, service: str, task: str, error: BaseException | None) -> None:
        why = f"{type(error).__name__}: {error}" if error is not None else "returned, but must run until stopped"
        super().__init__(f"{service}: task {task} {why}")
        self.service = service
        self.task = task
        self.error = error


class Supervisor:
    """The tasks of one service; see the module docstring."""

    def __init__(self, service: str, *, health: Health = HEALTH, heartbeat: bool = True) -> None:
        self.service = service
        self.health = health
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._failed = asyncio.Event()
        self.failure: ServiceFailed | None = None
        self._stopping = False
        if heartbeat:
            self.spawn(health.heartbeat(), name=f"{service}-heartbeat")

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        return self.watch(asyncio.create_task(coro, name=name), name=name)

    def watch(self, task: asyncio.Task[Any], *, name: str | None = None) -> asyncio.Task[Any]:
        self._tasks[task] = name or task.get_name()
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        name = self._tasks.get(task, task.get_name())
        if self._stopping or self.failure is not None:
            return
        if task.cancelled():
            error: BaseException | None = asyncio.CancelledError(f"{name} was cancelled")
        else:
            error = task.exception()
        self.failure = ServiceFailed(self.service, name, error)
        if error is not None and not isinstance(error, asyncio.CancelledError):
            log.error("%s: task %s failed", self.service, name, exc_info=error)
        else:
            log.error("%s: %s", self.service, self.failure)
        self.health.fail(str(self.failure))
        for other in self._tasks:
            if other is not task and not other.done():
                other.cancel()
        self._failed.set()

    @property
    def alive(self) -> bool:
        return self.failure is None and all(not t.done() for t in self._tasks)

    async def wait(self) -> None:
        """Return never while every task runs; raise :class:`ServiceFailed` once one has failed."""
        await self._failed.wait()
        assert self.failure is not None
        raise self.failure

    async def until(self, stop: asyncio.Event) -> None:
        """Wait until ``stop`` is set (return) or a task fails (raise ServiceFailed)."""
        stopping = asyncio.create_task(stop.wait())
        failing = asyncio.create_task(self._failed.wait())
        try:
            await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            failing.cancel()
        if self.failure is not None:
            raise self.failure

    async def stop(self) -> None:
        """Cancel every task and wait for them (a deliberate stop is not a failure)."""
        self._stopping = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - stopping: a task's last error was reported when it happened
                log.debug("%s: task %s ended with an error while stopping", self.service, task.get_name(),
                          exc_info=True)


def run_service(service: str, serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``serve(stop)`` on a new event loop, ``stop`` set by SIGINT or SIGTERM; exit status 0
    when it returns, 1 when a supervised task failed (the reason is logged), 2 for bad settings."""

    async def main() -> None:
        await serve(stop_on_signals())

    try:
        asyncio.run(main())
    except ServiceFailed as exc:
        log.error("%s: stopping after a failure: %s", service, exc)
        return 1
    except NexusKVError as exc:
        log.error("%s: %s", service, exc)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0
