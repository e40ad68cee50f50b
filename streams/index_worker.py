"""The index stream worker: ``nexuskv.kv-events`` into a :class:`~nexuskv.index.GlobalIndex`.

A Faust agent (app ``nexuskv-index``, one consumer group) consumes the topic, keyed by publisher
so each publisher's batches arrive in order on one partition, decodes each record with
:mod:`nexuskv.contracts.codec` and applies the whole batch to the index. A record that does not
decode goes to ``nexuskv.dead-letter`` with the reason, and the agent goes on. No Faust table is
written: a table row per block would cap the worker at Faust's ~3.6k table updates per second.

**Recovery: the event log plus per-partition checkpoints.** The log is the source of truth and
the index is a deterministic, idempotent function of it (duplicates are dropped by publisher
sequence number). For each partition the worker keeps ``next_offset``: its index holds exactly
the effect of that partition's records ``[0, next_offset)``. Every
``NEXUSKV_INDEX_CHECKPOINT_INTERVAL`` seconds it writes, for each partition that changed, a
checkpoint file ``<data_dir>/index/<app>/<topic>.<partition>.ckpt``: the partition's publishers'
complete index state (:meth:`GlobalIndex.checkpoint`) and its ``next_offset``, written to a
temporary file, fsynced and renamed, so a file is always whole.

When a record of partition ``p`` arrives at offset ``o``:

* the first time the worker sees ``p``, it loads ``p``'s checkpoint (if any) and takes its
  ``next_offset``, else starts from offset 0 (the log's start);
* ``o < next_offset``: already applied (at-least-once redelivery after a restart or rebalance,
  since Faust's committed offset may trail the checkpoint) — skipped;
* ``o > next_offset``: the worker is missing ``[next_offset, o)`` — Faust resumed from a committed
  offset newer than the checkpoint (the worker was SIGKILLed after committing), or the partition
  was away on another worker. A plain aiokafka consumer (no group) reads exactly that range and
  applies it first; then ``o``.

So after a SIGKILL the restarted worker rebuilds from its checkpoints and the log, whatever Faust
had committed, and answers as before. Faust's own changelog recovery is not used (unreliable on
Tansu, ``stack.md`` §2.5). Partitions that moved to another worker keep their state here until
they come back (then the gap is read as above); a checkpoint never overwrites a newer one.

**Lookups and scale-out.** Workers of one group split the partitions, so each holds the
publishers of its partitions only. Lookups are not served from here: a lookup needs every
publisher, so it goes to an :class:`~streams.replica.IndexReplica`, which reads *all* partitions
(in the planner's or router's process, or behind ``streams.index_api``'s HTTP endpoint). Two
workers together hold the same facts as one (their checkpoints, restored into one index, answer
identically). A replica may bootstrap from the workers' checkpoint folder instead of replaying the
whole log.

Run: ``python -m streams.index_worker [--topic T] [--group G] [--dead-letter-topic D]``
(``nexuskv up`` starts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from aiokafka import AIOKafkaProducer, TopicPartition

from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts import codec
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS, Topic
from nexuskv.errors import ConfigError, ContractError, NexusKVError
from nexuskv.index import GlobalIndex
from streams.bus import dead_letter_for, make_consumer, make_producer, send
from streams.faust_app import make_faust_app
from streams.telemetry import METRICS, init_service

__all__ = ["IndexWorker", "PartitionCheckpoint", "read_checkpoint", "checkpoint_path", "load_checkpoints", "main"]

log = logging.getLogger("nexuskv.index_worker")
SERVICE = "index-worker"
APP_NAME = "nexuskv-index"


@dataclass(frozen=True, slots=True)
class PartitionCheckpoint:
    topic: str
    partition: int
    next_offset: int
    index: bytes  # GlobalIndex.checkpoint of the partition's publishers


def checkpoint_path(folder: Path, topic: str, partition: int) -> Path:
    return folder / f"{topic}.{partition}.ckpt"


def read_checkpoint(path: Path) -> PartitionCheckpoint | None:
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        return PartitionCheckpoint(doc["topic"], int(doc["partition"]), int(doc["next_offset"]), doc["index"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        log.warning("ignoring unreadable checkpoint %s: %s", path, exc)
        return None


def _write_checkpoint(path: Path, ckpt: PartitionCheckpoint) -> bool:
    """Atomically replace ``path`` unless it already holds a newer checkpoint."""
    current = read_checkpoint(path)
    if current is not None and current.next_offset > ckpt.next_offset:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data = msgpack.packb({"topic": ckpt.topic, "partition": ckpt.partition, "next_offset": ckpt.next_offset,
                          "index": ckpt.index}, use_bin_type=True)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return True


def load_checkpoints(folder: Path, topic: str, index: GlobalIndex) -> dict[int, int]:
    """Restore every checkpoint of ``topic`` in ``folder`` into ``index``; partition -> next offset."""
    offsets = {}
    for path in sorted(folder.glob(f"{topic}.*.ckpt")):
        ckpt = read_checkpoint(path)
        if ckpt is not None and ckpt.topic == topic:
            index.restore(ckpt.index)
            offsets[ckpt.partition] = ckpt.next_offset
    return offsets


@dataclass(slots=True)
class _Partition:
    next_offset: int
    publishers: set[str] = field(default_factory=set)
    dirty: bool = False


class IndexWorker:
    """The Faust app, its agent and the per-partition bookkeeping (see the module docstring)."""

    def __init__(self, url: BrokerUrl, *, data_dir: Path, max_memberships: int, secret: bytes,
                 checkpoint_interval_s: float, partitions: int, topic: str = KV_EVENTS.name,
                 group: str = APP_NAME, dead_letter_topic: str = DEAD_LETTER.name) -> None:
        self.url = url
        self.topic = dataclasses.replace(KV_EVENTS, name=topic)
        self.dead_letter: Topic = dataclasses.replace(DEAD_LETTER, name=dead_letter_topic)
        self.index = GlobalIndex(max_memberships=max_memberships, secret=secret)
        self.checkpoint_dir = Path(data_dir) / "index" / group
        self.parts: dict[int, _Partition] = {}
        self.records = 0
        self.skipped = 0
        self.dead_letters = 0
        self._producer: AIOKafkaProducer | None = None
        faust_dir = Path(data_dir) / "faust" / group
        faust_dir.parent.mkdir(parents=True, exist_ok=True)
        self.app = make_faust_app(group, url, data_dir=faust_dir, topic_partitions=partitions)
        source = self.app.topic(topic, key_type=bytes, value_type=bytes)

        async def apply_batches(stream: Any) -> None:
            async for event in stream.events():
                msg = event.message
                await self.handle(msg.partition, msg.offset, msg)

        self.app.agent(source, name=f"{group}.apply")(apply_batches)
        self.app.timer(checkpoint_interval_s)(self.checkpoint_dirty)

    async def handle(self, partition: int, offset: int, record: Any) -> None:
        part = self.parts.get(partition)
        if part is None:
            part = self.parts[partition] = self._open(partition)
        if offset < part.next_offset:
            self.skipped += 1
            return
        if offset > part.next_offset:
            await self._catch_up(partition, part, offset)
        await self._apply(partition, part, offset, record)

    def _open(self, partition: int) -> _Partition:
        ckpt = read_checkpoint(checkpoint_path(self.checkpoint_dir, self.topic.name, partition))
        if ckpt is None:
            return _Partition(next_offset=0)
        names = self.index.restore(ckpt.index)
        log.info("partition %d: restored %d publishers from checkpoint at offset %d", partition, len(names),
                 ckpt.next_offset)
        return _Partition(next_offset=ckpt.next_offset, publishers=set(names))

    async def _catch_up(self, partition: int, part: _Partition, upto: int) -> None:
        """Apply records ``[part.next_offset, upto)`` of ``partition`` with a group-less consumer."""
        start = part.next_offset
        tp = TopicPartition(self.topic.name, partition)
        consumer = make_consumer(self.url, client_id=f"{SERVICE}-catch-up", group_id=None)
        await consumer.start()
        try:
            consumer.assign([tp])
            consumer.seek(tp, start)
            while part.next_offset < upto:
                got = await consumer.getmany(tp, timeout_ms=1000, max_records=500)
                for record in got.get(tp, []):
                    if record.offset >= upto:  # the rest of the range is gone (retention): nothing to read
                        part.next_offset = upto
                        break
                    if record.offset >= part.next_offset:
                        await self._apply(partition, part, record.offset, record)
        finally:
            await consumer.stop()
        log.info("partition %d: caught up offsets [%d, %d)", partition, start, upto)

    async def _apply(self, partition: int, part: _Partition, offset: int, record: Any) -> None:
        self.records += 1
        try:
            batch = codec.decode(self.topic, record.value)
        except ContractError as exc:
            await self._dead_letter(record, exc)
        else:
            self.index.apply(batch)
            part.publishers.add(batch.publisher)
            METRICS.events_applied.labels(SERVICE, "batches").inc()
            METRICS.events_applied.labels(SERVICE, "block_ops").inc(batch.block_operations)
            METRICS.index_size.labels(SERVICE).set(self.index.memberships)
        part.next_offset = offset + 1
        part.dirty = True

    async def _dead_letter(self, record: Any, error: BaseException) -> None:
        if self._producer is None:
            self._producer = make_producer(self.url, client_id=SERVICE)
            await self._producer.start()
        letter = dead_letter_for(self.topic.name, record, error, service=SERVICE, now=time.time())
        await send(self._producer, self.dead_letter, letter.source_topic, letter)
        self.dead_letters += 1
        METRICS.events_rejected.labels(SERVICE, self.topic.name).inc()

    async def checkpoint_dirty(self) -> None:
        """Write a checkpoint for every partition applied since its last one."""
        loop = asyncio.get_running_loop()
        for partition, part in list(self.parts.items()):
            if not part.dirty:
                continue
            ckpt = PartitionCheckpoint(self.topic.name, partition, part.next_offset,
                                       self.index.checkpoint(sorted(part.publishers)))
            part.dirty = False
            path = checkpoint_path(self.checkpoint_dir, self.topic.name, partition)
            await loop.run_in_executor(None, _write_checkpoint, path, ckpt)

    async def stop(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
            self._producer = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.index_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--topic", default=KV_EVENTS.name)
    parser.add_argument("--group", default=APP_NAME)
    parser.add_argument("--dead-letter-topic", default=DEAD_LETTER.name)
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        url = settings.broker_url
        if url is None:
            raise ConfigError("NEXUSKV_BROKER", "the index worker needs a broker URL (nexuskv up sets it)")
    except NexusKVError as exc:
        print(f"{SERVICE}: error: {exc}", file=sys.stderr)
        return 2
    init_service(SERVICE, settings)
    import faust

    from streams.topics import ensure_topics

    topics = (dataclasses.replace(KV_EVENTS, name=args.topic), dataclasses.replace(DEAD_LETTER, name=args.dead_letter_topic))
    asyncio.run(ensure_topics(url, partitions=settings.topic_partitions, replication=settings.topic_replication,
                              topics=topics))
    worker = IndexWorker(url, data_dir=settings.data_dir, max_memberships=settings.index_max_memberships,
                         secret=settings.identity_secret_bytes, checkpoint_interval_s=settings.index_checkpoint_interval_s,
                         partitions=settings.topic_partitions, topic=args.topic, group=args.group,
                         dead_letter_topic=args.dead_letter_topic)
    worker.app.conf.worker_redirect_stdouts = False
    faust.Worker(worker.app, loglevel=settings.log_level, quiet=True).execute_from_commandline()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
