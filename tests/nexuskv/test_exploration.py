"""The exploration budget: an uncertain option with a positive expected EG is taken by a bounded,
deterministic share of decisions, while the fit it rests on has few observations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from analytics.store import DecisionStore
from nexuskv.contracts import decode, encode
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.contracts.topics import DECISIONS
from nexuskv.descriptor import Tier
from nexuskv.models import known_model
from nexuskv.planner import plan
from nexuskv.planner.gate import exploration_draw
from nexuskv.policy import ExecutionPolicy, parse_policy
from nexuskv.profiles import shipped_cost_model

from tests.planning import NOW, lookup, match, query

LLAMA8 = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme")
X1 = "h200x1-rdma4x200"
MODEL = shipped_cost_model()


def _policy(planner: str) -> ExecutionPolicy:
    # z = 6: the disk load's lower bound falls below 0 while its expected EG stays positive.
    return parse_policy("schema_version='nexuskv.execution_policy.v1'\nversion='t'\n"
                        f"[planner]\nconfidence_z=6.0\n{planner}", fmt="toml")


def _ids(share: float, *, below: bool, n: int) -> list[str]:
    """The first ``n`` request ids whose draw falls below (or at/above) ``share``."""
    out = [rid for rid in (f"req-{i}" for i in range(10_000)) if (exploration_draw(rid) < share) is below]
    return out[:n]


def _uncertain_load(request_id: str, policy: ExecutionPolicy, model=MODEL):
    q = query(LLAMA8, 8192, [WorkerLoad(worker="w-a", profile=X1)], request_id=request_id)
    nb = len(q.keys)
    return plan(q, lookup(nb, match("w-a", "disk", nb // 2)), model, policy, now=NOW)


def test_the_draw_is_deterministic_and_uniform():
    assert exploration_draw("abc") == exploration_draw("abc")
    draws = [exploration_draw(f"r{i}") for i in range(20_000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert 0.045 < sum(d < 0.05 for d in draws) / len(draws) < 0.055
    assert 0.49 < sum(d < 0.5 for d in draws) / len(draws) < 0.51


def test_without_exploration_the_uncertain_load_is_declined():
    p = _uncertain_load("r1", _policy("explore_share=0.0"))
    load = next(o for o in p.options if o.action in (Action.TRANSFER, Action.PREFETCH))
    assert load.eg_s > 0 and load.eg_lower_s <= 0  # the case exploration is for
    assert p.decision.action is Action.RECOMPUTE and not p.decision.explored
    assert "not sure enough" in p.decision.reason


def test_a_drawn_decision_explores_the_uncertain_load_and_says_so():
    policy = _policy("explore_share=0.05")
    for rid in _ids(0.05, below=True, n=3):
        p = _uncertain_load(rid, policy)
        dec = p.decision
        assert dec.action in (Action.TRANSFER, Action.PREFETCH), dec.reason
        assert dec.explored and dec.reason.startswith("exploration: ")
        assert dec.eg_s > 0 and dec.eg_lower_s <= 0
        assert p.transfers or p.hints  # it is carried out like any other load
        assert decode(DECISIONS, encode(DECISIONS, dec)) == dec
    for rid in _ids(0.05, below=False, n=20):
        dec = _uncertain_load(rid, policy).decision
        assert dec.action is Action.RECOMPUTE and not dec.explored


def test_the_share_bounds_how_many_decisions_explore():
    policy = _policy("explore_share=0.05")
    explored = sum(_uncertain_load(f"s-{i}", policy).decision.explored for i in range(2000))
    assert 0.035 * 2000 < explored < 0.065 * 2000


def test_a_fit_with_enough_observations_is_not_explored():
    """The per-fit cap: a link fitted from many observations keeps its uncertainty; the gate alone decides."""
    policy = _policy("explore_share=0.05\nexplore_max_observations=20")
    rid = _ids(0.05, below=True, n=1)[0]
    disk = MODEL.link(X1, Tier.DISK, Tier.GPU)
    for seen, explores in ((19, True), (20, False)):
        model = MODEL.with_link(replace(disk, observations=seen))
        model = model.with_compute(replace(model.compute_for(LLAMA8.model, X1), observations=500))
        assert _uncertain_load(rid, policy, model).decision.explored is explores


def test_exploration_never_takes_an_option_expected_to_lose():
    """A load whose expected EG is below min_gain is not explored (only uncertainty is)."""
    policy = _policy("explore_share=0.5\nmin_gain_s=5.0")
    for rid in _ids(0.5, below=True, n=10):
        assert _uncertain_load(rid, policy).decision.action is Action.RECOMPUTE


def test_the_decision_store_records_exploration(tmp_path):
    policy = _policy("explore_share=0.05")
    explored = _uncertain_load(_ids(0.05, below=True, n=1)[0], policy).decision
    plain = _uncertain_load(_ids(0.05, below=False, n=1)[0], policy).decision
    store = DecisionStore(tmp_path / "d.duckdb")
    store.write_all(decisions=[explored, plain])
    rows = dict(store.query("SELECT request_id, explored FROM decisions"))
    assert rows == {explored.request_id: True, plain.request_id: False}


def test_an_older_decision_store_gains_the_column(tmp_path):
    """A store created before the column existed is migrated at open and takes the new records."""
    import duckdb

    from analytics.schema import TABLES

    old = "\n".join(line for line in TABLES["decisions"].splitlines() if "explored" not in line)
    assert old != TABLES["decisions"]
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute(old)
    con.close()
    policy = _policy("explore_share=0.05")
    explored = _uncertain_load(_ids(0.05, below=True, n=1)[0], policy).decision
    store = DecisionStore(path)
    assert store.write_all(decisions=[explored])["decisions"] == 1
    assert store.query("SELECT explored FROM decisions") == [(True,)]
