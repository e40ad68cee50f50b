"""A planner's or engine's cost-model replica on a real Apache Kafka: the last published fits are
applied before start() returns (the first request after a restart is priced), and a malformed
record is dead-lettered with its reason and changes no fit."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from nexuskv.contracts import decode, encode
from nexuskv.contracts.cost_models import ComputeFit, CostModelEntry
from nexuskv.contracts.topics import COST_MODELS, DEAD_LETTER
from nexuskv.errors import ContractError
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import make_consumer, make_producer
from streams.bus.cost_models import CostModelReplica
from streams.bus.metrics import METRICS
from streams.bus.topics import ensure_topics

PROFILE = "vllm-cpu"


def _entry(model: str, mean=(0.02, 3e-4, 1e-8), observations: int = 40, version: int = 3) -> CostModelEntry:
    cov = ((1e-6, 0.0, 0.0), (0.0, 1e-10, 0.0), (0.0, 0.0, 1e-18))
    return CostModelEntry(entry=ComputeFit(model=model, profile=PROFILE), mean=mean, cov=cov, residual_rel_std=0.05,
                          observations=observations, version=version, fitted_at=1.0, publisher="test-calibration",
                          method="weighted RLS")


async def _produce(url, records: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(url, client_id="replica-test")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(COST_MODELS.name, value, key=key)
    finally:
        await producer.stop()


async def _letters(url, service: str, count: int, timeout_s: float = 40.0):
    consumer = make_consumer(url, DEAD_LETTER, client_id="replica-test-reader",
                             group_id=f"replica-test-{uuid.uuid4().hex[:8]}", auto_offset_reset="earliest")
    await consumer.start()
    found = []
    try:
        async def scan():
            async for record in consumer:
                try:
                    letter = decode(DEAD_LETTER, record.value)
                except ContractError:
                    continue
                if letter.service == service:
                    found.append(letter)
                    if len(found) == count:
                        return found
        return await asyncio.wait_for(scan(), timeout_s)
    finally:
        await consumer.stop()


@pytest.mark.broker
async def test_a_restarted_replica_prices_with_the_last_fit_and_dead_letters_bad_records(kafka_url):
    await ensure_topics(kafka_url, partitions=2)
    model = f"test/replica-{uuid.uuid4().hex[:8]}"
    key = f"compute/{model}/{PROFILE}".encode()
    good = _entry(model)
    negative = json.loads(encode(COST_MODELS, _entry(model, version=4)))
    negative["mean"][0] = -1.0  # decodes as JSON, but a cost is never negative
    await _produce(kafka_url, [(key, encode(COST_MODELS, good)), (key, b"{not json"),
                               (key, json.dumps(negative).encode())])

    service = f"replica-test-{uuid.uuid4().hex[:6]}"
    base = shipped_cost_model()
    assert base.compute_for(model, PROFILE) is None  # cold: without the topic, nothing prices this model
    rejected_before = METRICS.events_rejected.labels(service, COST_MODELS.name)._value.get()
    replica = CostModelReplica(kafka_url, base, service=service)
    await replica.start(timeout_s=30.0)
    producer = make_producer(kafka_url, client_id=f"{service}-producer")
    await producer.start()
    task = asyncio.create_task(replica.run(producer))
    try:
        # Applied before start() returned, before any run(): the first request is priced.
        assert replica.caught_up
        fitted = replica.model.compute_for(model, PROFILE)
        assert fitted is not None and fitted.params.mean == good.mean and fitted.version == good.version
        assert fitted.observations == good.observations
        letters = await _letters(kafka_url, service, 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await producer.stop()
        await replica.stop()
    assert replica.rejected == 2
    assert METRICS.events_rejected.labels(service, COST_MODELS.name)._value.get() - rejected_before == 2
    assert {letter.source_topic for letter in letters} == {COST_MODELS.name}
    reasons = sorted(letter.reason for letter in letters)
    assert any("undecodable" in r for r in reasons), reasons
    assert any("parameter 0 is negative" in r for r in reasons), reasons
    assert {letter.payload for letter in letters} >= {b"{not json"}
    # Neither bad record changed the fit.
    assert replica.model.compute_for(model, PROFILE).params.mean == good.mean
