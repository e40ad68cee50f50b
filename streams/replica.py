"""IndexReplica: a live, in-process copy of the global index for planners and routers.

It reads *every* partition of ``nexuskv.kv-events`` with a plain aiokafka consumer (no consumer
group: each replica gets all records) and applies them to its own
:class:`~nexuskv.index.GlobalIndex`, in the caller's event loop, so lookups never wait on Kafka.
Malformed records are counted and skipped (the index worker's group puts them in the dead-letter
topic once). It starts from the log's beginning, or from the index worker's checkpoint folder
when given one (each partition's checkpoint, then the log from its offset).

Freshness, filled into every :class:`~nexuskv.lookup.LookupResult`:

* ``lag_events`` — records published but not yet applied, summed over partitions (the partition's
  high watermark from the last fetch minus the next offset to apply);
* ``lag_ms`` — 0 when caught up; otherwise, per lagging partition, now minus the timestamp of the
  last record applied from it (no later than the oldest unapplied one's, so it bounds how stale
  the answer is), the largest over partitions; milliseconds of the caller's clock.

Not thread-safe: call :meth:`lookup` from the event loop the replica runs in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from aiokafka import AIOKafkaConsumer, TopicPartition

from nexuskv.config import BrokerUrl
from nexuskv.contracts import codec
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.errors import BrokerError, ContractError
from nexuskv.identity import IdentityScope
from nexuskv.index import GlobalIndex
from nexuskv.lookup import LookupResult
from streams.bus import make_consumer
from streams.index_worker import load_checkpoints
from streams.telemetry import METRICS

__all__ = ["IndexReplica"]

log = logging.getLogger("nexuskv.replica")


class IndexReplica:
    """Implements :class:`~nexuskv.lookup.IndexView`; start it, then look up."""

    def __init__(self, url: BrokerUrl, *, secret: bytes = b"", max_memberships: int = 16_000_000,
                 topic: str = KV_EVENTS.name, checkpoint_dir: Path | None = None,
                 clock: Callable[[], float] = time.time, client_id: str = "nexuskv-replica") -> None:
        self.url = url
        self.topic = dataclasses.replace(KV_EVENTS, name=topic)
        self.index = GlobalIndex(max_memberships=max_memberships, secret=secret)
        self.checkpoint_dir = checkpoint_dir
        self.clock = clock
        self.client_id = client_id
        self.malformed = 0
        self.records = 0
        self._next: dict[int, int] = {}
        self._last_ts_ms: dict[int, float] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._tps: list[TopicPartition] = []

    async def start(self, timeout_s: float = 30.0) -> None:
        consumer = make_consumer(self.url, client_id=self.client_id, group_id=None)
        await consumer.start()
        self._consumer = consumer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        parts = consumer.partitions_for_topic(self.topic.name)
        while not parts:
            if loop.time() > deadline:
                await consumer.stop()
                raise BrokerError(f"topic {self.topic.name} has no partitions on {self.url}")
            await consumer._client.force_metadata_update()  # noqa: SLF001 - aiokafka has no public refresh
            parts = consumer.partitions_for_topic(self.topic.name)
            if not parts:
                await asyncio.sleep(0.2)
        self._tps = [TopicPartition(self.topic.name, p) for p in sorted(parts)]
        consumer.assign(self._tps)
        offsets = load_checkpoints(self.checkpoint_dir, self.topic.name, self.index) if self.checkpoint_dir else {}
        for tp in self._tps:
            self._next[tp.partition] = offsets.get(tp.partition, 0)
            consumer.seek(tp, self._next[tp.partition])
        self._task = asyncio.create_task(self._run(), name="index-replica")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def __aenter__(self) -> IndexReplica:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            got = await consumer.getmany(timeout_ms=200, max_records=2000)
            for tp, records in got.items():
                for record in records:
                    if record.offset < self._next[tp.partition]:
                        continue
                    self.records += 1
                    try:
                        batch = codec.decode(self.topic, record.value)
                    except ContractError:
                        self.malformed += 1
                    else:
                        self.index.apply(batch)
                    self._next[tp.partition] = record.offset + 1
                    self._last_ts_ms[tp.partition] = float(record.timestamp)
            if got:
                await asyncio.sleep(0)  # let lookups in between large fetches

    # -- freshness and lookups -----------------------------------------------------------------------

    def lag(self) -> tuple[int, float]:
        """(records behind, milliseconds behind) as described in the module docstring."""
        consumer = self._consumer
        if consumer is None:
            return 0, 0.0
        behind, age = 0, 0.0
        now_ms = self.clock() * 1000.0
        for tp in self._tps:
            high = consumer.highwater(tp)
            if high is None:
                continue
            gap = max(0, high - self._next[tp.partition])
            if gap:
                behind += gap
                age = max(age, now_ms - self._last_ts_ms.get(tp.partition, now_ms))
        METRICS.consumer_lag.labels(self.client_id, self.topic.name).set(behind)
        return behind, max(0.0, age)

    async def wait_caught_up(self, end_offsets: dict[int, int] | None = None, timeout_s: float = 60.0) -> None:
        """Wait until every partition is applied up to ``end_offsets`` (default: the high watermarks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        consumer = self._consumer
        assert consumer is not None
        if end_offsets is None:
            end_offsets = await consumer.end_offsets(self._tps)
            end_offsets = {tp.partition: off for tp, off in end_offsets.items()}
        while any(self._next[p] < off for p, off in end_offsets.items()):
            if loop.time() > deadline:
                raise TimeoutError(f"replica not caught up: {self._next} < {end_offsets}")
            await asyncio.sleep(0.05)

    def _fresh(self, result: LookupResult) -> LookupResult:
        events, ms = self.lag()
        return dataclasses.replace(result, lag_events=events, lag_ms=ms) if events else result

    def lookup(self, scope: IdentityScope, keys: Sequence[int] | np.ndarray) -> LookupResult:
        return self._fresh(self.index.lookup(scope, keys))

    def lookup_tokens(self, scope: IdentityScope, token_ids: Sequence[int] | np.ndarray, block_size: int) -> LookupResult:
        return self._fresh(self.index.lookup_tokens(scope, token_ids, block_size))
