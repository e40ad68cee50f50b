"""The planning scenario both planner benchmarks use: an 8K-token Llama-3.1-8B prompt, four
candidate workers with different loads, its state in five places (two GPUs, host, disk, and an
uncertain publisher), as an admission-time plan request would find it.

``reuse_wins`` moves the full prefix to w-c's GPU, so the decision is a reuse in place and no
transfer is ordered (the bus benchmark sends hundreds of requests; transfers would fill the
in-flight budget and their deadlines would add fallback records to what is measured).
"""

from __future__ import annotations

from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import LocationMatch, LookupResult
from nexuskv.models import known_model
from nexuskv.planner import PlanQuery

TOKENS = 8192
PROFILE = "h200x1-rdma4x200"
DESCRIPTOR = known_model("meta-llama/Llama-3.1-8B", tenant_namespace="bench")
SCOPE = IdentityScope.of(DESCRIPTOR)
KEYS = tuple(BlockKeyer(SCOPE, DESCRIPTOR.block_size).keys([(i * 31) % 50_000 for i in range(TOKENS)]))
CANDIDATES = (
    WorkerLoad(worker="w-a", profile=PROFILE, queued_prefill_tokens=2000),
    WorkerLoad(worker="w-b", profile=PROFILE, queued_prefill_tokens=30000),
    WorkerLoad(worker="w-c", profile=PROFILE),
    WorkerLoad(worker="w-d", profile=PROFILE, decode_blocks=5000),
)


def _match(worker: str, tier: Tier, prefix: int, certain: bool = True) -> LocationMatch:
    return LocationMatch(EntryLocation(worker=worker, tier=tier), f"pub/{worker}", prefix, certain=certain)


def lookup(*, reuse_wins: bool = False) -> LookupResult:
    n = len(KEYS)
    return LookupResult(num_blocks=n, matches=(
        _match("w-a", Tier.HOST, n),
        _match("w-b", Tier.GPU, n),
        _match("w-c", Tier.DISK, 256),
        _match("w-c", Tier.GPU, n if reuse_wins else 100),
        _match("w-d", Tier.GPU, 300, certain=False),
    ))


def query(request_id: str = "bench") -> PlanQuery:
    return PlanQuery(request_id=request_id, scope=SCOPE, descriptor=DESCRIPTOR, keys=KEYS, prompt_tokens=TOKENS,
                     arrival_at=1.0, candidates=CANDIDATES)


def plan_request(request_id: str, arrival_at: float) -> PlanRequest:
    return PlanRequest(request_id=request_id, scope=SCOPE, block_size=DESCRIPTOR.block_size, prompt_tokens=TOKENS,
                       keys=KEYS, arrival_at=arrival_at, candidates=CANDIDATES)


class ScenarioIndex:
    """An IndexView that answers every lookup with the scenario's matches."""

    def __init__(self, *, reuse_wins: bool) -> None:
        self._answer = lookup(reuse_wins=reuse_wins)

    def lookup(self, scope, keys) -> LookupResult:
        return self._answer
