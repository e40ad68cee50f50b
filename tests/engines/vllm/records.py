"""Reading what the connector published: every record of a topic, and its decisions and loads by request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from nexuskv.config import BrokerUrl
from nexuskv.contract import Contract
from nexuskv.contracts import codec
from nexuskv.contracts.topics import Topic
from nexuskv.errors import ContractError

__all__ = ["read_topic", "wait_for"]


async def _read(url: BrokerUrl, topic: Topic, idle_ms: int) -> list[Contract]:
    from streams.bus.clients import make_consumer

    consumer = make_consumer(url, topic, client_id=f"vllm-test-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    out: list[Contract] = []
    try:
        for _ in range(200):
            if consumer.assignment():
                break
            await asyncio.sleep(0.05)
        await consumer.seek_to_beginning()
        while True:
            batches = await consumer.getmany(timeout_ms=idle_ms)
            if not batches:
                return out
            for records in batches.values():
                for r in records:
                    try:
                        out.append(codec.decode(topic, r.value))
                    except ContractError:
                        continue  # other tests put malformed records on the shared topics on purpose
    finally:
        await consumer.stop()


def read_topic(url: BrokerUrl, topic: Topic, *, idle_ms: int = 1500) -> list[Contract]:
    """Every record on ``topic`` from the beginning that decodes (until ``idle_ms`` pass without one)."""
    return asyncio.run(_read(url, topic, idle_ms))


def wait_for(what: Callable[[], object], *, timeout_s: float = 20.0, step_s: float = 0.25, message: str = "") -> object:
    """Poll ``what`` until it returns something truthy (its value), or fail after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message or "condition not met in time")
        time.sleep(step_s)
