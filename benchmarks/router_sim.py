"""Routing policies on a Mooncake trace: N simulated workers, one reference router per policy.

For each policy a fresh simulation replays the trace's requests in arrival order:

1. the request's canonical keys are looked up in that simulation's own
   :class:`~nexuskv.index.GlobalIndex`, fed by its workers' lifecycle events;
2. the workers' loads at arrival (:class:`_Queue`) go into the query, and
   :class:`~streams.router.Router` picks a worker by the policy's rule;
3. the route is evaluated by the planner on that worker (:func:`streams.router.predict`): the
   option it would take there (reuse the GPU prefix, pull from the worker's host tier or from
   another worker, or recompute), with its predicted service time and reused blocks;
4. the worker serves it (:meth:`benchmarks.trace_events.TraceReplay.step` on the chosen worker: its
   LRU GPU and host caches change, its events go to the index) and its queue advances.

The figure per request is its **predicted TTFT**: the wait in the chosen worker's FIFO prefill
queue (the predicted service times of the requests ahead of it, measured on the simulation's
clock) plus its own predicted service time. Every number comes from the cost model — it is a
prediction under the model, not a measurement; NexusKV's rule optimises that same model, so
the comparison shows what the other rules leave on the table *under it*.

Assumptions (say them when quoting a figure): Llama-3.1-8B on one H200 per worker (the shipped
``h200x1-rdma4x200`` profile), 16-token blocks, the trace's own arrival times, every worker
equally fast; a request decodes ``output_length`` tokens at ``tpot_s`` each after its prefill
(its KV blocks count as the worker's decode load meanwhile); the queue a router sees is the
uncached tokens of the requests routed to that worker and not yet prefilled.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import CostModel
from nexuskv.descriptor import StateDescriptor
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.index import GlobalIndex
from nexuskv.lookup import LookupResult
from nexuskv.models import known_model
from nexuskv.planner import PlanQuery
from nexuskv.policy import ExecutionPolicy, PlannerSettings
from nexuskv.profiles import shipped_cost_model
from streams.router import POLICY_NAMES, Router, RoutingOutcome

from benchmarks.trace_events import BLOCK_TOKENS, TraceReplay, TraceRequest

__all__ = ["PROFILE", "MODEL", "SimConfig", "SimServed", "PolicyReport", "simulate", "compare", "side_by_side",
           "sim_execution_policy", "percentile"]

PROFILE = "h200x1-rdma4x200"
MODEL = "meta-llama/Llama-3.1-8B"


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 8
    gpu_blocks: int = 40_000  # per worker: 640K tokens, ~80 GiB of Llama-3.1-8B KV (an H200 after weights)
    host_blocks: int = 80_000  # per worker: ~160 GiB of host DRAM
    tpot_s: float = 0.02  # seconds per output token while decoding
    time_scale: float = 1.0  # arrival times are divided by this (2.0: twice the request rate)
    tenant: str = "trace"
    sample_every: int = 0  # keep every n-th request's router inputs and choice (0: none), for checks


@dataclass(frozen=True, slots=True)
class SimServed:
    """One request as a policy served it."""

    request_id: str
    worker: str
    prompt_tokens: int
    reused_tokens: int
    local_tokens: int  # the routed worker's own GPU prefix
    wait_s: float  # in the worker's prefill queue
    service_s: float
    action: str

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.service_s


@dataclass(slots=True)
class PolicyReport:
    """Mean and p99 predicted TTFT and hit rates of one policy over one run."""

    policy: str
    served: list[SimServed] = field(default_factory=list)
    samples: list[tuple[PlanQuery, LookupResult, str]] = field(default_factory=list)  # (query, lookup, worker)

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft_s for s in self.served]

    @property
    def mean_ttft_s(self) -> float:
        values = self.ttfts
        return sum(values) / len(values) if values else 0.0

    @property
    def p99_ttft_s(self) -> float:
        return percentile(self.ttfts, 99.0)

    @property
    def mean_wait_s(self) -> float:
        """Mean wait in the routed worker's prefill queue (the part of TTFT routing controls most)."""
        return sum(s.wait_s for s in self.served) / len(self.served) if self.served else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens restored instead of computed (any source), over all prompt tokens."""
        total = sum(s.prompt_tokens for s in self.served)
        return sum(s.reused_tokens for s in self.served) / total if total else 0.0

    @property
    def local_hit_rate(self) -> float:
        """Prompt tokens already in the routed worker's GPU cache, over all prompt tokens."""
        total = sum(s.prompt_tokens for s in self.served)
        return sum(s.local_tokens for s in self.served) / total if total else 0.0

    @property
    def workers_used(self) -> int:
        return len({s.worker for s in self.served})

    def summary(self) -> dict[str, float | int | str]:
        return {"policy": self.policy, "requests": len(self.served), "mean_ttft_s": self.mean_ttft_s,
                "p99_ttft_s": self.p99_ttft_s, "mean_wait_s": self.mean_wait_s, "hit_rate": self.hit_rate, "local_hit_rate": self.local_hit_rate,
                "workers_used": self.workers_used}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile by linear interpolation (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class _Queue:
    """One worker's FIFO prefill queue and its decoding requests, on the simulation's clock."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until = 0.0
        self.prefills: list[tuple[float, int]] = []  # heap of (prefill end, uncached tokens)
        self.decodes: list[tuple[float, int]] = []  # heap of (decode end, KV blocks)

    def load(self, now: float) -> WorkerLoad:
        while self.prefills and self.prefills[0][0] <= now:
            end, _tokens = heapq.heappop(self.prefills)
        while self.decodes and self.decodes[0][0] <= now:
            heapq.heappop(self.decodes)
        return WorkerLoad(worker=self.name, profile=PROFILE,
                          queued_prefill_tokens=sum(t for _e, t in self.prefills),
                          decode_blocks=sum(b for _e, b in self.decodes),
                          active_requests=len(self.prefills) + len(self.decodes))

    def serve(self, now: float, service_s: float, uncached: int, blocks: int, decode_s: float) -> float:
        """Queue a prefill of ``service_s``; returns the wait before it starts."""
        start = max(now, self.busy_until)
        end = start + service_s
        self.busy_until = end
        heapq.heappush(self.prefills, (end, uncached))
        heapq.heappush(self.decodes, (end + decode_s, blocks))
        return start - now


def sim_execution_policy() -> ExecutionPolicy:
    """The built-in policy, with the simulated workers' hardware profile as the default."""
    return ExecutionPolicy(version="router-sim", planner=PlannerSettings(default_hardware_profile=PROFILE))


def _descriptor(tenant: str) -> StateDescriptor:
    return known_model(MODEL, tenant_namespace=tenant)


def simulate(requests: Sequence[TraceRequest], policy: str, *, config: SimConfig = SimConfig(),
             model: CostModel | None = None, execution: ExecutionPolicy | None = None) -> PolicyReport:
    """Replay ``requests`` with ``policy`` routing; see the module docstring."""
    descriptor = _descriptor(config.tenant)
    scope = IdentityScope.of(descriptor)
    identity = PublisherIdentity(tenant_namespace=descriptor.tenant_namespace, model=descriptor.model,
                                 model_revision=descriptor.model_revision,
                                 tokenizer_revision=descriptor.tokenizer_revision,
                                 descriptor_id=descriptor.descriptor_id)
    replay = TraceReplay(list(requests), workers=config.workers, gpu_blocks=config.gpu_blocks,
                         host_blocks=config.host_blocks, identity=identity)
    index = GlobalIndex()
    cost = model or shipped_cost_model()
    rules = execution or sim_execution_policy()
    router = Router(index, descriptor, policy=policy, model=lambda: cost, execution=lambda: rules)
    keyer = BlockKeyer(scope, BLOCK_TOKENS)
    queues = {w.name: _Queue(w.name) for w in replay.workers}
    report = PolicyReport(policy)
    t0 = requests[0].timestamp_ms / 1000.0 if requests else 0.0
    for i, request in enumerate(requests):
        now = t0 + (request.timestamp_ms / 1000.0 - t0) / config.time_scale
        blocks = replay.blocks_of(request)[: config.gpu_blocks]
        if not blocks:
            continue
        keys = keyer.keys(replay.tokens(blocks))
        prompt = len(blocks) * BLOCK_TOKENS
        loads = [q.load(now) for q in queues.values()]
        query = router.query(f"req-{i}", loads, now=now, keys=keys, prompt_tokens=prompt)
        lookup = index.lookup(scope, keys)
        outcome: RoutingOutcome = router.route(query, now=now, lookup=lookup)
        if config.sample_every and i % config.sample_every == 0:
            report.samples.append((query, lookup, outcome.worker))
        pred = outcome.prediction
        if pred.service_s is None:
            raise RuntimeError(f"no cost profile for {MODEL} on {PROFILE}")
        reused = pred.reused_blocks * BLOCK_TOKENS
        total_blocks = -(-(request.input_length + request.output_length) // BLOCK_TOKENS)
        wait = queues[outcome.worker].serve(now, pred.service_s, prompt - reused, total_blocks,
                                            request.output_length * config.tpot_s)
        report.served.append(SimServed(query.request_id, outcome.worker, prompt, reused,
                                    pred.local_blocks * BLOCK_TOKENS, wait, pred.service_s, pred.action.value))
        for batch in replay.step(request, worker=outcome.worker):
            index.apply(batch)
    return report


def compare(requests: Sequence[TraceRequest], *, config: SimConfig = SimConfig(),
            policies: Sequence[str] = POLICY_NAMES) -> dict[str, PolicyReport]:
    """One report per policy, each from its own simulation of the same requests."""
    return {name: simulate(requests, name, config=config) for name in policies}


def side_by_side(reports: dict[str, PolicyReport]) -> dict[str, dict[str, float | int | str]]:
    """Each policy's summary (mean and p99 predicted TTFT, hit rates), keyed by policy."""
    return {name: report.summary() for name, report in reports.items()}
