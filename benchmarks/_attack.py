"""The index pipeline under attack, shared by ``tests/streams`` and the ``benchmarks/attack_*.py``
scripts: trace batches, topics, producing (signed or not), index worker processes, their
checkpoints, and comparing an index with the reference (a GlobalIndex fed the genuine batches)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from aiokafka import TopicPartition

from nexuskv.contracts import codec
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS, Topic
from nexuskv.index import GlobalIndex
from streams.bus.clients import BatchSigner, make_consumer, make_producer
from streams.bus.process import ManagedProcess
from streams.bus.topics import ensure_topics
from streams.index_worker import PartitionCheckpoint, checkpoint_path, read_checkpoint
from streams.kv_intake import partition_of

from benchmarks.trace_events import CONVERSATION_SLICE, TraceReplay, load_trace

__all__ = ["PARTITIONS", "SECRET", "ROOT", "replay", "names", "topics", "kv_topic", "produce", "encoded", "home",
           "end_offsets", "worker", "checkpoints", "wait_checkpointed", "restored", "reference", "lost_and_phantom",
           "dead_letters"]

PARTITIONS = 4
SECRET = "replay-secret"
ROOT = Path(__file__).resolve().parents[1]

Item = tuple[bytes, bytes] | tuple[bytes, bytes, int | None, list[tuple[str, bytes]] | None]


def replay(limit: int = 160, **kw) -> tuple[TraceReplay, list[KvEventBatch]]:
    kw.setdefault("workers", 8)
    r = TraceReplay(load_trace(CONVERSATION_SLICE, limit=limit), gpu_blocks=2048, host_blocks=3072, **kw)
    return r, list(r.batches())


def names() -> tuple[str, str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"test.kv-events.{tag}", f"test-index-{tag}", f"test.dead-letter.{tag}"


async def topics(url, topic: str, dead: str, partitions: int = PARTITIONS) -> None:
    await ensure_topics(url, partitions=partitions, topics=(dataclasses.replace(KV_EVENTS, name=topic),
                                                            dataclasses.replace(DEAD_LETTER, name=dead)))


def kv_topic(topic: str) -> Topic:
    return dataclasses.replace(KV_EVENTS, name=topic)


async def produce(url, topic: str, items: Iterable[Item]) -> None:
    """Send ``(key, value)`` or ``(key, value, partition, headers)`` records and wait for every ack."""
    producer = make_producer(url, client_id="index-test")
    await producer.start()
    try:
        futures = []
        for item in items:
            key, value = item[0], item[1]
            partition = item[2] if len(item) > 2 else None
            headers = item[3] if len(item) > 3 else None
            futures.append(await producer.send(topic, value, key=key, partition=partition, headers=headers))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def encoded(batches: list[KvEventBatch], signer: BatchSigner | None = None) -> list[Item]:
    """The records a publisher sends for ``batches`` (signed with ``signer`` when given)."""
    out: list[Item] = []
    for b in batches:
        key, value = b.publisher.encode(), codec.encode(KV_EVENTS, b)
        header = signer.header(b.publisher, key, value) if signer is not None else None
        out.append((key, value, None, [header] if header else None))
    return out


def home(publisher: str, partitions: int = PARTITIONS) -> int:
    return partition_of(publisher.encode(), partitions)


async def end_offsets(url, topic: str, partitions: int = PARTITIONS) -> dict[int, int]:
    consumer = make_consumer(url, client_id="index-test-ends")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


def worker(url, data_dir: Path, topic: str, group: str, dead: str, *, bus_secret: str | None = None,
           checkpoint_s: float = 0.5, partitions: int = PARTITIONS) -> ManagedProcess:
    env = dict(os.environ, NEXUSKV_BROKER=str(url), NEXUSKV_DATA_DIR=str(data_dir), NEXUSKV_IDENTITY_SECRET=SECRET,
               NEXUSKV_INDEX_CHECKPOINT_INTERVAL=str(checkpoint_s), NEXUSKV_TOPIC_PARTITIONS=str(partitions),
               NEXUSKV_LOG_LEVEL="INFO", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NEXUSKV_BUS_SECRET", None)
    if bus_secret is not None:
        env["NEXUSKV_BUS_SECRET"] = bus_secret
    proc = ManagedProcess([sys.executable, "-m", "streams.index_worker", "--topic", topic, "--group", group,
                           "--dead-letter-topic", dead], name=f"index-worker-{group}",
                          log_path=data_dir / "worker.log", env=env, cwd=ROOT)
    proc.start()
    return proc


def checkpoints(dirs: list[Path], topic: str, group: str, partitions: int = PARTITIONS) -> dict[int, PartitionCheckpoint]:
    best: dict[int, PartitionCheckpoint] = {}
    for d in dirs:
        for p in range(partitions):
            ck = read_checkpoint(checkpoint_path(d / "index" / group, topic, p))
            if ck is not None and (p not in best or ck.next_offset > best[p].next_offset):
                best[p] = ck
    return best


async def wait_checkpointed(dirs, topic, group, ends, procs, timeout_s=120.0) -> dict[int, PartitionCheckpoint]:
    deadline = time.monotonic() + timeout_s
    best: dict[int, PartitionCheckpoint] = {}
    while time.monotonic() < deadline:
        best = checkpoints(dirs, topic, group, len(ends))
        if all(ends[p] == 0 or (p in best and best[p].next_offset >= ends[p]) for p in ends):
            return best
        for proc in procs:
            assert proc.alive(), proc.log_tail(40)
        await asyncio.sleep(0.3)
    raise AssertionError(f"checkpoints never caught up to {ends}: {[(p, c.next_offset) for p, c in best.items()]}\n"
                         + "\n".join(p.log_tail(30) for p in procs))


def restored(best: dict[int, PartitionCheckpoint] | Iterable[PartitionCheckpoint]) -> GlobalIndex:
    index = GlobalIndex(secret=SECRET.encode())
    for ck in (best.values() if isinstance(best, dict) else best):
        index.restore(ck.index)
    return index


def reference(batches: Iterable[KvEventBatch]) -> GlobalIndex:
    index = GlobalIndex(secret=SECRET.encode())
    for b in batches:
        index.apply(b)
    return index


def lost_and_phantom(got: dict, truth: dict) -> tuple[int, int]:
    lost = sum(len(truth.get(w, set()) - got.get(w, set())) for w in truth)
    phantom = sum(len(got.get(w, set()) - truth.get(w, set())) for w in got)
    return lost, phantom


async def dead_letters(url, topic: str, want: int, timeout_s: float = 30.0) -> list[DeadLetter]:
    letters: list[DeadLetter] = []
    consumer = make_consumer(url, Topic(topic, "", DeadLetter, "json", ""), client_id="dl-test",
                             group_id=f"dl-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while len(letters) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                letters.extend(DeadLetter.model_validate_json(r.value) for r in records)
    finally:
        await consumer.stop()
    return letters
