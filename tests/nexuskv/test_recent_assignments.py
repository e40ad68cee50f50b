"""The planner counts its own recent decisions as load its callers have not reported yet
(:mod:`nexuskv.planner.assigned`): a burst of requests with the same cached prefix, each sent with
the empty queues its caller saw, is spread once the holder's queue prices above recomputing."""

from __future__ import annotations

from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import DescriptorRegistry, known_model
from nexuskv.planner.assigned import RecentAssignments
from nexuskv.planner.core import PlannerCore
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model

from tests.planning import KeyIndex

PROFILE = "h200x1-rdma4x200"
T0 = 1_800_000_000.0


def test_only_decisions_younger_than_the_snapshot_less_a_trip_are_added():
    made = RecentAssignments()
    made.decided("w-a", compute_tokens=100, prompt_tokens=400, at=T0)
    made.decided("w-a", compute_tokens=50, prompt_tokens=200, at=T0 + 1.0)
    made.decided("w-b", compute_tokens=10, prompt_tokens=10, at=T0 + 2.0)
    loads = (WorkerLoad(worker="w-a", queued_prefill_tokens=7, queued_prefill_requests=1),
             WorkerLoad(worker="w-b"), WorkerLoad(worker="w-c"))
    a, b, c = made.loads(loads, since=T0 + 0.5)
    assert (a.queued_prefill_requests, a.queued_prefill_tokens, a.queued_prefill_token_products) == (2, 57, 50 * 200)
    assert (b.queued_prefill_requests, b.queued_prefill_tokens, b.queued_prefill_token_products) == (1, 10, 100)
    assert c is loads[2]
    assert made.loads(loads, since=T0 + 2.0) is loads  # all of them are in the caller's snapshot
    made.forget(now=T0 + 1.0 + RecentAssignments.HORIZON_S + 0.1)
    assert made.loads(loads, since=0.0)[1].queued_prefill_requests == 1  # only w-b's is left


def _burst(core: PlannerCore, scope: IdentityScope, keys, n: int, *, arrival_at: float, step_s: float) -> list[str]:
    workers = []
    for i in range(n):
        req = PlanRequest(request_id=f"r{arrival_at}-{i}", scope=scope, block_size=16, prompt_tokens=len(keys) * 16,
                          keys=keys, arrival_at=arrival_at,
                          candidates=(WorkerLoad(worker="w-a", profile=PROFILE), WorkerLoad(worker="w-b", profile=PROFILE)))
        workers.append(core.plan_request(req, now=arrival_at + 0.005 + i * step_s).decision.worker)
    return workers


def test_a_burst_behind_one_cached_prefix_is_spread_and_a_later_snapshot_is_not_counted_twice():
    llama = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="acme")
    scope = IdentityScope.of(llama)
    keys = tuple(BlockKeyer(scope, 16).keys([(i * 31) % 50_000 for i in range(16_384)]))
    index = KeyIndex()
    index.store(scope, "w-a", Tier.GPU, keys[: len(keys) // 2])  # half the prompt is cached on w-a

    def core() -> PlannerCore:
        return PlannerCore(index, model=shipped_cost_model, policy=lambda: ExecutionPolicy(version="t"),
                           descriptors=DescriptorRegistry([llama]))

    alone = _burst(core(), scope, keys, 1, arrival_at=T0, step_s=0.001)
    assert alone == ["w-a"]  # one request: reusing the cached half wins
    planner = core()
    burst = _burst(planner, scope, keys, 8, arrival_at=T0, step_s=0.001)
    assert burst[0] == "w-a" and "w-b" in burst, burst  # the queue it built on w-a sent some to w-b
    assert planner.assigned.added > 0
    # Sixty seconds later every caller's snapshot holds (or has finished) the burst: nothing is added.
    later = _burst(planner, scope, keys, 1, arrival_at=T0 + 60.0, step_s=0.001)
    assert later == ["w-a"]
