"""The bus, for engine plugins that are synchronous: an event loop on a thread of its own.

vLLM's scheduler and SGLang's HiCache controller call their plugins from plain threads, while
NexusKV's bus clients are asyncio. :class:`BackgroundBus` runs one loop on a daemon thread that
owns an :class:`~streams.replica.IndexReplica` (every ``nexuskv.kv-events`` partition, from the
index workers' checkpoints), a :class:`~streams.cost_models.CostModelReplica` and a producer, and
offers them thread-safely:

* :meth:`lookup` — an :class:`~nexuskv.lookup.IndexView`: the replica answers on its own loop
  (it is not thread-safe); a lookup that does not answer within ``lookup_timeout_s`` is a miss
  whose ``lag_ms`` is infinite, so nothing is moved on it;
* :attr:`model` — the latest cost-model snapshot (an immutable value, read without a lock);
* :meth:`publish` — send a :class:`~nexuskv.contracts.kv_events.KvEventBatch` keyed by its
  publisher, waiting for the acknowledgement (a publisher's batches stay in order).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Sequence
from pathlib import Path

from nexuskv.config import BrokerUrl
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.cost import CostModel
from nexuskv.errors import BrokerError
from nexuskv.identity import IdentityScope
from nexuskv.lookup import LookupResult
from nexuskv.profiles import shipped_cost_model

__all__ = ["BackgroundBus"]


class BackgroundBus:
    """Index replica, cost-model replica and producer on a loop thread; start, use, stop."""

    def __init__(self, url: BrokerUrl, *, client_id: str, secret: bytes = b"", max_memberships: int = 16_000_000,
                 checkpoint_dir: Path | None = None, base_model: CostModel | None = None,
                 lookup_timeout_s: float = 0.5) -> None:
        self.url = url
        self.client_id = client_id
        self.secret = secret
        self.max_memberships = max_memberships
        self.checkpoint_dir = checkpoint_dir
        self.base_model = base_model or shipped_cost_model()
        self.lookup_timeout_s = lookup_timeout_s
        self.timeouts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{client_id}-bus", daemon=True)
        self._replica = None
        self._costs = None
        self._producer = None
        self._cost_task: asyncio.Task | None = None

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
        from streams.bus import make_producer
        from streams.cost_models import CostModelReplica
        from streams.replica import IndexReplica

        self._producer = make_producer(self.url, client_id=self.client_id)
        await self._producer.start()
        self._replica = IndexReplica(self.url, secret=self.secret, max_memberships=self.max_memberships,
                                     checkpoint_dir=self.checkpoint_dir, client_id=f"{self.client_id}-index")
        await self._replica.start(timeout_s=timeout_s)
        self._costs = CostModelReplica(self.url, self.base_model, service=self.client_id)
        await self._costs.start(timeout_s=timeout_s)
        self._cost_task = asyncio.create_task(self._costs.run(self._producer), name=f"{self.client_id}-costs")

    @property
    def model(self) -> CostModel:
        return self._costs.model if self._costs is not None else self.base_model

    async def _lookup(self, scope: IdentityScope, keys: Sequence[int]) -> LookupResult:
        if self._replica is None:
            raise BrokerError(f"{self.client_id}: the bus is not started")
        return self._replica.lookup(scope, keys)

    def lookup(self, scope: IdentityScope, keys: Sequence[int]) -> LookupResult:
        try:
            return self._call(self._lookup(scope, keys), self.lookup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.timeouts += 1
            return LookupResult(num_blocks=len(keys), matches=(), lag_ms=math.inf)

    async def _wait_caught_up(self, timeout_s: float) -> None:
        if self._replica is not None:
            await self._replica.wait_caught_up(timeout_s=timeout_s)

    def wait_caught_up(self, timeout_s: float = 30.0) -> None:
        """Block until the index replica has applied everything published so far."""
        self._call(self._wait_caught_up(timeout_s), timeout_s + 5.0)

    async def _publish(self, batch: KvEventBatch) -> None:
        from streams.bus import send

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
        for client in (self._costs, self._replica, self._producer):
            if client is not None:
                await client.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self._stop(), 30.0)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10.0)
        if not self._loop.is_running():
            self._loop.close()
