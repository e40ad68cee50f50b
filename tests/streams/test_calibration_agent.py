"""The calibration agent on a real Apache Kafka: observations in, fitted entries out, state resumed."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from nexuskv.contracts import decode, encode
from nexuskv.contracts.cost_models import CostModelEntry
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation
from nexuskv.contracts.topics import COST_MODELS, DEAD_LETTER, OBSERVATIONS
from nexuskv.errors import ContractError
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus.clients import make_consumer, make_producer
from streams.bus.cost_models import read_cost_models
from streams.bus.topics import ensure_topics, list_topics
from streams.calibration_agent import SERVICE, CalibrationWorker, build_app

TRUTH = (0.015, 4e-5, 8e-10)
PROFILE = "h200x1-rdma4x200"


def _observations(model: str, n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        e = int(10 ** rng.uniform(1.0, 4.8))
        s = e + int(10 ** rng.uniform(0.0, 5.0))
        y = (TRUTH[0] + TRUTH[1] * e + TRUTH[2] * e * s) * (1 + rng.gauss(0, 0.02))
        rec = ObservationRecord(observed_at=1.0, observation=PrefillObservation(
            model=model, profile=PROFILE, worker="w-cal", uncached_tokens=e, context_tokens=s, duration_s=y))
        out.append(encode(OBSERVATIONS, rec))
    return out


async def _produce(url, key: bytes, values: list[bytes]) -> None:
    producer = make_producer(url, client_id="cal-test")
    await producer.start()
    try:
        await asyncio.gather(*[await producer.send(OBSERVATIONS.name, v, key=key) for v in values])
    finally:
        await producer.stop()


async def _wait_for(url, topic, predicate, timeout_s: float = 40.0):
    """The first record of ``topic`` (from the beginning) whose decoded value satisfies ``predicate``."""
    consumer = make_consumer(url, topic, client_id="cal-test-reader", group_id=f"cal-test-{uuid.uuid4().hex[:8]}")
    await consumer.start()
    try:
        async def scan():
            async for record in consumer:
                try:
                    value = decode(topic, record.value)
                except ContractError:
                    continue  # malformed records other tests put on the shared broker on purpose
                if predicate(value):
                    return value
        return await asyncio.wait_for(scan(), timeout_s)
    finally:
        await consumer.stop()


async def _start(url, name: str, tmp_path, partitions: int, resume=()):
    app, worker = build_app(url, base=shipped_cost_model(), policy=ExecutionPolicy(version="cal-test"),
                            min_observations=20, publish_s=0.2, forgetting=1.0, partitions=partitions, name=name,
                            data_dir=tmp_path / name, publisher=f"{name}-pub", resume=resume)
    await asyncio.wait_for(app.start(), 30)
    return app, worker


@pytest.mark.broker
async def test_agent_fits_publishes_dead_letters_and_resumes(kafka_url, tmp_path):
    await ensure_topics(kafka_url, partitions=2)
    partitions = (await list_topics(kafka_url))[OBSERVATIONS.name]
    model = f"test/cal-{uuid.uuid4().hex[:8]}"
    name = f"{SERVICE}-test-{uuid.uuid4().hex[:6]}"
    entry_key = f"compute/{model}/{PROFILE}"

    app, worker = await _start(kafka_url, name, tmp_path, partitions)
    try:
        await _produce(kafka_url, model.encode(), _observations(model, 600, seed=1) + [b"{not json"])
        fitted: CostModelEntry = await _wait_for(
            kafka_url, COST_MODELS, lambda v: v.key == entry_key and v.observations == 600)
        letter = await _wait_for(kafka_url, DEAD_LETTER,
                                 lambda v: v.service == name and v.source_topic == OBSERVATIONS.name)
    finally:
        await app.stop()
    for got, want in zip(fitted.mean, TRUTH):
        assert got == pytest.approx(want, rel=0.05)
    assert fitted.residual_rel_std == pytest.approx(0.02, rel=0.3) and fitted.publisher == f"{name}-pub"
    assert letter.payload == b"{not json" and "undecodable" in letter.reason and worker.rejected == 1

    # A restarted worker reads its last entries back and resumes: observations and versions go on.
    latest = await read_cost_models(kafka_url)
    assert latest[entry_key].observations == 600
    app2, worker2 = await _start(kafka_url, name, tmp_path / "again", partitions, resume=latest.values())
    try:
        await _produce(kafka_url, model.encode(), _observations(model, 100, seed=2))
        resumed: CostModelEntry = await _wait_for(
            kafka_url, COST_MODELS, lambda v: v.key == entry_key and v.observations >= 700)
    finally:
        await app2.stop()
    assert resumed.version > fitted.version and resumed.observations == 700
    assert resumed.mean[1] == pytest.approx(TRUTH[1], rel=0.05)


def test_worker_publishes_an_entry_once_it_has_enough_new_observations_per_interval():
    from nexuskv.calibration import Calibrator

    now = [100.0]
    worker = CalibrationWorker(Calibrator(shipped_cost_model(), default_profile=PROFILE), min_observations=20,
                               publish_s=1.0, publisher="p", clock=lambda: now[0])
    raws = _observations("test/cadence", 40, seed=3)
    for raw in raws[:19]:
        worker.fold(worker.decode(raw))
    assert worker.due() == []  # not enough observations yet
    worker.fold(worker.decode(raws[19]))
    (key,) = worker.due()
    assert worker.publish(key).version == 1 and worker.due() == []  # nothing new
    worker.fold(worker.decode(raws[20]))
    assert worker.due() == []  # new, but the interval has not passed
    now[0] += 1.0
    assert worker.due() == [key] and worker.publish(key).observations == 21
    with pytest.raises(Exception, match="undecodable"):
        worker.decode(b"\x00garbage")
