"""The transfer service on a real bus: commands in, honest results and timings out.

* Faults (Apache Kafka, ``kafka_url``): a payload with one flipped byte, a command past its
  deadline and a destination without room are each reported as such on
  ``nexuskv.transfer-results``, leave nothing behind, and the request recomputes; a good command
  completes; an undecodable one is dead-lettered; another worker's command is left alone.
* Integration (embedded Tansu): commands move a runtime's saved state disk -> host -> device
  stand-in; results, transfer observations, the runtime's kv-events and prefill observations
  appear on their topics; the state restored from the device tier computes the same logits.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest
import torch

from nexuskv.config import BrokerUrl
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.keyed_events import KeyedBatch, KeyedStored, TierStored
from nexuskv.contracts.kv_events import BlockStored, KvEventBatch
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation, TransferObservation
from nexuskv.contracts.topics import DEAD_LETTER, KV_EVENTS, OBSERVATIONS, TRANSFER_RESULTS, TRANSFERS, Topic
from nexuskv.contracts.transfers import TransferCommand, TransferResult, TransferStatus
from nexuskv.dataplane import (
    BackendCatalog,
    DescriptorRegistry,
    DeviceMemoryBackend,
    DiskBackend,
    HostMemoryBackend,
    TransferExecutor,
)
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ContractError
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, TinyModel
from streams.bus.broker import TansuBroker
from streams.bus.clients import decode_record, make_consumer, make_producer, send
from streams.bus.runtime_publisher import BusPublisher
from streams.bus.topics import ensure_topics
from streams.transfer_executor import TransferService

SPEC = ReferenceModelSpec.gqa()
MODEL = TinyModel(SPEC)
PROMPT = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(9)).tolist()
PAGE = 768 * SPEC.block_size  # bytes of one block of this model
TIMEOUT_S = 60


def _command(tag: str, rt: ReferenceEngine, blocks: range, src: Tier, dst: Tier, worker: str, *,
             deadline_in: float = 30.0) -> TransferCommand:
    keys = tuple(rt.block_keys(PROMPT)[i] for i in blocks)
    now = time.time()
    return TransferCommand(transfer_id=f"t-{tag}", request_id=f"r-{tag}", descriptor_id=rt.describe().descriptor_id,
                           tenant_namespace="default", keys=keys, source=EntryLocation(worker=worker, tier=src),
                           destination=EntryLocation(worker=worker, tier=dst), bytes=len(keys) * PAGE,
                           issued_at=now, deadline_at=now + deadline_in)


async def _collect(url: BrokerUrl, topic: Topic, keep: Callable[[object], bool], count: int) -> list:
    """The first ``count`` records of ``topic`` (from the beginning) that ``keep`` accepts."""
    consumer = make_consumer(url, topic, client_id=f"test-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    found: list = []
    try:
        async def scan() -> None:
            async for record in consumer:
                try:
                    value = decode_record(topic, record)
                except ContractError:
                    continue  # other tests on the shared broker put malformed records here on purpose
                if keep(value):
                    found.append(value)
                    if len(found) >= count:
                        return
        await asyncio.wait_for(scan(), TIMEOUT_S)
    finally:
        await consumer.stop()
    return found


async def _start(url: BrokerUrl, catalog: BackendCatalog) -> tuple[TransferService, asyncio.Event, asyncio.Task]:
    service = TransferService(url, TransferExecutor(catalog), worker=catalog.worker,
                              group_id=f"test-executor-{uuid.uuid4().hex[:8]}")
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), TIMEOUT_S)
    return service, stop, task


@pytest.mark.broker
async def test_faults_are_reported_as_such_and_the_request_recomputes(kafka_url, tmp_path):
    await ensure_topics(kafka_url, partitions=2)
    worker, tag = f"w-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:6]
    registry = DescriptorRegistry()
    writer = ReferenceEngine(SPEC, model=MODEL, registry=registry)
    reference = writer.prefill(PROMPT, reuse=False).logits
    disk, host, device = DiskBackend(tmp_path, 1 << 22), HostMemoryBackend(1 << 22), DeviceMemoryBackend(2 * PAGE)
    assert writer.save(PROMPT, disk).blocks == 5
    path = disk.path(writer.payload_key(writer.block_keys(PROMPT)[2]))
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x01  # one flipped bit in block 2's payload on disk
    path.write_bytes(bytes(raw))

    service, stop, task = await _start(kafka_url, BackendCatalog(worker, [disk, host, device]))
    commands = {
        "corrupt": _command(f"{tag}-corrupt", writer, range(5), Tier.DISK, Tier.HOST, worker),
        "late": _command(f"{tag}-late", writer, range(1), Tier.DISK, Tier.GPU, worker, deadline_in=-1.0),
        "full": _command(f"{tag}-full", writer, range(5), Tier.DISK, Tier.GPU, worker),
        "good": _command(f"{tag}-good", writer, range(2), Tier.DISK, Tier.HOST, worker),
    }
    other = _command(f"{tag}-other", writer, range(1), Tier.DISK, Tier.HOST, worker).model_copy(
        update={"destination": EntryLocation(worker="someone-else", tier=Tier.HOST)})
    producer = make_producer(kafka_url, client_id="test-commands")
    await producer.start()
    try:
        for cmd in (*commands.values(), other):
            await send(producer, TRANSFERS, cmd.destination.worker, cmd)
        await producer.send_and_wait(TRANSFERS.name, b"\x93not a command", key=f"garbage-{tag}".encode())
        ours = {c.request_id for c in commands.values()} | {other.request_id}
        results = await _collect(kafka_url, TRANSFER_RESULTS,
                                 lambda r: isinstance(r, TransferResult) and r.request_id in ours, len(commands))
        letters = await _collect(kafka_url, DEAD_LETTER,
                                 lambda d: isinstance(d, DeadLetter) and d.key == f"garbage-{tag}".encode(), 1)
        observations = await _collect(
            kafka_url, OBSERVATIONS,
            lambda o: isinstance(o.observation, TransferObservation) and o.observation.worker == worker, 2)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, TIMEOUT_S)

    by_tag = {r.request_id.rsplit("-", 1)[-1]: r for r in results}
    assert other.request_id not in {r.request_id for r in results}  # not this worker's command
    assert by_tag["corrupt"].status is TransferStatus.INTEGRITY_ERROR and "checksum" in by_tag["corrupt"].error
    assert by_tag["late"].status is TransferStatus.DEADLINE_EXCEEDED and "deadline" in by_tag["late"].error
    assert by_tag["full"].status is TransferStatus.REJECTED_CAPACITY and "free" in by_tag["full"].error
    assert by_tag["good"].status is TransferStatus.COMPLETED and by_tag["good"].bytes_moved == 2 * PAGE
    assert all(r.bytes_moved == 0 for t, r in by_tag.items() if t != "good")
    assert "undecodable" in letters[0].reason and letters[0].service == "transfer-executor"
    assert {o.observation.ok for o in observations} == {True, False}
    assert service.handled == 4

    # nothing a failed transfer touched is left behind, and the requests recompute
    assert device.keys() == []
    assert sorted(k.key for k in host.keys()) == sorted(writer.block_keys(PROMPT)[:2])
    for tier, reused in ((host, 8), (device, 0)):
        reader = ReferenceEngine(SPEC, model=MODEL, registry=registry)
        reader.load(PROMPT, tier)
        result = reader.prefill(PROMPT)
        assert result.reused_tokens == reused
        assert (result.logits - reference).abs().max().item() <= 1e-5


@pytest.mark.tansu
async def test_disk_host_device_through_the_embedded_broker(tmp_path):
    with TansuBroker() as broker:
        url = broker.url
        await ensure_topics(url, partitions=2)
        worker = f"w-{uuid.uuid4().hex[:8]}"
        producer = make_producer(url, client_id="test-runtime")
        await producer.start()
        try:
            registry = DescriptorRegistry()
            bus = BusPublisher(producer)
            writer = ReferenceEngine(SPEC, model=MODEL, registry=registry, publisher=bus, worker=worker)
            reference = writer.prefill(PROMPT).logits
            disk, host, device = DiskBackend(tmp_path, 1 << 22), HostMemoryBackend(1 << 22), DeviceMemoryBackend(1 << 22)
            assert writer.save(PROMPT, disk).blocks == 5
            await bus.flush()
            service, stop, task = await _start(url, BackendCatalog(worker, [disk, host, device]))
            try:
                results = []
                for hop, (src, dst) in enumerate([(Tier.DISK, Tier.HOST), (Tier.HOST, Tier.GPU)]):
                    cmd = _command(f"hop{hop}", writer, range(5), src, dst, worker)
                    await send(producer, TRANSFERS, worker, cmd)
                    results += await _collect(url, TRANSFER_RESULTS,
                                              lambda r, rid=cmd.request_id: r.request_id == rid, 1)
            finally:
                stop.set()
                await asyncio.wait_for(task, TIMEOUT_S)
            observations = await _collect(url, OBSERVATIONS, lambda o: isinstance(o, ObservationRecord), 3)
            batches = await _collect(url, KV_EVENTS, lambda b: isinstance(b, (KvEventBatch, KeyedBatch)), 2)
        finally:
            await producer.stop()

    assert [r.status for r in results] == [TransferStatus.COMPLETED] * 2
    assert all(r.device == "cpu" and r.bytes_moved == 5 * PAGE for r in results)
    links = {o.observation.link for o in observations if isinstance(o.observation, TransferObservation)}
    assert links == {"disk->host", "host->gpu"}
    assert any(isinstance(o.observation, PrefillObservation) for o in observations)
    assert batches[0].publisher == f"nexuskv-reference/{worker}"
    stored = [e for b in batches for e in b.events if isinstance(e, (BlockStored, KeyedStored, TierStored))]
    assert isinstance(stored[0], KeyedStored) and len(stored[0]) == 5 and stored[0].token_ids is None  # keyed, no tokens
    assert stored[1].tier is Tier.DISK
    assert device.capabilities.stand_in and len(device.keys()) == 5
    reader = ReferenceEngine(SPEC, model=MODEL, registry=registry)
    assert reader.load(PROMPT, device).blocks == 5
    result = reader.prefill(PROMPT)
    assert result.reused_tokens == 20 and (result.logits - reference).abs().max().item() <= 1e-5
