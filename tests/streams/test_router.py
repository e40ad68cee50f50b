"""The reference router: each policy routes by its own rule, hints of the planner service win,
and one run on a slice of the Mooncake conversation trace reports the three policies side by side."""

from __future__ import annotations

import pytest

from nexuskv.contracts.decisions import Action
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.descriptor import Tier
from nexuskv.identity import IdentityScope
from nexuskv.models import known_model
from nexuskv.planner import plan
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model
from nexuskv.routing_policies import DynamoCost, LlmdScheduler
from streams.router import POLICY_NAMES, RouteHints, Router, local_prefix, predict

from benchmarks.router_sim import SimConfig, compare, side_by_side, sim_execution_policy
from benchmarks.trace_events import CONVERSATION_SLICE, load_trace
from tests.planning import NOW, KeyIndex, keys_for

LLAMA = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="router-test")
PROFILE = "h200x1-rdma4x200"
MODEL = shipped_cost_model()
POLICY = ExecutionPolicy(version="router-test")


def _loads(**queued: int) -> list[WorkerLoad]:
    return [WorkerLoad(worker=w, profile=PROFILE, queued_prefill_tokens=q) for w, q in queued.items()]


def _router(index, policy: str, hints: RouteHints | None = None) -> Router:
    return Router(index, LLAMA, policy=policy, model=lambda: MODEL, execution=lambda: POLICY, hints=hints)


@pytest.fixture
def index() -> KeyIndex:
    """w-a holds the whole 4K prompt on its GPU but has a long queue; w-b holds half on its host tier."""
    idx = KeyIndex()
    keys = keys_for(LLAMA, 4096)
    idx.store(IdentityScope.of(LLAMA), "w-a", Tier.GPU, keys)
    idx.store(IdentityScope.of(LLAMA), "w-b", Tier.HOST, keys[:128])
    return idx


def test_each_policy_routes_by_its_own_rule(index):
    loads = _loads(**{"w-a": 40_000, "w-b": 0, "w-c": 0})
    for name in POLICY_NAMES:
        router = _router(index, name)
        q = router.query("r1", loads, now=NOW, keys=keys_for(LLAMA, 4096), prompt_tokens=4096)
        lk = index.lookup(q.scope, q.keys)
        outcome = router.route(q, now=NOW)
        assert outcome.policy == name and outcome.source == "policy"
        if name == "dynamo":
            expected = DynamoCost().select(q, lk)
        elif name == "llm-d":
            expected = LlmdScheduler().select(q, lk)
        else:
            expected = None
            assert outcome.worker == plan(q, lk, MODEL, POLICY, now=NOW).worker
        if expected is not None:
            assert outcome.worker == expected.worker and outcome.scores == expected.scores
        p = outcome.prediction
        assert p == predict(q, lk, outcome.worker, MODEL, POLICY, now=NOW)
        assert p.ttft_s is not None and p.ttft_s > 0 and p.local_blocks == local_prefix(lk, outcome.worker)


def test_predict_reports_the_planners_option_on_that_worker(index):
    router = _router(index, "nexuskv")
    q = router.query("r1", _loads(**{"w-a": 0, "w-b": 0, "w-c": 0}), now=NOW, keys=keys_for(LLAMA, 4096),
                     prompt_tokens=4096)
    lk = index.lookup(q.scope, q.keys)
    on_a = predict(q, lk, "w-a", MODEL, POLICY, now=NOW)
    on_c = predict(q, lk, "w-c", MODEL, POLICY, now=NOW)
    assert on_a.action is Action.FULL_REUSE and on_a.reused_blocks == 255  # the last block is computed
    assert on_a.local_blocks == 256 and on_c.local_blocks == 0
    assert on_a.ttft_s < on_c.ttft_s  # reusing 4K tokens in place beats anything on an empty worker
    assert router.route(q, now=NOW).worker == "w-a"
    with pytest.raises(ValueError, match="not a candidate"):
        predict(q, lk, "w-z", MODEL, POLICY, now=NOW)


def test_a_route_hint_of_the_planner_service_wins(index):
    hints = RouteHints(ttl_s=60.0)
    router = _router(index, "nexuskv", hints)
    loads = _loads(**{"w-a": 0, "w-b": 0, "w-c": 0})
    q = router.query("r-hinted", loads, now=NOW, keys=keys_for(LLAMA, 4096), prompt_tokens=4096)
    assert not hints.offer(PlacementHint(hint_id="x/h1", request_id="r-hinted", tenant_namespace="router-test",
                                         kind=HintKind.PIN, worker="w-c", issued_at=NOW, reason="pin"))
    assert hints.offer(PlacementHint(hint_id="x/h0", request_id="r-hinted", tenant_namespace="router-test",
                                     kind=HintKind.ROUTE, worker="w-c", issued_at=NOW, reason="decided elsewhere"))
    outcome = router.route(q, now=NOW + 1)
    assert outcome.worker == "w-c" and outcome.source == "placement" and "decided elsewhere" in outcome.formula
    assert router.route(q, now=NOW + 61).source == "policy"  # an old hint no longer counts
    other = router.query("r-other", loads, now=NOW, keys=keys_for(LLAMA, 4096), prompt_tokens=4096)
    assert router.route(other, now=NOW).source == "policy"


def test_unknown_policy_and_bad_queries_are_refused(index):
    with pytest.raises(ValueError, match="policy"):
        _router(index, "round-robin")
    router = _router(index, "dynamo")
    with pytest.raises(ValueError, match="exactly one"):
        router.query("r", _loads(a=0), now=NOW)
    q = router.query("r", _loads(a=0), now=NOW, token_ids=list(range(100)))
    assert q.prompt_tokens == 100 and len(q.keys) == 6


@pytest.mark.slow
def test_three_policies_side_by_side_on_a_trace_slice():
    requests = load_trace(CONVERSATION_SLICE, limit=80)
    reports = compare(requests, config=SimConfig(workers=8, sample_every=4))
    table = side_by_side(reports)
    assert list(table) == list(POLICY_NAMES)
    for name, row in table.items():
        assert set(row) == {"policy", "requests", "mean_ttft_s", "p99_ttft_s", "mean_wait_s", "hit_rate",
                            "local_hit_rate", "workers_used"}
        assert 0 <= row["mean_wait_s"] < row["mean_ttft_s"]
        assert row["requests"] == 80 and 0 < row["mean_ttft_s"] <= row["p99_ttft_s"]
        assert 0 <= row["local_hit_rate"] <= row["hit_rate"] <= 1
    model, policy = shipped_cost_model(), sim_execution_policy()
    for name, report in reports.items():
        assert len(report.samples) == 20
        for query, lookup, worker in report.samples:
            if name == "dynamo":
                chosen = DynamoCost().select(query, lookup)
                assert worker == chosen.worker == min(chosen.scores, key=lambda ws: (ws[1], ws[0]))[0]
            elif name == "llm-d":
                chosen = LlmdScheduler().select(query, lookup)
                assert worker == chosen.worker == min(chosen.scores, key=lambda ws: (-ws[1], ws[0]))[0]
            else:
                assert worker == plan(query, lookup, model, policy, now=query.arrival_at).worker
    routes = {name: [s.worker for s in report.served] for name, report in reports.items()}
    assert len({tuple(r) for r in routes.values()}) == 3  # the rules disagree: the comparison is not vacuous
