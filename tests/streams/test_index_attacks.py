"""The index pipeline attacked on a real Apache Kafka (issue 13): misfiled and replayed records,
spoofed and absurd batches, crashes around checkpoints, retention, a worker killed mid-stream.

Each test replays the Mooncake conversation slice through index worker processes and compares
what they (and replicas) hold with the reference: a GlobalIndex fed the genuine batches in order.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from nexuskv.contracts import codec
from nexuskv.contracts.kv_events import AllCleared, KvEventBatch
from nexuskv.contracts.kv_signature import publisher_key
from nexuskv.contracts.topics import KV_EVENTS
from streams.bus.clients import BatchSigner, make_consumer
from streams.index_worker import PartitionCheckpoint, _write_checkpoint, checkpoint_path
from streams.replica import IndexReplica

from tests.streams.index_pipeline import (
    PARTITIONS,
    ROOT,
    SECRET,
    checkpoints,
    dead_letters,
    encoded,
    end_offsets,
    home,
    lost_and_phantom,
    names,
    produce,
    reference,
    replay,
    restored,
    topics,
    wait_checkpointed,
    worker,
)

pytestmark = pytest.mark.broker
BUS = "the-bus-secret-of-the-attack-tests"


def _prefix(fits, workers: int = 2) -> str:
    """A publisher name prefix whose publishers' home partitions satisfy ``fits``."""
    for i in itertools.count():
        prefix = f"atk{i}"
        if fits([home(f"{prefix}-{w}") for w in range(workers)]):
            return prefix
    raise AssertionError("unreachable")


async def _delete_before(url, topic: str, upto: dict[int, int]) -> None:
    """What retention does: the log of each partition starts at ``upto[p]`` afterwards."""
    admin = AIOKafkaAdminClient(bootstrap_servers=url.bootstrap_servers, client_id="index-test-retention")
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(topic, p): RecordsToDelete(before_offset=o)
                                    for p, o in upto.items() if o > 0})
    finally:
        await admin.close()


async def test_a_batch_replayed_onto_a_quiet_partition_leaves_checkpoint_recovery_exact(kafka_url, tmp_path):
    # Defect 1. Both publishers live below the last partition, which no genuine record reaches:
    # its checkpoint sorts (and is restored) last.
    prefix = _prefix(lambda homes: max(homes) < PARTITIONS - 1)
    _r, batches = replay(limit=80, workers=2, prefix=prefix)
    quiet = PARTITIONS - 1
    victim = batches[0].publisher
    stranger = next(n for n in (f"{prefix}-stranger-{i}" for i in itertools.count()) if home(n) == quiet)
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    proc = worker(kafka_url, tmp_path, topic, group, dead)
    try:
        half = len(batches) // 2
        await produce(kafka_url, topic, encoded(batches[:half]))
        await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
        early = codec.encode(KV_EVENTS, next(b for b in batches[:half] if b.publisher == victim))
        # The victim's own record replayed onto the quiet partition, and the same batch under a key
        # that does belong there: both once made the quiet partition's checkpoint claim the victim.
        await produce(kafka_url, topic, [(victim.encode(), early, quiet, None), (stranger.encode(), early, quiet, None)])
        await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
        await produce(kafka_url, topic, encoded(batches[half:]))
        best = await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
    finally:
        proc.stop()
    truth = reference(batches).facts()
    assert lost_and_phantom(restored(best).facts(), truth) == (0, 0)
    assert restored(reversed(list(best.values()))).facts() == truth  # whatever the restore order
    async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic,
                            checkpoint_dir=tmp_path / "index" / group) as replica:
        await replica.wait_caught_up()
        assert lost_and_phantom(replica.index.facts(), truth) == (0, 0)
    letters = await dead_letters(kafka_url, dead, 2)
    reasons = sorted(le.reason for le in letters)
    assert len(letters) == 2, reasons
    assert any(f"belongs on partition {home(victim)}" in r for r in reasons)
    assert any("must be keyed by its batch's publisher" in r for r in reasons)


async def test_spoofed_batches_cannot_harm_a_genuine_publisher_and_absurd_jumps_are_refused(kafka_url, tmp_path):
    # Publisher authentication and bounded jumps, with NEXUSKV_BUS_SECRET set on the worker.
    _r, batches = replay(limit=80, workers=2, prefix="auth")
    x, y = sorted({b.publisher for b in batches})
    genuine = BatchSigner(bus_secret=BUS.encode())
    mallory = BatchSigner(keys={x: publisher_key(BUS.encode(), "mallory")})  # a real key, not x's
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    proc = worker(kafka_url, tmp_path, topic, group, dead, bus_secret=BUS)
    try:
        half = len(batches) // 2
        await produce(kafka_url, topic, encoded(batches[:half], genuine))
        await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
        seq_x = max(b.seq for b in batches[:half] if b.publisher == x) + 1
        seq_y = max(b.seq for b in batches[:half] if b.publisher == y) + 1
        ident = batches[0].identity

        def batch(pub, seq, incarnation=1):
            return KvEventBatch(publisher=pub, incarnation=incarnation, seq=seq, ts=time.time(), identity=ident,
                                events=(AllCleared(),))

        attacks = (encoded([batch(x, seq_x)])                       # a spoofed clear with the victim's next seq
                   + encoded([batch(x, seq_x)], mallory)            # signed, but with another publisher's key
                   + encoded([batch(x, 2 ** 62)])                   # a spoofed absurd sequence number
                   + encoded([batch(y, 2 ** 62)], genuine)          # y itself, gone wrong: an absurd sequence ...
                   + encoded([batch(y, seq_y, 2 ** 62)], genuine))  # ... and an absurd incarnation
        await produce(kafka_url, topic, attacks)
        await produce(kafka_url, topic, encoded(batches[half:], genuine))
        best = await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
    finally:
        proc.stop()
    truth = reference(batches).facts()
    index = restored(best)
    assert lost_and_phantom(index.facts(), truth) == (0, 0)  # y's later genuine batches all applied
    assert index.publisher_status(x).certain
    status_y = index.publisher_status(y)
    assert not status_y.certain and "refused" in status_y.reason  # its refused batches may have held removals
    async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic, bus_secret=BUS.encode()) as replica:
        await replica.wait_caught_up()
        assert lost_and_phantom(replica.index.facts(), truth) == (0, 0)
        assert replica.index.publisher_status(x).certain and replica.malformed == 3 and replica.refused == 2
    letters = await dead_letters(kafka_url, dead, 5)
    reasons = [le.reason for le in sorted(letters, key=lambda le: le.offset)]
    assert len(letters) == 5, reasons
    assert sum("unauthenticated" in r for r in reasons) == 3
    assert sum("no nexuskv-sig header" in r for r in reasons) == 2
    assert sum("refused sequence jump" in r for r in reasons) == 1
    assert sum("refused incarnation jump" in r for r in reasons) == 1


async def test_replayed_signed_batches_are_dead_lettered_as_replayed_and_change_nothing(kafka_url, tmp_path):
    # Issue 23: a replay of genuine, validly signed batches was dropped silently.
    _r, batches = replay(limit=60, workers=2, prefix="rpl")
    genuine = BatchSigner(bus_secret=BUS.encode())
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    proc = worker(kafka_url, tmp_path, topic, group, dead, bus_secret=BUS)
    try:
        half = len(batches) // 2
        await produce(kafka_url, topic, encoded(batches[:half], genuine))
        await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
        replayed = encoded(batches[:10], genuine)  # the same signed records, sent again by an outsider
        await produce(kafka_url, topic, replayed)
        await produce(kafka_url, topic, encoded(batches[half:], genuine))
        best = await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
    finally:
        proc.stop()
    truth = reference(batches).facts()
    assert lost_and_phantom(restored(best).facts(), truth) == (0, 0)
    letters = await dead_letters(kafka_url, dead, 10)
    reasons = [le.reason for le in letters]
    assert len(letters) == 10 and all(r.startswith("replayed: batch ") for r in reasons), reasons
    assert all(le.error_type == "ReplayedError" for le in letters)
    assert {le.payload for le in letters} == {value for _key, value, *_ in replayed}


async def test_after_a_crash_an_idle_partitions_checkpoint_still_catches_up(kafka_url, tmp_path):
    # Defect 8, first half: a worker killed after applying a partition's records but before
    # checkpointing them, restarted, with no new record for that partition.
    _r, batches = replay(limit=100)
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    folder = tmp_path / "index" / group
    proc = worker(kafka_url, tmp_path, topic, group, dead)
    try:
        half = len(batches) // 2
        await produce(kafka_url, topic, encoded(batches[:half]))
        first = await end_offsets(kafka_url, topic)
        await wait_checkpointed([tmp_path], topic, group, first, [proc])
        saved = tmp_path / "saved"
        shutil.copytree(folder, saved)
        await produce(kafka_url, topic, encoded(batches[half:]))
        ends = await end_offsets(kafka_url, topic)
        await wait_checkpointed([tmp_path], topic, group, ends, [proc])
        idle = max(range(PARTITIONS), key=lambda p: ends[p] - first[p])
        assert ends[idle] > first[idle]
        await _wait_committed(kafka_url, topic, group, ends, proc)  # Faust will not deliver them again
        os.killpg(proc.pid, signal.SIGKILL)
        proc.stop()
        shutil.copy(checkpoint_path(saved, topic, idle), checkpoint_path(folder, topic, idle))  # the lost checkpoint
        assert checkpoints([tmp_path], topic, group)[idle].next_offset == first[idle]
        proc = worker(kafka_url, tmp_path, topic, group, dead)
        deadline = time.monotonic() + 30
        while checkpoints([tmp_path], topic, group)[idle].next_offset < ends[idle]:
            assert time.monotonic() < deadline, f"partition {idle}'s checkpoint never advanced:\n{proc.log_tail(30)}"
            assert proc.alive(), proc.log_tail(30)
            await asyncio.sleep(0.3)
    finally:
        proc.stop()
    await _delete_before(kafka_url, topic, ends)  # retention takes what every checkpoint covers
    async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic, checkpoint_dir=folder) as replica:
        await replica.wait_caught_up()
        assert lost_and_phantom(replica.index.facts(), reference(batches).facts()) == (0, 0)


async def _wait_committed(url, topic, group, ends, proc, timeout_s: float = 30.0) -> None:
    consumer = make_consumer(url, client_id="index-test-committed", group_id=group)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            committed = {p: (await consumer.committed(TopicPartition(topic, p))) or 0 for p in ends}
            if all(committed[p] >= ends[p] for p in ends):
                return
            assert time.monotonic() < deadline, f"Faust never committed {ends}: {committed}\n{proc.log_tail(20)}"
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()


async def test_a_replica_that_cannot_rebuild_says_so_and_counts_those_facts_uncertain(kafka_url, tmp_path):
    # Defect 8, second half: the checkpoint folder is older than what retention left of the log.
    r, batches = replay(limit=60)
    topic, _group, dead = names()
    await topics(kafka_url, topic, dead)
    half = len(batches) // 2
    await produce(kafka_url, topic, encoded(batches[:half]))
    first = await end_offsets(kafka_url, topic)
    await produce(kafka_url, topic, encoded(batches[half:]))
    ends = await end_offsets(kafka_url, topic)
    cut = max(range(PARTITIONS), key=lambda p: ends[p] - first[p])
    # Checkpoints in the index worker's format: the cut partition's at the half-way offset, the
    # others at the end of the log.
    folder = tmp_path / "ckpt"
    whole = reference(batches)
    early = reference(batches[:half])
    for p in range(PARTITIONS):
        index, offset = (early, first[p]) if p == cut else (whole, ends[p])
        pubs = sorted({b.publisher for b in batches if home(b.publisher) == p})
        _write_checkpoint(checkpoint_path(folder, topic, p), PartitionCheckpoint(topic, p, offset, index.checkpoint(pubs)))
    await _delete_before(kafka_url, topic, {cut: ends[cut]})  # retention removed what that checkpoint lacks
    async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic, checkpoint_dir=folder) as replica:
        await replica.wait_caught_up()
        assert replica.unrecoverable == {cut: [(first[cut], ends[cut])]}
        truth = whole.facts()
        for pub in sorted({b.publisher for b in batches}):
            status = replica.index.publisher_status(pub)
            lost = home(pub) == cut
            assert status.certain is not lost, (pub, status)
            if lost:
                assert "retention" in status.reason
            else:
                mine = {k: v for k, v in truth.items() if k[0] == pub}
                assert {k: v for k, v in replica.index.facts().items() if k[0] == pub} == mine
        scope = r.scope
        for request in r.requests[:30]:
            tokens = r.tokens(r.blocks_of(request))
            for m in replica.lookup_tokens(scope, tokens, 16).matches:
                assert m.certain is (home(m.publisher) != cut)


async def test_a_kill_during_a_checkpoint_write_leaves_no_temporary_file(kafka_url, tmp_path):
    # Defect 11: kill a writer while it writes a (large) checkpoint, then start the worker there.
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    folder = tmp_path / "index" / group
    script = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
              "from streams.index_worker import PartitionCheckpoint, _write_checkpoint, checkpoint_path; "
              "_write_checkpoint(checkpoint_path(Path(sys.argv[2]), sys.argv[3], 0), "
              "PartitionCheckpoint(sys.argv[3], 0, 1, bytes(200 << 20)))")
    leftovers: list = []
    for _attempt in range(3):
        writer = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(folder), topic])
        deadline = time.monotonic() + 30
        while writer.poll() is None and time.monotonic() < deadline:
            leftovers = [p for p in folder.glob("*") if not p.name.endswith(".ckpt")] if folder.exists() else []
            if leftovers:
                writer.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        writer.wait(10)
        if leftovers and writer.returncode == -signal.SIGKILL:
            break
    assert leftovers and all(p.exists() for p in leftovers), "the writer finished before it could be killed"
    _r, batches = replay(limit=20)
    proc = worker(kafka_url, tmp_path, topic, group, dead)
    try:
        await produce(kafka_url, topic, encoded(batches))
        best = await wait_checkpointed([tmp_path], topic, group, await end_offsets(kafka_url, topic), [proc])
    finally:
        proc.stop()
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".ckpt")) == []
    assert restored(best).facts() == reference(batches).facts()


@pytest.mark.slow
async def test_two_workers_one_killed_mid_stream_the_survivor_takes_its_partitions(kafka_url, tmp_path):
    # Scale-out under faults: the replicas and the survivor's checkpoints still equal the reference.
    r, batches = replay(limit=120, prefix=_prefix(lambda homes: set(homes) == set(range(PARTITIONS)), workers=8))
    topic, group, dead = names()
    await topics(kafka_url, topic, dead)
    dirs = [tmp_path / "w1", tmp_path / "w2"]
    procs = [worker(kafka_url, d, topic, group, dead) for d in dirs]
    try:
        third = len(batches) // 3
        await produce(kafka_url, topic, encoded(batches[:third]))
        deadline = time.monotonic() + 60
        while True:  # both members hold partitions (each checkpoints what it applied)
            held = [set(checkpoints([d], topic, group)) for d in dirs]
            if all(held) and len(held[0] | held[1]) == PARTITIONS:
                break
            assert time.monotonic() < deadline, f"the workers never split the partitions: {held}"
            for p in procs:
                assert p.alive(), p.log_tail(30)
            await asyncio.sleep(0.3)
        os.killpg(procs[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        await produce(kafka_url, topic, encoded(batches[third:]))
        ends = await end_offsets(kafka_url, topic)
        best = await wait_checkpointed([dirs[1]], topic, group, ends, [procs[1]], timeout_s=120)
        recovery_s = time.monotonic() - killed_at
    finally:
        for p in procs:
            p.stop()
    assert held[0] and set(best) == set(range(PARTITIONS)), "the survivor did not take every partition"
    one = reference(batches)
    truth = one.facts()
    survivor = restored(best)
    assert lost_and_phantom(survivor.facts(), truth) == (0, 0)
    async with IndexReplica(kafka_url, secret=SECRET.encode(), topic=topic) as replica:
        await replica.wait_caught_up()
        assert lost_and_phantom(replica.index.facts(), truth) == (0, 0)
        for request in r.requests[:40]:
            tokens = r.tokens(r.blocks_of(request))
            assert replica.lookup_tokens(r.scope, tokens, 16).matches == one.lookup_tokens(r.scope, tokens, 16).matches
    print(f"survivor took over {len(held[0])} partitions and caught up in {recovery_s:.1f}s")

