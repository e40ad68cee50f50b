"""Faust apps built by ``streams.faust_app.make_faust_app``: settings, and real workers on real brokers.

Start-up figures belong to ``benchmarks/bench_faust_startup.py``; the time limits here are
generous on purpose (a 2-core machine shared with a JVM broker).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import faust
import pytest
from faust.tables import TableManager

from nexuskv.config import BrokerUrl, parse_broker_url
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.topics import Topic
from streams.bus import tuning
from streams.bus.broker import TansuBroker
from streams.bus.clients import make_producer
from streams.bus.topics import ensure_topics
from streams.faust_app import faust_broker, make_faust_app

FIRST_EVENT_WITHIN_S = 15.0
URL = parse_broker_url("kafka://127.0.0.1:9")  # never contacted by the settings tests


# -- settings (no broker) ----------------------------------------------------------------------------

def test_app_takes_the_tuned_settings(tmp_path):
    app = make_faust_app("nexuskv-test", URL, data_dir=tmp_path)
    conf = app.conf
    assert conf.id == "nexuskv-test"
    assert [str(u) for u in conf.broker] == ["kafka://127.0.0.1:9"]
    assert conf.broker_session_timeout == tuning.SESSION_TIMEOUT_S
    assert conf.broker_heartbeat_interval == tuning.HEARTBEAT_INTERVAL_S
    assert conf.broker_rebalance_timeout == tuning.REBALANCE_TIMEOUT_S
    assert conf.consumer_auto_offset_reset == "earliest"
    assert conf.topic_partitions == tuning.TOPIC_PARTITIONS
    assert conf.processing_guarantee.value == "at_least_once"
    assert conf.store.scheme == "memory" and conf.value_serializer == "raw"
    assert conf.web_enabled is False and conf.autodiscover is False
    assert conf.TableManager is TableManager  # Faust's own: none of its internals is patched
    assert Path(conf.datadir) == tmp_path


def test_overrides_win_and_a_web_port_turns_the_web_server_on(tmp_path):
    app = make_faust_app("nexuskv-test", URL, data_dir=tmp_path, web_port=6199, topic_partitions=2,
                         value_serializer="json")
    assert app.conf.web_enabled is True and app.conf.web_port == 6199 and app.conf.web_bind == "127.0.0.1"
    assert app.conf.topic_partitions == 2 and app.conf.value_serializer == "json"
    assert tuning.FAUST["topic_partitions"] == tuning.TOPIC_PARTITIONS  # the shared dict is not mutated


def test_default_data_dir_is_not_the_working_directory():
    app = make_faust_app("nexuskv-test-datadir", URL)
    assert Path(app.conf.datadir).resolve().parent != Path.cwd().resolve()


def test_every_bootstrap_server_is_passed_to_faust():
    url = parse_broker_url("kafka://a:9092,b:9093")
    assert faust_broker(url) == ["kafka://a:9092", "kafka://b:9093"]


def test_faust_and_aiokafka_settings_agree():
    f, c, p = tuning.FAUST, tuning.CONSUMER, tuning.PRODUCER
    assert f["broker_session_timeout"] * 1000 == c["session_timeout_ms"]
    assert f["broker_heartbeat_interval"] * 1000 == c["heartbeat_interval_ms"]
    assert f["broker_rebalance_timeout"] * 1000 == c["rebalance_timeout_ms"]
    assert f["consumer_auto_offset_reset"] == c["auto_offset_reset"]
    assert f["consumer_max_fetch_size"] == c["max_partition_fetch_bytes"] >= p["max_request_size"]
    assert f["producer_linger"] * 1000 == p["linger_ms"]
    # Apache Kafka rejects sessions below group.min.session.timeout.ms (6 s by default).
    assert tuning.SESSION_TIMEOUT_S >= 6.0
    # Several heartbeats per session, and Faust refuses a session longer than its request timeout.
    assert tuning.HEARTBEAT_INTERVAL_S * 3 <= tuning.SESSION_TIMEOUT_S
    assert tuning.SESSION_TIMEOUT_S <= faust.App("x").conf.broker_request_timeout
    # Tansu rejects the idempotent producer that exactly-once needs.
    assert f["processing_guarantee"] == "at_least_once" and p["enable_idempotence"] is False


# -- real workers ------------------------------------------------------------------------------------

def _topic(name: str) -> Topic:
    return Topic(name, "test key", DeadLetter, "json", "Faust app test topic")


async def _produce(url: BrokerUrl, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(url, client_id="faust-app-test")
    await producer.start()
    try:
        for key, value in items:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


async def _first_event(url: BrokerUrl, data_dir: Path) -> tuple[bytes, float]:
    """Start a worker with one agent, produce one event, return it and seconds from start."""
    name = f"faust-app-test-{uuid.uuid4().hex[:8]}"
    await ensure_topics(url, partitions=2, topics=(_topic(name),))
    app = make_faust_app(name, url, data_dir=data_dir, topic_partitions=2)
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    @app.agent(app.topic(name, value_type=bytes))
    async def sink(stream):
        async for value in stream:
            if not got.done():
                got.set_result(value)

    started = time.monotonic()
    try:
        await asyncio.wait_for(app.start(), FIRST_EVENT_WITHIN_S)
        await _produce(url, name, [(b"k", b"hello")])
        value = await asyncio.wait_for(got, FIRST_EVENT_WITHIN_S)
        return value, time.monotonic() - started
    finally:
        await app.stop()


@pytest.mark.broker
async def test_worker_consumes_an_event_on_apache_kafka(kafka_url, tmp_path):
    value, _elapsed = await _first_event(kafka_url, tmp_path)
    assert value == b"hello"


@pytest.fixture(scope="module")
def tansu_url():
    with TansuBroker() as broker:
        yield broker.url


@pytest.mark.tansu
async def test_worker_consumes_an_event_on_tansu(tansu_url, tmp_path):
    value, _elapsed = await _first_event(tansu_url, tmp_path)
    assert value == b"hello"


@pytest.mark.broker
async def test_table_is_recovered_after_a_restart(kafka_url, tmp_path):
    """A table declared when the app is built registers and recovers from its changelog."""
    name = f"faust-app-table-{uuid.uuid4().hex[:8]}"
    await ensure_topics(kafka_url, partitions=2, topics=(_topic(name),))

    def build(data_dir: Path, *, write: bool) -> tuple[faust.App, faust.Table, list[bytes]]:
        app = make_faust_app(name, kafka_url, data_dir=data_dir, topic_partitions=2)
        # Table keys and values go through JSON whatever the app's value_serializer: use str, not bytes.
        table = app.Table("last", default=str)
        seen: list[bytes] = []

        @app.agent(app.topic(name, value_type=bytes))
        async def keep_last(stream):
            async for event in stream.events():
                seen.append(event.value)
                if write:
                    table[event.key.decode()] = event.value.decode()

        return app, table, seen

    first, _table, seen = build(tmp_path / "first", write=True)
    try:
        await asyncio.wait_for(first.start(), FIRST_EVENT_WITHIN_S)
        await _produce(kafka_url, name, [(b"a", b"1"), (b"b", b"1"), (b"a", b"2")])
        deadline = time.monotonic() + FIRST_EVENT_WITHIN_S
        while len(seen) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(seen) >= 3
    finally:
        await first.stop()

    # A fresh memory store: the table can only come back from its changelog. This worker's agent
    # does not write to the table, so re-delivered events cannot fake a recovery.
    second, table, _seen = build(tmp_path / "second", write=False)
    try:
        await asyncio.wait_for(second.start(), FIRST_EVENT_WITHIN_S)  # returns once recovery completed
        assert second.tables.recovery.completed.is_set()
        assert dict(table.items()) == {"a": "2", "b": "1"}
    finally:
        await second.stop()
