"""A service's kv-events outbox: batches queued from any thread, sent in order by one task.

A tier authority (the tier manager, the remote tier's owner) publishes its tier facts from the
threads its ledger runs on, before and after its event loop starts. :class:`EventOutbox` takes
them from any thread (:meth:`put`), holds those that come before :meth:`bind` and sends them all,
in order, from one task (:meth:`run`); :meth:`drain` sends what is left when the service stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from aiokafka import AIOKafkaProducer

from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.topics import KV_EVENTS
from streams.bus.clients import send

__all__ = ["EventOutbox"]


class EventOutbox:
    """Batches for ``nexuskv.kv-events``, keyed by their publisher, sent in the order put."""

    def __init__(self) -> None:
        self.sent = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._box: asyncio.Queue[KeyedBatch] | None = None
        self._early: list[KeyedBatch] = []
        self._lock = threading.Lock()

    def put(self, batch: KeyedBatch) -> None:
        """Queue one batch (any thread; before :meth:`bind`, it waits for it)."""
        loop, box = self._loop, self._box
        if loop is None or box is None:
            with self._lock:
                if self._box is None:
                    self._early.append(batch)
                    return
                loop, box = self._loop, self._box
        loop.call_soon_threadsafe(box.put_nowait, batch)

    def bind(self) -> None:
        """Start queueing on the running loop, with what came before first."""
        with self._lock:
            box: asyncio.Queue[KeyedBatch] = asyncio.Queue()
            for b in self._early:
                box.put_nowait(b)
            self._early.clear()
            self._loop, self._box = asyncio.get_running_loop(), box

    async def run(self, producer: AIOKafkaProducer) -> None:
        """Send every batch as it comes, forever (a supervised task)."""
        box = self._box
        if box is None:
            raise RuntimeError("EventOutbox.run before bind")
        while True:
            batch = await box.get()
            await send(producer, KV_EVENTS, batch.publisher, batch)
            self.sent += 1

    async def drain(self, producer: AIOKafkaProducer) -> None:
        """Send what is queued now (a stopping service), each batch best effort."""
        box = self._box
        if box is None:
            return
        while not box.empty():
            batch = box.get_nowait()
            with contextlib.suppress(Exception):
                await send(producer, KV_EVENTS, batch.publisher, batch)
                self.sent += 1
