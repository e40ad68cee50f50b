"""The bus, for engine plugins that are synchronous: an event loop on a thread of its own.

vLLM's scheduler and SGLang's HiCache controller call their plugins from plain threads, while
NexusKV's bus clients are asyncio. :class:`BackgroundBus` runs one loop on a daemon thread that
owns a :class:`~streams.bus.cost_models.CostModelReplica` and a producer, and offers them thread-safely:

* :attr:`model` — the latest cost-model snapshot (an immutable value, read without a lock);
* :meth:`publish` — send a :class:`~nexuskv.contracts.kv_events.KvEventBatch` keyed by its
  publisher, waiting for the acknowledgement (a publisher's batches stay in order);
* :meth:`send` — any record to its topic and key (:func:`streams.bus.topic_keys.route`, or the topic and
  key given), without waiting: observations and decision records, which must never hold up the
  engine's thread; a failed send is logged and counted (``send_failures``), never raised.

It holds no index: an engine asks the node's index sidecar for its matches
(:class:`connectors.index_client.IndexClient`, :mod:`streams.index_sidecar`); the client the
engine's plugin uses travels with the bus as :attr:`BackgroundBus.index` and is closed with it.

:class:`BackgroundProducer` is the same loop with a producer only, for processes that publish but
never read a cost model (a vLLM worker process publishing its tier's facts and its timings).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING

from nexuskv.config import BrokerUrl
from nexuskv.contract import Contract
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import KV_EVENTS, Topic
from nexuskv.cost import CostModel
from nexuskv.errors import BrokerError
from nexuskv.profiles import shipped_cost_model

if TYPE_CHECKING:
    from connectors.index_client import IndexClient

__all__ = ["BackgroundBus", "BackgroundProducer"]

log = logging.getLogger(__name__)


class _Sender:
    """Sending records from a plain thread through a producer on the loop thread."""

    _loop: asyncio.AbstractEventLoop
    _producer: object
    client_id: str

    def _init_sender(self) -> None:
        self.send_failures = 0

    async def _send(self, record: Contract, topic: Topic | None, key: str | None,
                    headers: list[tuple[str, bytes]] | None = None) -> None:
        from streams.bus.clients import send
        from streams.bus.topic_keys import route

        if self._producer is None:
            raise BrokerError(f"{self.client_id}: the bus is not started")
        if topic is None or key is None:
            topic, key = route(record)
        await send(self._producer, topic, key, record, headers)  # type: ignore[arg-type]

    def _sent(self, future: concurrent.futures.Future) -> None:
        exc = future.exception()
        if exc is not None:
            self.send_failures += 1
            log.warning("%s: a record was not sent: %s", self.client_id, exc)

    def send(self, record: Contract, *, topic: Topic | None = None, key: str | None = None, wait: bool = False,
             timeout_s: float = 30.0, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Send ``record`` (to its routed topic and key unless both are given); ``wait`` for the ack.
        ``headers`` go with it (a request's trace context: this thread has none of its own)."""
        future = asyncio.run_coroutine_threadsafe(self._send(record, topic, key, headers), self._loop)
        if wait:
            future.result(timeout_s)
        else:
            future.add_done_callback(self._sent)


class BackgroundBus(_Sender):
    """Cost-model replica and producer on a loop thread; start, use, stop."""

    def __init__(self, url: BrokerUrl, *, client_id: str, base_model: CostModel | None = None,
                 index: IndexClient | None = None) -> None:
        self.url = url
        self.client_id = client_id
        self.index = index
        self.base_model = base_model or shipped_cost_model()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{client_id}-bus", daemon=True)
        self._costs = None
        self._producer = None
        self._cost_task: asyncio.Task | None = None
        self._init_sender()

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, timeout_s: float = 30.0) -> BackgroundBus:
        self._thread.start()
        try:
            self._call(self._start(timeout_s), timeout_s + 5.0)
        except Exception:
            self.stop()
            raise
        return self

    async def _start(self, timeout_s: float) -> None:
        from streams.bus.clients import make_producer
        from streams.bus.cost_models import CostModelReplica

        self._producer = make_producer(self.url, client_id=self.client_id)
        await self._producer.start()
        self._costs = CostModelReplica(self.url, self.base_model, service=self.client_id)
        await self._costs.start(timeout_s=timeout_s)
        self._cost_task = asyncio.create_task(self._costs.run(self._producer), name=f"{self.client_id}-costs")

    @property
    def model(self) -> CostModel:
        return self._costs.model if self._costs is not None else self.base_model

    async def _publish(self, batch: KvEventBatch) -> None:
        from streams.bus.clients import send

        if self._producer is None:
            raise BrokerError(f"{self.client_id}: the bus is not started")
        await send(self._producer, KV_EVENTS, batch.publisher, batch)

    def publish(self, batch: KvEventBatch, timeout_s: float = 30.0) -> None:
        """Send one batch and wait until the broker acknowledged it."""
        self._call(self._publish(batch), timeout_s)

    async def _stop(self) -> None:
        if self._cost_task is not None:
            self._cost_task.cancel()
            try:
                await self._cost_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping: its end does not matter
                pass
        for client in (self._costs, self._producer):
            if client is not None:
                await client.stop()

    def stop(self) -> None:
        if self.index is not None:
            self.index.close()
        if self._thread.is_alive():
            try:
                self._call(self._stop(), 30.0)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10.0)
        if not self._loop.is_running():
            self._loop.close()


class BackgroundProducer(_Sender):
    """A producer on a loop thread of its own: :meth:`send` from any thread; start, use, stop."""

    def __init__(self, url: BrokerUrl, *, client_id: str) -> None:
        self.url = url
        self.client_id = client_id
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{client_id}-producer", daemon=True)
        self._producer = None
        self._init_sender()

    def start(self, timeout_s: float = 30.0) -> BackgroundProducer:
        from streams.bus.clients import make_producer

        async def _start() -> None:
            self._producer = make_producer(self.url, client_id=self.client_id)
            await self._producer.start()

        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(_start(), self._loop).result(timeout_s + 5.0)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            async def _stop() -> None:
                if self._producer is not None:
                    await self._producer.stop()
            try:
                asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(30.0)
            except Exception as exc:  # noqa: BLE001 - stopping: report and go on
                log.warning("%s: stopping the producer: %s", self.client_id, exc)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10.0)
        if not self._loop.is_running():
            self._loop.close()
