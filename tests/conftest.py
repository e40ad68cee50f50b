"""Shared fixtures.

``kafka_url`` is a real single-node Apache Kafka (KRaft) for the whole session, provisioned from
Maven Central by ``infra/kafka/pom.xml`` and started on first use, stopped at the end; set
``NEXUSKV_TEST_BROKER=kafka://host:port`` to use a broker that is already running instead.
Tests that need no broker never start one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from nexuskv.config import BrokerUrl, parse_broker_url


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[BrokerUrl]:
    override = os.environ.get("NEXUSKV_TEST_BROKER")
    if override:
        yield parse_broker_url(override, field="NEXUSKV_TEST_BROKER")
        return
    from streams.broker import ApacheKafkaBroker

    with ApacheKafkaBroker() as broker:
        yield broker.url
