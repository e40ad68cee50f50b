"""One request, one trace: client, planner (with its index match), transfer executor and decision
sink continue the same trace through Kafka headers; the decision's numbers are span attributes."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from analytics.store import DecisionStore
from nexuskv.contracts.kv_events import BlockStored, KvEventBatch, PublisherIdentity
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.topics import PLAN_REQUESTS
from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.executor import TransferExecutor
from nexuskv.dataplane.memory import DeviceMemoryBackend, HostMemoryBackend
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.index import GlobalIndex
from nexuskv.models import known_model
from nexuskv.policy import ExecutionPolicy
from streams.bus.clients import make_producer, send
from streams.bus.topics import ensure_topics
from streams.bus.tracing import tracer
from streams.planner_service import PlannerService
from streams.sink import DecisionSink
from streams.telemetry import install_tracer_provider
from streams.transfer_executor import TransferService

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        install_tracer_provider(provider)
    else:  # another module installed the provider first: add our exporter to it
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(EXPORTER))
    EXPORTER.clear()
    return EXPORTER


def _index_with_remote_copy(tag: str, tokens: list[int]) -> tuple[GlobalIndex, IdentityScope]:
    """w2's host memory holds the whole prompt (as its engine announced); w1 holds nothing."""
    d = known_model("meta-llama/Llama-3.1-8B")
    identity = PublisherIdentity(tenant_namespace=d.tenant_namespace, model=d.model, model_revision=d.model_revision,
                                 tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id)
    blocks = len(tokens) // d.block_size
    index = GlobalIndex()
    index.apply(KvEventBatch(publisher=f"w2-{tag}", incarnation=1, seq=0, ts=time.time(), identity=identity,
                             events=(BlockStored(engine_hashes=tuple(range(1, blocks + 1)), token_ids=tuple(tokens),
                                                 block_size=d.block_size, tier="host"),)))
    return index, IdentityScope.of(d)


@pytest.mark.broker
async def test_one_trace_across_planner_executor_and_sink(kafka_url, spans, tmp_path):
    await ensure_topics(kafka_url, partitions=8)
    tag = uuid.uuid4().hex[:8]
    tokens = [(i * 37) % 50_000 for i in range(32 * 1024)]
    index, scope = _index_with_remote_copy(tag, tokens)
    w1, w2 = f"w1-{tag}", f"w2-{tag}"
    keys = BlockKeyer(scope, 16).keys(tokens)

    planner = PlannerService(kafka_url, index, policy=ExecutionPolicy(version="trace-test"), group_id=f"p-{tag}")
    executor = TransferService(kafka_url, TransferExecutor(BackendCatalog(w1, [
        HostMemoryBackend(64 << 20), DeviceMemoryBackend(64 << 20)])), worker=w1, group_id=f"x-{tag}")
    store = DecisionStore(tmp_path / "d.duckdb")
    sink = DecisionSink(kafka_url, store, group_id=f"s-{tag}", flush_interval_s=0.2)
    stop = asyncio.Event()
    await planner.start()
    tasks = [asyncio.create_task(executor.run(stop)), asyncio.create_task(sink.run(stop))]
    try:
        await asyncio.wait_for(executor.ready.wait(), 30)
        request = PlanRequest(request_id=f"r-{tag}", scope=scope, block_size=16, prompt_tokens=len(tokens),
                              keys=tuple(keys), arrival_at=time.time(), workload="trace-test",
                              candidates=(WorkerLoad(worker=w1),
                                          WorkerLoad(worker=w2, queued_prefill_tokens=400_000)))
        producer = make_producer(kafka_url, client_id="trace-client")
        await producer.start()
        try:
            with tracer("router").start_as_current_span("client.request",
                                                        attributes={"nexuskv.service": "router"}) as root:
                await send(producer, PLAN_REQUESTS, request.request_id, request)
            trace_id = root.get_span_context().trace_id
        finally:
            await producer.stop()
        rid = request.request_id
        for _ in range(300):
            done = store.query(f"SELECT (SELECT count(*) FROM decisions WHERE request_id = '{rid}'), "
                               f"(SELECT count(*) FROM transfer_results WHERE request_id = '{rid}')")[0]
            if done == (2, 1):
                break
            await asyncio.sleep(0.1)
        # The plan moves the prompt from w2's host memory to idle w1; w1's executor cannot reach w2's
        # memory (this test gives it only its own tiers), reports the failure, and the planner
        # supersedes its plan with a recompute: revision 1.
        assert done == (2, 1), "both revisions and the transfer outcome should reach the store"
        rows = store.query(f"SELECT revision, action, source_worker FROM decisions WHERE request_id = '{rid}' "
                           "ORDER BY revision")
        assert rows == [(0, "transfer", w2), (1, "recompute", None)]
        status = store.query(f"SELECT status FROM transfer_results WHERE request_id = '{rid}'")[0][0]
        assert status != "completed"
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await planner.stop()
        store.close()

    mine = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    names = {s.name for s in mine}
    assert {"client.request", "planner.decide", "index.match", "transfer.execute", "planner.transfer_result",
            "record.decisions", "record.transfer-results"} <= names, names
    services = {s.attributes.get("nexuskv.service") for s in mine}
    assert {"router", "nexuskv-planner", "index-replica", "transfer-executor", "decision-sink"} <= services, services
    decide = next(s for s in mine if s.name == "planner.decide" and s.attributes.get("nexuskv.action") == "transfer")
    assert decide.attributes["nexuskv.action"] == "transfer"
    assert decide.attributes["nexuskv.eg_s"] > 0 and decide.attributes["nexuskv.t_compute_s"] > 0
    assert "nexuskv.transfer_s" in decide.attributes and "nexuskv.reason" in decide.attributes
    match = next(s for s in mine if s.name == "index.match")
    assert match.attributes["nexuskv.best_prefix_blocks"] == len(keys) and match.parent.span_id == decide.context.span_id
