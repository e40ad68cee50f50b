"""The index stream worker: ``nexuskv.kv-events`` into a :class:`~nexuskv.index.GlobalIndex`.

A Faust agent (app ``nexuskv-index``, one consumer group) consumes the topic, keyed by publisher
so each publisher's batches arrive in order on one partition. Each record passes
:class:`streams.kv_intake.KvIntake` — its key is its batch's publisher, it sits on its key's
partition, it is signed with that publisher's key when the deployment has a bus secret, and it
decodes — and its batch is applied to the index. A record refused there, or a batch the index
refuses (a sequence or incarnation jump beyond :mod:`nexuskv.publishers`' bound), goes to
``nexuskv.dead-letter`` with the reason; so does a batch the index has seen (a seq already
applied, or an older incarnation), with reason ``replayed: ...``, counted on
``nexuskv_records_refused{reason="replayed"}`` — it changes nothing, but a replay of genuine
signed batches is an attack an operator must see; dead letters are sent in batches
(:class:`streams.bus.clients.DeadLetterQueue`) and acknowledged before any checkpoint covers their records.
No Faust table is written: a table row per block would cap the worker at Faust's ~3.6k table
updates per second.

**Recovery: the event log plus per-partition checkpoints.** The log is the source of truth and
the index is a deterministic, idempotent function of it (duplicates are dropped by publisher
sequence number). For each partition the worker keeps ``next_offset``: its index holds exactly
the effect of that partition's records ``[0, next_offset)``. Every
``NEXUSKV_INDEX_CHECKPOINT_INTERVAL`` seconds it writes, for each partition that changed, a
checkpoint file ``<data_dir>/index/<app>/<topic>.<partition>.ckpt``: the complete index state of
the publishers *keyed to that partition* (:meth:`GlobalIndex.checkpoint`) and its
``next_offset``, written to a temporary file, fsynced and renamed, so a file is always whole. A
temporary file that a kill left behind is removed at the next start. One publisher lives in one
partition's checkpoint only, and :meth:`GlobalIndex.restore` keeps the newest state of a
publisher whatever the order checkpoints are restored in.

Partitions are opened as soon as they are assigned, not when their next record arrives: the
worker loads the partition's checkpoint and reads the log from its ``next_offset`` to the end.
So after a crash an idle partition's checkpoint still advances to what the log holds (otherwise
it would stay behind until retention removed the records it lacks). When a record of partition
``p`` arrives at offset ``o``:

* ``o < next_offset``: already applied (at-least-once redelivery after a restart or rebalance,
  since Faust's committed offset may trail the checkpoint) — skipped;
* ``o > next_offset``: the worker is missing ``[next_offset, o)`` — the partition was away on
  another worker, or Faust resumed past it. A plain aiokafka consumer (no group) reads exactly
  that range and applies it first; then ``o``. A partition that goes quiet while behind is caught
  up the same way.

If the log no longer holds ``[next_offset, ...)`` (retention removed it), the index cannot be
rebuilt exactly: the worker says so (an error in the log, ``unrecoverable_records``), makes every
publisher of that partition uncertain (their matches are misses until each resyncs) and goes on
from the log's start. Faust's own changelog recovery is not used (unreliable on Tansu,
``stack.md`` §2.5). Partitions that moved to another worker keep their state here until they come
back (then the gap is read as above); a checkpoint never overwrites a newer one.

**No record holds the loop.** A large record is decoded in slices (:meth:`KvIntake.take`) and
every batch is applied event by event (:meth:`GlobalIndex.apply_steps`); the worker yields to its
event loop every few milliseconds of work, so timers and the consumer's heartbeats keep running;
checkpoints are taken between batches, never inside one.

**Lookups and scale-out.** Workers of one group split the partitions, so each holds the
publishers of its partitions only. Lookups are not served from here: a lookup needs every
publisher, so it goes to an :class:`~streams.replica.IndexReplica`, which reads *all* partitions
(in the planner's or router's process, or behind ``streams.index_api``'s HTTP endpoint) with the
same intake rules. Two workers together hold the same facts as one (their checkpoints, restored
into one index, answer identically); when one dies, the survivor is assigned its partitions and
rebuilds them from the log. A replica may bootstrap from the workers' checkpoint folder instead
of replaying the whole log.

**Supervision.** A broker outage is waited out. A failure that is neither a refused record nor a
transient broker error (a bug, a full disk) crashes the Faust app, and the process exits non-zero, so ``nexuskv up`` or an
orchestrator sees it; liveness and readiness (every assigned partition opened) are reported on
the metrics port (``/livez``, ``/readyz``).

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
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from nexuskv.config import BrokerUrl, Settings
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS, Topic
from nexuskv.errors import ConfigError, ContractError, NexusKVError, ReplayedError
from nexuskv.index import ApplyOutcome, GlobalIndex
from streams.bus.clients import (
    DeadLetterQueue,
    dead_letter_for,
    is_transient,
    make_consumer,
    make_producer,
    retry_transient,
)
from streams.bus.health import HEALTH
from streams.bus.metrics import METRICS
from streams.bus.process import freeze_startup_heap
from streams.faust_app import make_faust_app
from streams.kv_intake import SLICE_S, KvIntake, Slicer
from streams.telemetry import init_service

__all__ = ["IndexWorker", "PartitionCheckpoint", "read_checkpoint", "checkpoint_path", "load_checkpoints",
           "remove_stale_temporaries", "apply_sliced", "SLICE_S", "main"]

log = logging.getLogger("nexuskv.index_worker")
SERVICE = "index-worker"
APP_NAME = "nexuskv-index"
_TMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class PartitionCheckpoint:
    topic: str
    partition: int
    next_offset: int
    index: bytes  # GlobalIndex.checkpoint of the partition's publishers


def checkpoint_path(folder: Path, topic: str, partition: int) -> Path:
    return folder / f"{topic}.{partition}.ckpt"


def _temporary_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}{_TMP_SUFFIX}")


def read_checkpoint(path: Path) -> PartitionCheckpoint | None:
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        return PartitionCheckpoint(doc["topic"], int(doc["partition"]), int(doc["next_offset"]), doc["index"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        log.warning("ignoring unreadable checkpoint %s: %s", path, exc)
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete checkpoint temporaries whose writer is gone (killed mid-write); returns them.

    A temporary is ``<checkpoint>.<pid>.tmp``; one whose pid is this process's or a live
    process's is left alone (another worker sharing the folder may be writing it)."""
    removed = []
    for tmp in sorted(Path(folder).glob(f"*.ckpt.*{_TMP_SUFFIX}")):
        pid_text = tmp.name[: -len(_TMP_SUFFIX)].rpartition(".")[2]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and _pid_alive(int(pid_text)):
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    if removed:
        log.info("removed %d checkpoint temporaries left by a killed writer: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def _write_checkpoint(path: Path, ckpt: PartitionCheckpoint) -> bool:
    """Atomically replace ``path`` unless it already holds a newer checkpoint."""
    current = read_checkpoint(path)
    if current is not None and current.next_offset > ckpt.next_offset:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_path(path)
    data = msgpack.packb({"topic": ckpt.topic, "partition": ckpt.partition, "next_offset": ckpt.next_offset,
                          "index": ckpt.index}, use_bin_type=True)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return True


def load_checkpoints(folder: Path, topic: str, index: GlobalIndex) -> dict[int, tuple[int, tuple[str, ...]]]:
    """Restore every checkpoint of ``topic`` in ``folder`` into ``index``; partition -> (next
    offset, the publishers its checkpoint holds)."""
    out = {}
    for path in sorted(folder.glob(f"{topic}.*.ckpt")):
        ckpt = read_checkpoint(path)
        if ckpt is not None and ckpt.topic == topic:
            names = _checkpoint_publishers(ckpt.index)
            index.restore(ckpt.index)
            out[ckpt.partition] = (ckpt.next_offset, names)
    return out


def _checkpoint_publishers(data: bytes) -> tuple[str, ...]:
    doc = msgpack.unpackb(data, raw=False)
    return tuple(str(item["name"]) for item in doc.get("publishers", ()))


async def apply_sliced(index: GlobalIndex, batch: KvEventBatch, slicer: Slicer | None = None) -> ApplyOutcome:
    """Apply ``batch``, yielding to the event loop whenever ``slicer``'s slice of work has passed."""
    slicer = slicer or Slicer()
    steps = index.apply_steps(batch)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await slicer.pause()


@dataclass(slots=True)
class _Partition:
    next_offset: int
    publishers: set[str] = field(default_factory=set)
    dirty: bool = False
    last_record: float = 0.0  # monotonic time of the last record handled (idle partitions are caught up)


class IndexWorker:
    """The Faust app, its agent and the per-partition bookkeeping (see the module docstring)."""

    def __init__(self, url: BrokerUrl, *, data_dir: Path, max_memberships: int, secret: bytes,
                 checkpoint_interval_s: float, partitions: int, topic: str = KV_EVENTS.name,
                 group: str = APP_NAME, dead_letter_topic: str = DEAD_LETTER.name, bus_secret: bytes = b"",
                 maintain_s: float = 1.0, idle_s: float = 2.0, expected_blocks: int = 0) -> None:
        self.url = url
        self.topic = dataclasses.replace(KV_EVENTS, name=topic)
        self.dead_letter: Topic = dataclasses.replace(DEAD_LETTER, name=dead_letter_topic)
        self.intake = KvIntake(self.topic, partitions=partitions, bus_secret=bus_secret)
        # A seed of its own per process: bucket placement an outsider cannot steer (hash flooding).
        self.index = GlobalIndex(max_memberships=max_memberships, secret=secret, seed=os.urandom(32),
                                 expected_blocks=expected_blocks)
        self.checkpoint_dir = Path(data_dir) / "index" / group
        self.parts: dict[int, _Partition] = {}
        self.idle_s = idle_s
        self.records = 0
        self.skipped = 0
        self.dead_letters = 0
        self.replayed = 0  # batches the index had seen (duplicate seq, older incarnation): dead-lettered, counted
        self.unrecoverable_records = 0
        self._producer: AIOKafkaProducer | None = None
        self._letters: DeadLetterQueue | None = None
        self._reader: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        remove_stale_temporaries(self.checkpoint_dir)
        faust_dir = Path(data_dir) / "faust" / group
        faust_dir.parent.mkdir(parents=True, exist_ok=True)
        self.app = make_faust_app(group, url, data_dir=faust_dir, topic_partitions=partitions)
        source = self.app.topic(topic, key_type=bytes, value_type=bytes)

        async def apply_batches(stream: Any) -> None:
            async for event in stream.events():
                msg = event.message
                await self._supervised(self.handle(msg.partition, msg.offset, msg))

        self.app.agent(source, name=f"{group}.apply")(apply_batches)
        self.app.timer(checkpoint_interval_s)(self.checkpoint_dirty)
        self.app.timer(maintain_s)(self.maintain)
        HEALTH.set_ready("partitions", False, "not assigned yet")

    async def _supervised(self, work: Any) -> None:
        """Run ``work``; anything but a refused record crashes the app (the process exits non-zero)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("%s: failed; stopping", SERVICE)
            HEALTH.fail(f"{type(exc).__name__}: {exc}")
            await self.app.crash(exc)
            raise

    # -- records ---------------------------------------------------------------------------------

    async def handle(self, partition: int, offset: int, record: Any) -> None:
        async with self._lock:
            part = self.parts.get(partition)
            if part is None:
                part = await self._open(partition)
            part.last_record = time.monotonic()
            if offset < part.next_offset:
                self.skipped += 1
                return
            if offset > part.next_offset:
                await self._catch_up(partition, part, offset)
            await self._apply(partition, part, offset, record)

    async def _open(self, partition: int) -> _Partition:
        ckpt = read_checkpoint(checkpoint_path(self.checkpoint_dir, self.topic.name, partition))
        if ckpt is None:
            part = _Partition(next_offset=0)
        else:
            # Publishers keyed elsewhere may sit in a checkpoint written before the intake checked
            # partitions: restore keeps their newest state, this partition stops claiming them.
            names = [n for n in _checkpoint_publishers(ckpt.index) if self.intake.owns(n, partition)]
            self.index.restore(ckpt.index)
            log.info("partition %d: restored %d publishers from checkpoint at offset %d", partition, len(names),
                     ckpt.next_offset)
            part = _Partition(next_offset=ckpt.next_offset, publishers=set(names))
        self.parts[partition] = part
        return part

    async def _reader_consumer(self) -> AIOKafkaConsumer:
        if self._reader is None:
            reader = make_consumer(self.url, client_id=f"{SERVICE}-catch-up", group_id=None)
            await retry_transient(reader.start, what="connecting the catch-up reader")
            self._reader = reader
        return self._reader

    async def _catch_up(self, partition: int, part: _Partition, upto: int) -> None:
        """Apply records ``[part.next_offset, upto)`` of ``partition`` with a group-less consumer."""
        start = part.next_offset
        tp = TopicPartition(self.topic.name, partition)
        consumer = await self._reader_consumer()
        first = (await retry_transient(lambda: consumer.beginning_offsets([tp]), what="reading a partition's start"))[tp]
        if first > part.next_offset:
            self._unrecoverable(partition, part, first)
        consumer.assign([tp])
        consumer.seek(tp, part.next_offset)
        while part.next_offset < upto:
            got = await consumer.getmany(tp, timeout_ms=1000, max_records=500)
            for record in got.get(tp, []):
                if record.offset >= upto:  # the rest of the range is gone: nothing more to read
                    part.next_offset = upto
                    break
                if record.offset >= part.next_offset:
                    await self._apply(partition, part, record.offset, record)
        if upto > start:
            log.info("partition %d: caught up offsets [%d, %d)", partition, start, upto)

    def _unrecoverable(self, partition: int, part: _Partition, first: int) -> None:
        lost = first - part.next_offset
        names = sorted(part.publishers)
        self.index.mark_uncertain(names, f"kv-events partition {partition} lost offsets [{part.next_offset}, {first}) "
                                         "to retention before they were applied")
        self.unrecoverable_records += lost
        METRICS.unrecoverable.labels(SERVICE, self.topic.name).inc(lost)
        log.error("partition %d: the log no longer holds offsets [%d, %d) (retention removed them before this index "
                  "applied them): the index cannot be rebuilt exactly; %d publishers of the partition are uncertain "
                  "until they resync", partition, part.next_offset, first, len(names))
        part.next_offset = first
        part.dirty = True

    async def _apply(self, partition: int, part: _Partition, offset: int, record: Any) -> None:
        self.records += 1
        slicer = Slicer()
        try:
            batch = await self.intake.take(record, slicer)
        except ContractError as exc:
            await self._dead_letter(record, exc)
        else:
            part.publishers.add(batch.publisher)  # the intake checked that it is keyed to this partition
            outcome = await apply_sliced(self.index, batch, slicer)
            if outcome.status == "refused":
                status = self.index.publisher_status(batch.publisher)
                reason = status.reason if status is not None and status.reason else "refused sequence number"
                await self._dead_letter(record, ContractError(f"batch of {batch.publisher} refused: {reason}",
                                                              path="seq"))
            elif outcome.status in ("duplicate", "stale"):
                # A batch the index has seen (its seq, or an older incarnation): harmless, and nothing
                # changed, but an operator must see it: a replay of genuine, signed batches looks like this.
                self.replayed += 1
                METRICS.records_refused.labels(SERVICE, self.topic.name, "replayed").inc()
                status = self.index.publisher_status(batch.publisher)
                had = f"; the index is at incarnation {status.incarnation}, next seq {status.next_seq}" \
                    if status is not None else ""
                what = "seq already applied" if outcome.status == "duplicate" else "incarnation older than the index's"
                await self._dead_letter(record, ReplayedError(
                    f"replayed: batch {batch.incarnation}/{batch.seq} of publisher {batch.publisher[:80]!r}: {what}{had}"))
            else:
                METRICS.events_applied.labels(SERVICE, "batches").inc()
                METRICS.events_applied.labels(SERVICE, "block_ops").inc(outcome.block_ops)
            METRICS.index_size.labels(SERVICE).set(self.index.memberships)
        part.next_offset = offset + 1
        part.dirty = True

    async def _dead_letter(self, record: Any, error: BaseException) -> None:
        if self._letters is None:
            self._producer = make_producer(self.url, client_id=SERVICE)
            await self._producer.start()
            self._letters = DeadLetterQueue(self._producer, self.dead_letter)
        await self._letters.put(dead_letter_for(self.topic.name, record, error, service=SERVICE, now=time.time()))
        self.dead_letters += 1
        METRICS.events_rejected.labels(SERVICE, self.topic.name).inc()

    # -- timers ----------------------------------------------------------------------------------

    def _assigned(self) -> list[int]:
        try:
            assignment = self.app.consumer.assignment()
        except Exception:  # noqa: BLE001 - not started yet
            return []
        return sorted(tp.partition for tp in assignment if tp.topic == self.topic.name)

    async def maintain(self) -> None:
        """Open every assigned partition, and catch up those that went quiet while behind."""
        await self._supervised(self._maintain())

    async def _maintain(self) -> None:
        HEALTH.beat()  # this loop answers (a held loop is not alive: /livez)
        assigned = self._assigned()
        if not assigned:
            return
        consumer = await self._reader_consumer()
        tps = [TopicPartition(self.topic.name, p) for p in assigned]
        try:
            ends = {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
        except KafkaError as exc:
            if not is_transient(exc):
                raise
            HEALTH.set_ready("broker", False, f"end offsets: {type(exc).__name__}")
            return  # the broker is away: the next tick looks again
        HEALTH.set_ready("broker", True)
        now = time.monotonic()
        for p in assigned:
            async with self._lock:
                part = self.parts.get(p)
                opened = part is None
                if opened:  # the agent gets idle_s to deliver its records before the log is read here
                    part = await self._open(p)
                    part.last_record = now
                if part.next_offset < ends[p] and now - part.last_record >= self.idle_s:
                    await self._catch_up(p, part, ends[p])
                    part.last_record = time.monotonic()
        HEALTH.set_ready("partitions", all(p in self.parts for p in assigned), f"{len(assigned)} assigned")

    async def checkpoint_dirty(self) -> None:
        """Write a checkpoint for every partition applied since its last one."""
        await self._supervised(self._checkpoint_dirty())

    async def _checkpoint_dirty(self) -> None:
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self._letters is not None:
                await self._letters.flush()  # a checkpoint never covers a record whose dead letter is unsent
            due = []
            for partition, part in list(self.parts.items()):
                if part.dirty:
                    names = sorted(n for n in part.publishers if self.intake.owns(n, partition))
                    due.append(PartitionCheckpoint(self.topic.name, partition, part.next_offset,
                                                   self.index.checkpoint(names)))
                    part.dirty = False
        for ckpt in due:
            path = checkpoint_path(self.checkpoint_dir, self.topic.name, ckpt.partition)
            await loop.run_in_executor(None, _write_checkpoint, path, ckpt)

    async def stop(self) -> None:
        if self._letters is not None:
            with contextlib.suppress(Exception):
                await self._letters.flush()
        for client in (self._producer, self._reader):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._producer = self._reader = self._letters = None


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

    from streams.bus.topics import ensure_topics

    topics = (dataclasses.replace(KV_EVENTS, name=args.topic), dataclasses.replace(DEAD_LETTER, name=args.dead_letter_topic))
    states = asyncio.run(ensure_topics(url, partitions=settings.topic_partitions,
                                       replication=settings.topic_replication, topics=topics))
    partitions = next(s.partitions for s in states if s.name == args.topic)
    if not settings.bus_secret:
        log.warning("NEXUSKV_BUS_SECRET is not set: kv-events batches are not authenticated")
    worker = IndexWorker(url, data_dir=settings.data_dir, max_memberships=settings.index_max_memberships,
                         secret=settings.identity_secret_bytes, checkpoint_interval_s=settings.index_checkpoint_interval_s,
                         partitions=partitions, topic=args.topic, group=args.group,
                         dead_letter_topic=args.dead_letter_topic, bus_secret=settings.bus_secret_bytes,
                         expected_blocks=settings.index_expected_blocks)
    worker.app.conf.worker_redirect_stdouts = False
    freeze_startup_heap()
    faust.Worker(worker.app, loglevel=settings.log_level, quiet=True).execute_from_commandline()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
