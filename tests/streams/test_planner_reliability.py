"""The planner service on a real Apache Kafka when things go wrong: a hostile policy file does not
stop its reload loop, and a task that fails stops the service instead of leaving it half alive."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from nexuskv.planner.core import NullIndexView
from nexuskv.policy import POLICY_END_MARKER
from streams.bus.clients import make_consumer
from streams.bus.topics import ensure_topics
from streams.planner_service import PlannerService
from streams.supervisor import ServiceFailed

pytestmark = pytest.mark.broker
EXAMPLE = Path(__file__).resolve().parents[2] / "infra" / "policy" / "default.toml"


def _replace(path: Path, data: bytes) -> None:
    before = path.stat().st_mtime_ns if path.exists() else 0
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(before + 1_000_000_000, before + 1_000_000_000))
    os.replace(tmp, path)


async def _group_at_end(url, group: str) -> None:
    consumer = make_consumer(url, client_id="planner-test-offsets", group_id=group)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001 - aiokafka has no public refresh
        tps = [TopicPartition(n, p) for n in ("nexuskv.plan-requests", "nexuskv.transfer-results")
               for p in sorted(consumer.partitions_for_topic(n) or ())]
        consumer.assign(tps)
        await consumer.commit(dict(await consumer.end_offsets(tps)))
    finally:
        await consumer.stop()


async def _service(kafka_url, **kw) -> PlannerService:
    await ensure_topics(kafka_url, partitions=4)
    group = f"planner-reliability-{uuid.uuid4().hex[:6]}"
    await _group_at_end(kafka_url, group)
    service = PlannerService(kafka_url, NullIndexView(), group_id=group, **kw)
    await service.start()
    return service


async def test_policy_reload_survives_a_file_nested_too_deeply_and_one_cut_short(kafka_url, tmp_path):
    # Defect 3: the hot-reload loop (the planner's ticker, which also handles transfer deadlines).
    path = tmp_path / "policy.toml"
    _replace(path, EXAMPLE.read_bytes())
    service = await _service(kafka_url, policy_file=path, policy_reload_s=0.05, tick_s=0.01)
    try:
        marker = b"\n" + POLICY_END_MARKER.encode() + b"\n"
        full = EXAMPLE.read_bytes().replace(b'version = "default-2026-11"', b'version = "after-the-attack"')
        hostile = [b"x = " + b"[" * 50_000 + b"]" * 50_000 + marker,  # RecursionError in the TOML parser
                   full[: full.index(b"[budgets]")]]  # cut short: parses, with budgets and planner at defaults
        for data in hostile:
            _replace(path, data)
            await asyncio.sleep(0.4)
            assert service.policy.version == "default-2026-11" and service.alive
        _replace(path, full)
        deadline = time.monotonic() + 10
        while service.policy.version != "after-the-attack":
            assert time.monotonic() < deadline, "the policy reload loop stopped"
            await asyncio.sleep(0.05)
        assert service.alive and service.policy.budgets.max_transfers_in_flight == 64
    finally:
        await service.stop()


async def test_a_planner_task_that_fails_stops_the_service_and_says_which(kafka_url):
    # Supervision: the serve task's consumer fails for good (fault injected into the real client).
    service = await _service(kafka_url)
    try:
        async def broken(*_a, **_k):
            raise RuntimeError("the group coordinator is gone for good")

        service._consumer.getmany = broken  # noqa: SLF001 - fault injection
        with pytest.raises(ServiceFailed) as info:
            await asyncio.wait_for(service.wait(), 10)
        assert "serve" in info.value.task and "coordinator" in str(info.value)
        assert not service.alive
    finally:
        await service.stop()
