"""IndexReplica: a live, in-process copy of the global index for planners and routers.

It reads *every* partition of ``nexuskv.kv-events`` with a plain aiokafka consumer (no consumer
group: each replica gets all records) and applies them to its own
:class:`~nexuskv.index.GlobalIndex`, in the caller's event loop, so lookups never wait on Kafka.
Records pass the same :class:`~streams.kv_intake.KvIntake` as the index worker's (key, partition,
signature when ``bus_secret`` is set, contract); refused ones are counted and skipped (the index
worker's group puts them in the dead-letter topic once). It starts from the log's beginning, or
from the index worker's checkpoint folder when given one (each partition's checkpoint, then the
log from its offset).

**It never holds the loop.** Large records are decoded in slices and every batch is applied
event by event (:meth:`streams.kv_intake.KvIntake.take`, :func:`streams.index_worker.apply_sliced`),
yielding to the event loop after every :data:`~streams.kv_intake.SLICE_S` of work, so one large
batch (65,536 clears) delays the planner's decisions by milliseconds, not seconds. A lookup between two slices sees the state
after a prefix of that batch's events, which the publisher itself went through, and the lag says
the replica is behind.

**When it cannot rebuild** — the log no longer holds records it needs (retention removed them
before this replica, or the checkpoint it started from, had applied them) — it says so: an error
in the log, :attr:`IndexReplica.unrecoverable` (partition -> the missing offsets), the
``nexuskv_index_unrecoverable_records`` counter, and every publisher of that partition becomes
uncertain (its matches are misses) until it resyncs. Publishers first seen after such a gap are
uncertain by the index's own rule (first seen at ``seq > 0``).

Freshness, filled into every :class:`~nexuskv.lookup.LookupResult`:

* ``lag_events`` — records published but not yet applied, summed over partitions (the partition's
  high watermark from the last fetch minus the next offset to apply);
* ``lag_ms`` — 0 when caught up; otherwise, per lagging partition, now minus the timestamp of the
  last record applied from it (no later than the oldest unapplied one's, so it bounds how stale
  the answer is), the largest over partitions; milliseconds of the caller's clock. Infinite for
  a partition behind that has had no record applied yet (how stale is then unknown).

**Unknown until fetched.** Before a fetch of every partition has told the replica where the log
ends, its lag is not known, and it never says 0: :meth:`IndexReplica.lag` answers ``(None, inf)``
and lookups carry ``lag_ms`` = infinity with ``lag_events`` at least 1 (the records behind the
end offsets read at start, a lower bound). *Caught up* (:meth:`IndexReplica.caught_up`,
readiness) means applied up to :attr:`IndexReplica.start_offsets`, the end offsets read at
start: :func:`report_readiness` keeps a service's ``/readyz`` at 503, with how far behind it is,
until then.

**Supervised.** The apply task is :attr:`IndexReplica.task`; a service watches it
(:class:`streams.supervisor.Supervisor`). If it dies, :attr:`IndexReplica.failure` says why and
every lookup is a miss with infinite lag: a dead replica never answers from frozen facts.

Lookups by token ids key them here, with at most :data:`KEYER_CACHE` keyers cached (one per
scope and block size): a caller choosing block sizes cannot grow this process.

Threads: :meth:`lookup`, :meth:`lookup_tokens` (the keyer cache is a dict under the GIL), :meth:`lag`
and :meth:`caught_up` may be called from any thread (the node's sidecar answers asks on one of
its own): the index's lookup is thread-safe and the freshness is computed from plain values the
apply task writes. Everything else runs on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from aiokafka import AIOKafkaConsumer, TopicPartition

from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.topics import KV_EVENTS
from nexuskv.errors import BrokerError, ContractError
from nexuskv.identity import BlockKeyer, IdentityScope, digest_array
from nexuskv.index import GlobalIndex
from nexuskv.lookup import LookupResult
from streams.bus.clients import make_consumer, retry_transient
from streams.bus.health import HEALTH, Health
from streams.bus.metrics import METRICS
from streams.index_worker import apply_sliced, load_checkpoints
from streams.kv_intake import SLICE_S, KvIntake, Slicer

__all__ = ["IndexReplica", "KEYER_CACHE", "FROM_ENV", "report_readiness"]

log = logging.getLogger("nexuskv.replica")
KEYER_CACHE = 256
#: ``bus_secret=FROM_ENV``: verify with ``NEXUSKV_BUS_SECRET`` (none when it is unset).
FROM_ENV = None


class IndexReplica:
    """Implements :class:`~nexuskv.lookup.IndexView`; start it, then look up."""

    def __init__(self, url: BrokerUrl, *, secret: bytes = b"", max_memberships: int = 16_000_000,
                 topic: str = KV_EVENTS.name, checkpoint_dir: Path | None = None,
                 clock: Callable[[], float] = time.time, client_id: str = "nexuskv-replica",
                 bus_secret: bytes | None = FROM_ENV, slice_s: float = SLICE_S, expected_blocks: int = 0) -> None:
        self.url = url
        self.topic = dataclasses.replace(KV_EVENTS, name=topic)
        # A seed of its own per process: bucket placement an outsider cannot steer (hash flooding).
        self.index = GlobalIndex(max_memberships=max_memberships, secret=secret, seed=os.urandom(32),
                                 expected_blocks=expected_blocks)
        self.checkpoint_dir = checkpoint_dir
        self.clock = clock
        self.client_id = client_id
        self.bus_secret = Settings.from_env().bus_secret_bytes if bus_secret is FROM_ENV else bus_secret
        self.slice_s = slice_s
        self._secret = secret
        self.intake: KvIntake | None = None
        self.malformed = 0  # refused by the intake (any reason)
        self.refused = 0  # batches the index refused (sequence or incarnation jump)
        self.records = 0
        self.unrecoverable: dict[int, list[tuple[int, int]]] = {}
        self.failure: BaseException | None = None
        self._next: dict[int, int] = {}
        #: The end offset of every partition when the replica started: caught up means applied to these.
        self.start_offsets: dict[int, int] = {}
        self._last_ts_ms: dict[int, float] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._tps: list[TopicPartition] = []
        self._keyers: OrderedDict[tuple[IdentityScope, int], BlockKeyer] = OrderedDict()
        self._applying = False

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The apply task (None before :meth:`start`), for a service's supervisor to watch."""
        return self._task

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
        self.intake = KvIntake(self.topic, partitions=len(self._tps), bus_secret=self.bus_secret or b"")
        consumer.assign(self._tps)
        restored = load_checkpoints(self.checkpoint_dir, self.topic.name, self.index) if self.checkpoint_dir else {}
        firsts = await consumer.beginning_offsets(self._tps)
        for tp in self._tps:
            start, names = restored.get(tp.partition, (0, ()))
            self._next[tp.partition] = start
            if firsts[tp] > start:
                self._cannot_rebuild(tp.partition, start, firsts[tp], names)
            consumer.seek(tp, self._next[tp.partition])
        ends = await consumer.end_offsets(self._tps)
        self.start_offsets = {tp.partition: off for tp, off in ends.items()}
        self._task = asyncio.create_task(self._run(), name=f"{self.client_id}-apply")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()
            log.error("%s: the index replica stopped applying: %r; every lookup is a miss from now on",
                      self.client_id, self.failure)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
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

    def _cannot_rebuild(self, partition: int, start: int, first: int, names: Sequence[str]) -> None:
        """Offsets ``[start, first)`` of ``partition`` are gone from the log before this index applied them."""
        assert self.intake is not None
        owned = {n for n in names} | {n for n in self.index.publishers() if self.intake.owns(n, partition)}
        reason = f"kv-events partition {partition} lost offsets [{start}, {first}) to retention before they were applied"
        self.index.mark_uncertain(sorted(owned), reason)
        self.unrecoverable.setdefault(partition, []).append((start, first))
        METRICS.unrecoverable.labels(self.client_id, self.topic.name).inc(first - start)
        log.error("%s: cannot rebuild partition %d exactly: the log no longer holds offsets [%d, %d); %d publishers "
                  "are uncertain until they resync", self.client_id, partition, start, first, len(owned))
        self._next[partition] = first

    async def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None and self.intake is not None
        intake = self.intake
        while True:
            got = await consumer.getmany(timeout_ms=200, max_records=2000)
            slicer = Slicer(self.slice_s)
            for tp, records in got.items():
                for record in records:
                    p = tp.partition
                    if record.offset < self._next[p]:
                        continue
                    if record.offset > self._next[p]:
                        first = (await retry_transient(lambda tp=tp: consumer.beginning_offsets([tp]),
                                                       what="reading a partition's start"))[tp]
                        if first > self._next[p]:  # the consumer was reset past records that are gone
                            self._cannot_rebuild(p, self._next[p], first, ())
                    self.records += 1
                    self._applying = True
                    try:
                        batch = await intake.take(record, slicer)
                    except ContractError:
                        self.malformed += 1
                    else:
                        outcome = await apply_sliced(self.index, batch, slicer)
                        if outcome.status == "refused":
                            self.refused += 1
                    finally:
                        self._applying = False
                    self._next[p] = record.offset + 1
                    self._last_ts_ms[p] = float(record.timestamp)
                    await slicer.pause()  # let lookups in between records
            if got:
                await asyncio.sleep(0)

    # -- freshness and lookups -----------------------------------------------------------------------

    def lag(self) -> tuple[int | None, float]:
        """(records behind, milliseconds behind) as described in the module docstring; ``(None, inf)``
        while unknown (not started, or a partition not fetched yet)."""
        behind, age, known = self._lag()
        return (behind, age) if known else (None, math.inf)

    def _lag(self) -> tuple[int, float, bool]:
        """(records behind, at least; ms behind; whether every partition was fetched)."""
        consumer = self._consumer
        if consumer is None:
            return 0, math.inf, False
        if self.failure is not None:
            return max(1, self._behind(consumer)), math.inf, True
        behind, age, known = 0, 0.0, True
        now_ms = self.clock() * 1000.0
        for tp in self._tps:
            high = consumer.highwater(tp)
            if high is None:  # no fetch yet: the end found at start is a lower bound
                known = False
                high = self.start_offsets.get(tp.partition, 0)
            gap = max(0, high - self._next[tp.partition])
            if gap:
                behind += gap
                last = self._last_ts_ms.get(tp.partition)  # none applied yet: how stale is unknown
                age = max(age, math.inf if last is None else now_ms - last)
        METRICS.consumer_lag.labels(self.client_id, self.topic.name).set(behind if known else math.nan)
        return behind, (max(0.0, age) if known else math.inf), known

    def _behind(self, consumer: AIOKafkaConsumer) -> int:
        return sum(max(0, (consumer.highwater(tp) or 0) - self._next[tp.partition]) for tp in self._tps)

    def caught_up(self) -> bool:
        """Applied up to the end offsets found at start (:attr:`start_offsets`), and still applying."""
        return (self._consumer is not None and self.failure is None
                and all(self._next.get(p, 0) >= off for p, off in self.start_offsets.items()))

    def behind_start(self) -> int:
        """Records still to apply before :meth:`caught_up` (0 once it is)."""
        return sum(max(0, off - self._next.get(p, 0)) for p, off in self.start_offsets.items())

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
            if self.failure is not None:
                raise BrokerError(f"replica stopped applying: {self.failure!r}")
            if loop.time() > deadline:
                raise TimeoutError(f"replica not caught up: {self._next} < {end_offsets}")
            await asyncio.sleep(0.05)

    def _fresh(self, result: LookupResult) -> LookupResult:
        events, ms, known = self._lag()
        if self.failure is not None:
            return LookupResult(num_blocks=result.num_blocks, matches=(), lag_events=events, lag_ms=math.inf)
        if not known:  # never "0 behind" before the replica knows where the log ends
            return dataclasses.replace(result, lag_events=max(1, events), lag_ms=math.inf)
        if self._applying and not events:
            events = 1  # inside a batch: its first events are applied, the rest are not yet
        return dataclasses.replace(result, lag_events=events, lag_ms=ms) if events else result

    def keyer(self, scope: IdentityScope, block_size: int) -> BlockKeyer:
        """The keyer of ``scope`` and ``block_size`` (at most :data:`KEYER_CACHE` kept)."""
        key = (scope, block_size)
        keyer = self._keyers.get(key)
        if keyer is None:
            keyer = self._keyers[key] = BlockKeyer(scope, block_size, self._secret)
            while len(self._keyers) > KEYER_CACHE:
                self._keyers.popitem(last=False)
        else:
            self._keyers.move_to_end(key)
        return keyer

    def lookup(self, scope: IdentityScope, keys: Sequence[int] | np.ndarray) -> LookupResult:
        return self._fresh(self.index.lookup(scope, keys))

    def lookup_tokens(self, scope: IdentityScope, token_ids: Sequence[int] | np.ndarray, block_size: int) -> LookupResult:
        """As :meth:`lookup`, keying the full blocks of ``token_ids`` here (bounded keyer cache)."""
        return self.lookup(scope, digest_array(self.keyer(scope, block_size).digests(token_ids)))


async def report_readiness(replica: IndexReplica, *, health: Health = HEALTH, interval_s: float = 0.5) -> None:
    """Keep ``health``'s ``replica`` condition false, saying how far behind, until ``replica`` has applied
    the log to the end offsets it found at start; then true, and keep running (a supervised task)."""
    while not replica.caught_up():
        if replica.failure is not None:
            raise BrokerError(f"replica stopped applying: {replica.failure!r}")
        behind, _ms = replica.lag()
        seen = "lag unknown (no fetch yet)" if behind is None else f"{behind} records behind the log"
        health.set_ready("replica", False, f"catching up: {replica.behind_start()} records to the log's end at "
                                           f"start; {seen}")
        await asyncio.sleep(interval_s)
    health.set_ready("replica", True)
    log.info("%s: caught up with the log found at start (%d records applied)", replica.client_id, replica.records)
    await asyncio.Event().wait()
