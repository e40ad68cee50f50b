"""Shared fixtures.

``kafka_url`` is a real single-node Apache Kafka (KRaft) for the whole session, provisioned from
Maven Central by ``infra/kafka/pom.xml`` and started on first use, stopped at the end; set
``NEXUSKV_TEST_BROKER=kafka://host:port`` to use a broker that is already running instead.
Tests that need no broker never start one. ``index_sidecar`` is the node's index sidecar on it
(:mod:`tests.sidecar`), started on first use, for the connectors' and engines' tests.
``jaeger`` is a real Jaeger (see its docstring), built in the background from collection on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

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


_JAEGER_BUILD: Future[Path] | None = None
_JAEGER_CANCEL = threading.Event()


def _start_jaeger_build() -> Future[Path]:
    """``provision_jaeger`` in a daemon thread under ``nice`` (a cold build takes minutes; the tests
    keep the CPU); cancelled, with its compilers, when the session ends first."""
    global _JAEGER_BUILD
    if _JAEGER_BUILD is None:
        from streams.app.jaeger import provision_jaeger

        future: Future[Path] = Future()

        def build() -> None:
            try:
                future.set_result(provision_jaeger(niceness=10, cancel=_JAEGER_CANCEL))
            except BaseException as exc:  # noqa: BLE001 - handed to the fixture, which raises it
                future.set_exception(exc)

        threading.Thread(target=build, name="jaeger-build", daemon=True).start()
        _JAEGER_BUILD = future
    return _JAEGER_BUILD


@pytest.fixture(scope="session")
def jaeger_binary() -> Path:
    """The Jaeger binary built by :func:`streams.app.jaeger.provision_jaeger` (cached under
    ``~/.cache/nexuskv/jaeger/``), from the build that collection started in the background."""
    return _start_jaeger_build().result()


@pytest.fixture(scope="session")
def jaeger(request):
    """A real Jaeger (v2, memory storage) for the session, as :class:`streams.app.jaeger.JaegerEndpoints`:
    ``otlp_http_url`` for ``NEXUSKV_OTLP_ENDPOINT``, ``query_url`` and ``traces(service)``. Built with Go
    on first use (minutes cold; collection starts the build when a test needs it) and started on free
    loopback ports; stopped at the end. Set ``NEXUSKV_TEST_JAEGER=http://host:4318,http://host:16686``
    (its OTLP/HTTP base URL, then its query URL) to use a Jaeger that is already running instead."""
    from streams.app.jaeger import JaegerEndpoints, JaegerServer

    override = os.environ.get("NEXUSKV_TEST_JAEGER")
    if override:
        yield JaegerEndpoints.parse(override, field="NEXUSKV_TEST_JAEGER")
        return
    with JaegerServer(binary=request.getfixturevalue("jaeger_binary")) as server:
        yield server.endpoints


def _needs_jaeger_build(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    return "jaeger_binary" in names or ("jaeger" in names and not os.environ.get("NEXUSKV_TEST_JAEGER"))


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: a build only for tests that will run
def pytest_collection_modifyitems(session, config, items) -> None:
    """The soak runs last. Its ``nexuskv up`` calibrates the session Kafka's shared cost-model topic from
    the soak's synthetic timings (for Llama-3.1-8B on the H200 profile, what other tests price with the
    shipped profile), and a calibration, once published, is what every later reader of the topic uses.

    Tests that need Jaeger's binary run just before it, and its build starts now, in the background:
    a cold build takes minutes, which the rest of the session overlaps."""
    soak = [item for item in items if "tests/benchmarks/test_soak.py" in item.nodeid]
    if soak:
        items[:] = [item for item in items if item not in soak] + soak
    jaeger = [item for item in items if _needs_jaeger_build(item) and item not in soak]
    if jaeger:
        items[:] = [item for item in items if item not in jaeger and item not in soak] + jaeger + soak
        _start_jaeger_build()


def pytest_sessionfinish(session, exitstatus) -> None:
    """A Jaeger build still running when the session ends (a failure under ``-x``, Ctrl-C) stops with it."""
    _JAEGER_CANCEL.set()
