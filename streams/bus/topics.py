"""Topic bootstrap: create every NexusKV topic idempotently, list what exists.

Creation is idempotent (an existing topic is left as it is, with its partition count) and
retried while a freshly started broker is still electing its controller.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError

from nexuskv.config import BrokerUrl
from nexuskv.contracts.topics import TOPICS, Topic
from nexuskv.errors import BrokerError

__all__ = ["TopicState", "ensure_topics", "list_topics"]

log = logging.getLogger(__name__)

_ALREADY_EXISTS = 36
_RETRIABLE = {5, 7, 41}  # LEADER_NOT_AVAILABLE, REQUEST_TIMED_OUT, NOT_CONTROLLER


@dataclass(frozen=True, slots=True)
class TopicState:
    name: str
    partitions: int
    created: bool  # False when it already existed


async def _admin(url: BrokerUrl, timeout_s: float) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(bootstrap_servers=url.bootstrap_servers, client_id="nexuskv-admin",
                                request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
    except (KafkaConnectionError, KafkaError, asyncio.TimeoutError, OSError) as exc:
        await admin.close()
        raise BrokerError(f"cannot reach broker {url}: {type(exc).__name__}") from None
    return admin


async def ensure_topics(url: BrokerUrl, *, partitions: int, replication: int = 1,
                        topics: tuple[Topic, ...] = TOPICS, timeout_s: float = 30.0) -> list[TopicState]:
    """Create the topics that do not exist yet; returns the state of every requested topic."""
    admin = await _admin(url, timeout_s)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        created: set[str] = set()
        pending = list(topics)
        while pending:
            request = [NewTopic(t.name, partitions, replication, topic_configs=dict(t.config)) for t in pending]
            try:
                response = await admin.create_topics(request, timeout_ms=int(timeout_s * 1000))
            except (KafkaError, OSError) as exc:
                if loop.time() > deadline:
                    raise BrokerError(f"cannot create topics on {url}: {type(exc).__name__}: {exc}") from None
                await asyncio.sleep(0.5)
                continue
            retry = []
            for item in _topic_errors(response):
                name, code, message = item
                if code == 0:
                    created.add(name)
                elif code == _ALREADY_EXISTS:
                    pass
                elif code in _RETRIABLE and loop.time() < deadline:
                    retry.append(next(t for t in pending if t.name == name))
                else:
                    raise BrokerError(f"cannot create topic {name} on {url}: error {code} {message or ''}".strip())
            pending = retry
            if pending:
                await asyncio.sleep(0.5)
        existing = await _partition_counts(admin, [t.name for t in topics])
    finally:
        await admin.close()
    return [TopicState(t.name, existing.get(t.name, 0), t.name in created) for t in topics]


async def list_topics(url: BrokerUrl, *, timeout_s: float = 30.0) -> dict[str, int]:
    """Every topic on the broker with its partition count."""
    admin = await _admin(url, timeout_s)
    try:
        names = await admin.list_topics()
        return await _partition_counts(admin, sorted(names))
    finally:
        await admin.close()


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    if not names:
        return {}
    described = await admin.describe_topics(names)
    counts = {}
    for topic in described:
        name = topic.get("topic") if isinstance(topic, dict) else topic[1]
        parts = topic.get("partitions") if isinstance(topic, dict) else topic[3]
        error = topic.get("error_code", 0) if isinstance(topic, dict) else topic[0]
        if error == 0 and name:
            counts[name] = len(parts or [])
    return counts


def _topic_errors(response: object) -> list[tuple[str, int, str | None]]:
    items = getattr(response, "topic_errors", None)
    if items is None:
        items = getattr(response, "topic_error_codes", [])
    out = []
    for item in items:
        name, code = item[0], item[1]
        message = item[2] if len(item) > 2 else None
        out.append((name, int(code), message))
    return out
