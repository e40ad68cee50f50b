"""The supervisor of a service's tasks: the first failure stops the rest, is reported, and turns
into a non-zero exit status; liveness and readiness follow it."""

from __future__ import annotations

import asyncio

import pytest

from streams.bus.health import Health
from streams.supervisor import ServiceFailed, Supervisor, run_service


async def test_a_task_that_raises_stops_the_others_and_wait_says_which():
    health = Health()
    sup = Supervisor("svc", health=health)
    cancelled = asyncio.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def fails():
        await asyncio.sleep(0.01)
        raise RuntimeError("disk gone")

    sup.spawn(forever(), name="svc-follow")
    sup.spawn(fails(), name="svc-commit")
    assert health.alive()[0]
    with pytest.raises(ServiceFailed) as info:
        await asyncio.wait_for(sup.wait(), 5)
    assert info.value.task == "svc-commit" and "disk gone" in str(info.value)
    await asyncio.wait_for(cancelled.wait(), 5)
    assert not sup.alive and not health.alive()[0] and "disk gone" in health.alive()[1]
    assert not health.ready()[0]
    await sup.stop()


async def test_a_task_that_returns_is_a_failure_too_and_a_deliberate_stop_is_not():
    sup = Supervisor("svc", health=Health(), heartbeat=False)

    async def returns():
        return None

    sup.spawn(returns(), name="svc-serve")
    with pytest.raises(ServiceFailed, match="returned"):
        await asyncio.wait_for(sup.wait(), 5)
    calm = Supervisor("calm", health=Health())
    calm.spawn(asyncio.sleep(3600), name="calm-sleep")
    await calm.stop()
    assert calm.failure is None


def test_run_service_exits_1_when_a_supervised_task_fails_and_0_on_stop():
    async def failing(stop: asyncio.Event) -> None:
        sup = Supervisor("failing", health=Health())

        async def boom():
            raise ValueError("bad state")

        sup.spawn(boom(), name="failing-tick")
        try:
            await sup.until(stop)
        finally:
            await sup.stop()

    async def stopping(stop: asyncio.Event) -> None:
        stop.set()
        sup = Supervisor("stopping", health=Health())
        try:
            await sup.until(stop)
        finally:
            await sup.stop()

    assert run_service("failing", failing) == 1
    assert run_service("stopping", stopping) == 0


def test_readiness_waits_for_every_condition():
    health = Health()
    health.set_ready("partitions", False, "none assigned")
    health.set_ready("replica", True)
    assert health.ready() == (False, "partitions: none assigned")
    health.set_ready("partitions", True)
    assert health.ready() == (True, "ready")
