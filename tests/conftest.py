"""Shared fixtures.

``kafka_url`` is a real single-node Apache Kafka (KRaft) for the whole session, provisioned from
Maven Central by ``infra/kafka/pom.xml`` and started on first use, stopped at the end; set
``NEXUSKV_TEST_BROKER=kafka://host:port`` to use a broker that is already running instead.
Tests that need no broker never start one. ``index_sidecar`` is the node's index sidecar on it
(:mod:`tests.sidecar`), started on first use, for the connectors' and engines' tests.
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
    from streams.bus.broker import ApacheKafkaBroker

    with ApacheKafkaBroker() as broker:
        yield broker.url


@pytest.fixture(scope="session")
def index_sidecar(kafka_url, tmp_path_factory):
    """``python -m streams.index_sidecar`` on the session's Kafka, ready; its env is ``.env``."""
    import asyncio

    from streams.bus.topics import ensure_topics

    from tests.sidecar import start_sidecar

    asyncio.run(ensure_topics(kafka_url, partitions=8))
    sidecar = start_sidecar(kafka_url, tmp_path_factory.mktemp("index-sidecar"))
    yield sidecar
    sidecar.stop()


@pytest.fixture(scope="session")
def remote_tier_store(tmp_path_factory):
    """The remote tier's store for the session: Mooncake Store (its master and a 256 MiB memory
    segment) started by ``python -m streams.remote_tier`` as ``nexuskv up`` starts it, from the
    binaries the install put on the machine; stopped at the end. Yields (address, supervisor)."""
    import sys
    import time

    from nexuskv.dataplane.remote import RemoteBackend
    from nexuskv.errors import TierUnavailableError
    from streams.bus.process import ManagedProcess
    from streams.remote_tier import local_address

    address = local_address()
    work = tmp_path_factory.mktemp("remote-tier")
    env = dict(os.environ, NEXUSKV_REMOTE_TIER_BYTES=str(256 << 20), NEXUSKV_DATA_DIR=str(work))
    proc = ManagedProcess([sys.executable, "-m", "streams.remote_tier", "--listen", address], name="remote-tier",
                          log_path=work / "remote-tier.log", env=env)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                RemoteBackend(address, timeout_s=2).close()
                break
            except TierUnavailableError:
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"remote tier did not start; log:\n{proc.log_tail()}") from None
                time.sleep(0.2)
        yield address, proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def remote_tier_address(remote_tier_store) -> str:
    """Address (``mooncake://...``) of the session's remote tier store."""
    return remote_tier_store[0]


@pytest.fixture
def remote_backend(remote_tier_address):
    """A client of the session's remote tier store, emptied before and after the test."""
    from nexuskv.dataplane.remote import RemoteBackend

    backend = RemoteBackend(remote_tier_address)
    backend.clear()
    yield backend
    backend.clear()
    backend.close()


def pytest_collection_modifyitems(session, config, items) -> None:
    """The soak runs last. Its ``nexuskv up`` calibrates the session Kafka's shared cost-model topic from
    the soak's synthetic timings (for Llama-3.1-8B on the H200 profile, what other tests price with the
    shipped profile), and a calibration, once published, is what every later reader of the topic uses."""
    soak = [item for item in items if "tests/benchmarks/test_soak.py" in item.nodeid]
    if soak:
        items[:] = [item for item in items if item not in soak] + soak
