"""The planner service through the embedded broker: the same records as the pure planner.

Plan requests go through Tansu to a PlannerService whose IndexView is built here from real
identity keys; the decisions, placement hints and transfer commands that come back must equal
what :func:`nexuskv.planner.plan` gives on the same inputs (same index, cost model, policy, clock,
and budgets replayed in the same order). Bad input lands on the dead-letter topic. Then transfer
results and the clock drive the prefetch state machine over the bus.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from nexuskv.contracts import decode, encode
from nexuskv.contracts.decisions import Action, Decision
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.topics import DEAD_LETTER, DECISIONS, PLACEMENT, PLAN_REQUESTS, TRANSFER_RESULTS, TRANSFERS
from nexuskv.contracts.transfers import TransferCommand, TransferResult
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import DescriptorRegistry, known_model
from nexuskv.planner import PlanQuery, plan
from nexuskv.planner.core import plan_records
from nexuskv.planner.dispatch import DispatchDelays
from nexuskv.planner.prefetch import PrefetchScheduler
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from streams.bus.broker import TansuBroker
from streams.bus.clients import make_consumer, make_producer
from streams.bus.topics import ensure_topics
from streams.planner_service import PlannerService

from tests.factories import descriptor as tiny_descriptor
from tests.planning import NOW, KeyIndex

SECRET = b"planner-test-secret"
LLAMA = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme")
SCOPE = IdentityScope.of(LLAMA)
X1 = "h200x1-rdma4x200"


def _tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def _keys(n: int, seed: int) -> tuple[int, ...]:
    return tuple(BlockKeyer(SCOPE, 16, SECRET).keys(_tokens(n, seed)))


def _w(name: str, **load) -> WorkerLoad:
    return WorkerLoad(worker=name, profile=X1, **load)


def _scenario():
    """The index and the requests: reuse, route, transfer, prefetch, miss, token ids, inline descriptor."""
    index = KeyIndex()
    k_full, k_far, k_pre, k_tok = _keys(8192, 1), _keys(32768, 2), _keys(8192, 3), _keys(4096, 5)
    index.store(SCOPE, "w-a", Tier.GPU, k_full)
    index.store(SCOPE, "w-far", Tier.GPU, k_far)
    index.store(SCOPE, "w-b", Tier.HOST, k_pre)
    index.store(SCOPE, "w-a", Tier.GPU, k_tok)
    tiny = tiny_descriptor(tenant_namespace="acme")
    requests = [
        PlanRequest(request_id="r-full", scope=SCOPE, block_size=16, prompt_tokens=8192, keys=k_full, arrival_at=NOW,
                    candidates=(_w("w-a"), _w("w-b"))),
        PlanRequest(request_id="r-far", scope=SCOPE, block_size=16, prompt_tokens=32768, keys=k_far, arrival_at=NOW,
                    candidates=(_w("w-a"),), slo_ttft_s=2.0),
        PlanRequest(request_id="r-pre", scope=SCOPE, block_size=16, prompt_tokens=8192, keys=k_pre, arrival_at=NOW,
                    candidates=(_w("w-b", queued_prefill_tokens=50_000),)),
        PlanRequest(request_id="r-miss", scope=SCOPE, block_size=16, prompt_tokens=4096, keys=_keys(4096, 4),
                    arrival_at=NOW, candidates=(_w("w-a"), _w("w-b", decode_blocks=9000))),
        PlanRequest(request_id="r-chat", scope=SCOPE, block_size=16, prompt_tokens=4096,
                    keys=tuple(BlockKeyer(SCOPE, 16, SECRET).keys(_tokens(4096, 5))), arrival_at=NOW,
                    candidates=(_w("w-a"),), workload="chat"),
        PlanRequest(request_id="r-inline", scope=IdentityScope.of(tiny), block_size=4, prompt_tokens=64,
                    keys=tuple(BlockKeyer(IdentityScope.of(tiny), 4, SECRET).keys(range(64))), arrival_at=NOW,
                    candidates=(_w("w-a"),), descriptor=tiny),
    ]
    return index, requests


def _expected(index, requests, model, policy):
    """What the pure planner says on the same inputs, replaying budgets in the same order."""
    registry = DescriptorRegistry.with_known_models()
    mirror = PrefetchScheduler(policy)
    records = []
    for req in requests:
        d = registry.resolve(req.scope.descriptor_id, req.descriptor)
        q = PlanQuery.from_request(req, d)
        p = plan(q, index.lookup(q.scope, q.keys), model, policy, now=NOW,
                 headroom=mirror.headroom(q.scope.tenant_namespace))
        mirror.track(p, now=NOW)
        records.extend(plan_records(p))
    return records


@pytest.fixture(scope="module")
def tansu_url():
    with TansuBroker() as broker:
        yield broker.url


class Collector:
    """Reads the output topics from the beginning into dicts keyed by record id."""

    def __init__(self, url):
        self.url = url
        self.decisions: dict[tuple[str, int], Decision] = {}
        self.hints: dict[str, PlacementHint] = {}
        self.transfers: dict[str, TransferCommand] = {}
        self.dead: list = []

    async def until(self, done, timeout_s: float = 30.0) -> None:
        consumer = make_consumer(self.url, DECISIONS, PLACEMENT, TRANSFERS, DEAD_LETTER, client_id="collector",
                                 group_id=f"collector-{uuid.uuid4().hex[:8]}", fetch_max_wait_ms=10)
        await consumer.start()
        try:
            async def read():
                while not done(self):
                    for records in (await consumer.getmany(timeout_ms=100)).values():
                        for rec in records:
                            self._add(rec)
            await asyncio.wait_for(read(), timeout_s)
        finally:
            await consumer.stop()

    def _add(self, rec) -> None:
        if rec.topic == DECISIONS.name:
            d = decode(DECISIONS, rec.value)
            self.decisions[(d.request_id, d.revision)] = d
        elif rec.topic == PLACEMENT.name:
            h = decode(PLACEMENT, rec.value)
            self.hints[h.hint_id] = h
        elif rec.topic == TRANSFERS.name:
            t = decode(TRANSFERS, rec.value)
            self.transfers[t.transfer_id] = t
        else:
            self.dead.append(decode(DEAD_LETTER, rec.value))


@pytest.mark.tansu
async def test_plan_requests_through_the_embedded_broker_match_the_pure_planner(tansu_url):
    await ensure_topics(tansu_url, partitions=1)  # one partition: requests are planned in send order
    index, requests = _scenario()
    model, policy = shipped_cost_model(), ExecutionPolicy(version="bus-test")
    clock = [NOW]
    service = PlannerService(tansu_url, index, base_model=model, policy=policy,
                             clock=lambda: clock[0], group_id=f"planner-test-{uuid.uuid4().hex[:6]}")
    await service.start()
    try:
        producer = make_producer(tansu_url, client_id="planner-test")
        await producer.start()
        try:
            for req in requests:
                await producer.send_and_wait(PLAN_REQUESTS.name, encode(PLAN_REQUESTS, req),
                                             key=req.request_id.encode())
            await producer.send_and_wait(PLAN_REQUESTS.name, b"\x00 not a plan request", key=b"r-garbage")
            stranger = SCOPE.model_copy(update={"descriptor_id": "sd1-" + "f" * 32})
            unknown = requests[3].model_copy(update={"request_id": "r-unknown", "scope": stranger})
            await producer.send_and_wait(PLAN_REQUESTS.name, encode(PLAN_REQUESTS, unknown), key=b"r-unknown")
            await producer.send_and_wait(PLAN_REQUESTS.name, encode(PLAN_REQUESTS, requests[0]), key=b"r-full")

            expected = _expected(index, requests, model, policy)
            want_decisions = {(r.value.request_id, 0): r.value for r in expected if r.topic is DECISIONS}
            want_hints = {r.value.hint_id: r.value for r in expected if r.topic is PLACEMENT}
            want_transfers = {r.value.transfer_id: r.value for r in expected if r.topic is TRANSFERS}
            got = Collector(tansu_url)
            await got.until(lambda c: len(c.decisions) >= len(want_decisions) and len(c.hints) >= len(want_hints)
                            and len(c.transfers) >= len(want_transfers) and len(c.dead) >= 2)

            assert got.decisions == want_decisions
            assert got.hints == want_hints
            assert got.transfers == want_transfers
            actions = {rid: d.action for (rid, _rev), d in got.decisions.items()}
            assert actions == {"r-full": Action.FULL_REUSE, "r-far": Action.TRANSFER, "r-pre": Action.PREFETCH,
                               "r-miss": Action.RECOMPUTE, "r-chat": Action.FULL_REUSE, "r-inline": Action.RECOMPUTE}
            reasons = sorted(d.reason for d in got.dead)
            assert any("undecodable" in r for r in reasons) and any("unknown to this planner" in r for r in reasons)
            assert {d.service for d in got.dead} == {"nexuskv-planner"}
            assert service.core.duplicates == 1 and service.rejected == 2  # the repeated r-full was skipped

            # A failed transfer result, then the clock passing the prefetch's deadline.
            far = next(t for t in got.transfers.values() if t.request_id == "r-far")
            failed = TransferResult(transfer_id=far.transfer_id, request_id="r-far", status="failed", source=far.source,
                                    destination=far.destination, started_at=NOW, finished_at=NOW + 0.01,
                                    error="remote worker gone")
            await producer.send_and_wait(TRANSFER_RESULTS.name, encode(TRANSFER_RESULTS, failed), key=b"r-far")
            clock[0] = got.decisions[("r-pre", 0)].deadline_at + 0.001
            await got.until(lambda c: ("r-far", 1) in c.decisions and ("r-pre", 1) in c.decisions
                            and any(h.kind is HintKind.CANCEL for h in c.hints.values()))
        finally:
            await producer.stop()
    finally:
        await service.stop()

    far_fallback, pre_fallback = got.decisions[("r-far", 1)], got.decisions[("r-pre", 1)]
    assert far_fallback.action is Action.RECOMPUTE and "remote worker gone" in far_fallback.reason
    assert pre_fallback.action is Action.RECOMPUTE and "missed its deadline" in pre_fallback.reason
    (cancel,) = [h for h in got.hints.values() if h.kind is HintKind.CANCEL]
    assert cancel.request_id == "r-pre" and cancel.worker == "w-b" and cancel.tier is Tier.GPU
    assert not service.core.scheduler.open_tickets()


def test_dispatch_delays_are_measured_per_destination_and_never_below_the_bus():
    d = DispatchDelays()
    assert d.estimates(["w1"]) == {"w1": 0.0}
    d.request_arrived(arrival_at=100.0, now=100.02)  # a plan request's trip: 20 ms
    d.request_arrived(arrival_at=0.0, now=100.0)  # a replayed request, not the bus: ignored
    d.request_arrived(arrival_at=98.0, now=100.0)  # a backlog (the planner was starting): ignored
    d.issued("t1", "w1", issued_at=100.0)
    d.started("t1", started_at=100.5)  # the command started 0.5 s after it was issued
    d.started("t1", started_at=200.0)  # a duplicate result changes nothing
    d.started("unknown", started_at=100.0)
    est = d.estimates(["w1", "w2"])
    assert est["w1"] == pytest.approx(0.5) and est["w2"] == pytest.approx(2 * 0.3 * 0.02)  # no result yet: 2 trips
    d.issued("t2", "w1", issued_at=101.0)
    d.started("t2", started_at=101.1)
    assert d.estimates(["w1"])["w1"] == pytest.approx(0.5 + 0.3 * (0.1 - 0.5))
