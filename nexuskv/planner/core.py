"""The planner's whole algorithm between bytes in and records out, without I/O.

:class:`PlannerCore` decodes a plan request, resolves its descriptor (:class:`~nexuskv.models.DescriptorRegistry`),
matches it against any :class:`~nexuskv.lookup.IndexView`, decides with :func:`~nexuskv.planner.decide.plan`
on the cost model, policy and tier prices it is given as snapshots (callables returning the
current value), tracks prefetches (:class:`~nexuskv.planner.prefetch.PrefetchScheduler`) and the measured
dispatch delays (:class:`~nexuskv.planner.dispatch.DispatchDelays`), and returns the
:class:`Outgoing` records to publish. The clock is passed in (``now=``). The service
(:mod:`streams.planner_service`) only moves bytes between the bus and this object.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from nexuskv.contract import Contract
from nexuskv.contracts import codec
from nexuskv.contracts.plans import PlanRequest
from nexuskv.contracts.topics import DECISIONS, PLACEMENT, PLAN_REQUESTS, TRANSFER_RESULTS, TRANSFERS, Topic
from nexuskv.contracts.transfers import TransferResult, executor_of
from nexuskv.cost import CostModel
from nexuskv.errors import ContractError, UnauthenticatedError
from nexuskv.identity import IdentityScope
from nexuskv.lookup import IndexView, LookupResult
from nexuskv.models import DescriptorRegistry
from nexuskv.planner.assigned import RecentAssignments
from nexuskv.planner.decide import plan
from nexuskv.planner.dispatch import DispatchDelays
from nexuskv.planner.plan import Plan
from nexuskv.planner.prefetch import Effect, PrefetchFallback, PrefetchScheduler, effect_hint
from nexuskv.planner.query import PlanQuery
from nexuskv.planner.records import explain
from nexuskv.policy import ExecutionPolicy
from nexuskv.priors import with_assumed_hardware, with_assumed_reads

__all__ = ["NullIndexView", "Outgoing", "PlannerCore", "effect_records", "plan_records"]

log = logging.getLogger("nexuskv.planner")


class NullIndexView:
    """An index that knows nothing: every lookup is a miss (so every decision is a recompute)."""

    def lookup(self, scope: IdentityScope, keys: Sequence[int]) -> LookupResult:
        return LookupResult(num_blocks=len(keys), matches=())


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record to publish."""

    topic: Topic
    key: str
    value: Contract
    headers: tuple[tuple[str, bytes], ...] = ()  # the trace context of the request that caused it


def plan_records(p: Plan) -> list[Outgoing]:
    """The records that publish a plan: its decision, hints and transfer commands."""
    out = [Outgoing(DECISIONS, p.decision.request_id, p.decision)]
    out.extend(Outgoing(PLACEMENT, f"{h.tenant_namespace}/{h.prefix_root}", h) for h in p.hints)
    out.extend(Outgoing(TRANSFERS, t.destination.worker, t) for t in p.transfers)
    return out


def effect_records(effects: Iterable[Effect], *, now: float) -> list[Outgoing]:
    out: list[Outgoing] = []
    for e in effects:
        if isinstance(e, PrefetchFallback):
            out.append(Outgoing(DECISIONS, e.request_id, e.decision))
        else:
            hint = effect_hint(e, now=now)
            out.append(Outgoing(PLACEMENT, f"{hint.tenant_namespace}/{hint.prefix_root}", hint))
    return out


class PlannerCore:
    """Everything between bytes in and records out, without I/O; the clock is passed in."""

    def __init__(self, index: IndexView, *, model: Callable[[], CostModel], policy: Callable[[], ExecutionPolicy],
                 descriptors: DescriptorRegistry, seen_capacity: int = 100_000,
                 prices: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.index = index
        self.model = model
        self.policy = policy
        self.prices = prices  # worker -> displacement price of its GPU tier (nexuskv.tier-state)
        self.descriptors = descriptors
        self.scheduler = PrefetchScheduler(policy())
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_capacity = seen_capacity
        self.planned = 0
        self.duplicates = 0
        self._filled: dict[tuple[int, frozenset[str]], tuple[CostModel, CostModel]] = {}
        self.dispatch = DispatchDelays()
        self.assigned = RecentAssignments()
        #: Wraps every index lookup (the service's span); None: called plainly.
        self.observe_match: Callable[[Callable[[], LookupResult]], LookupResult] | None = None

    def query_of(self, request: PlanRequest) -> PlanQuery:
        """The planner's query; raises ContractError when the request cannot be planned."""
        descriptor = self.descriptors.resolve(request.scope.descriptor_id, request.descriptor)
        if descriptor is None:
            raise ContractError(f"descriptor {request.scope.descriptor_id} is unknown to this planner: "
                                "send the descriptor with the request", path="scope.descriptor_id")
        if descriptor.block_size != request.block_size:
            raise ContractError(f"block_size {request.block_size} differs from the descriptor's "
                                f"{descriptor.block_size}", path="block_size")
        return PlanQuery.from_request(request, descriptor)

    def plan_request(self, request: PlanRequest, *, now: float) -> Plan:
        query = self.query_of(request)
        lookup = self.match(query)
        policy = self.policy()
        self.dispatch.request_arrived(request.arrival_at, now)
        # The decisions sent since the caller's snapshot less a trip back are not in its loads.
        self.assigned.forget(now=now)
        candidates = self.assigned.loads(query.candidates, since=request.arrival_at - self.dispatch.bus_s)
        if candidates is not query.candidates:
            query = dataclasses.replace(query, candidates=candidates)
        p = plan(query, lookup, self._model_for(query), policy, now=now,
                 headroom=self.scheduler.headroom(query.scope.tenant_namespace),
                 pollution_s_per_gib=self.prices() if self.prices is not None else None,
                 dispatch_s=self.dispatch.estimates(c.worker for c in query.candidates))
        self.scheduler.track(p, now=now)
        d = p.decision
        self.assigned.decided(d.worker, compute_tokens=query.prompt_tokens - d.reused_tokens,
                              prompt_tokens=query.prompt_tokens, at=now)
        for t in p.transfers:
            self.dispatch.issued(t.transfer_id, t.destination.worker, t.issued_at)
        return p

    def match(self, query: PlanQuery) -> LookupResult:
        """The index's matches for ``query`` (through :attr:`observe_match`, which a service uses to
        time and trace the lookup)."""
        if self.observe_match is None:
            return self.index.lookup(query.scope, query.keys)
        return self.observe_match(lambda: self.index.lookup(query.scope, query.keys))

    def _model_for(self, query: PlanQuery) -> CostModel:
        """The cost model with assumed constants for hardware profiles only the workers know, and
        reads assumed from measured writes (:func:`nexuskv.priors.with_assumed_reads`)."""
        model = self.model()
        profiles = frozenset(c.profile for c in query.candidates if c.profile)
        key = (id(model), profiles)
        hit = self._filled.get(key)
        if hit is None or hit[0] is not model:
            if len(self._filled) > 64:
                self._filled.clear()
            hit = self._filled[key] = (model, with_assumed_reads(with_assumed_hardware(model, profiles), profiles))
        return hit[1]

    def on_request(self, raw: bytes, *, now: float) -> list[Outgoing]:
        """Records for one plan request ([] for a duplicate); raises NexusKVError for bad input."""
        request = cast(PlanRequest, codec.decode(PLAN_REQUESTS, raw))
        if request.request_id in self._seen:
            self.duplicates += 1
            return []
        p = self.plan_request(request, now=now)
        self._seen[request.request_id] = None
        while len(self._seen) > self._seen_capacity:
            self._seen.popitem(last=False)
        self.planned += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", explain(p.decision))
        return plan_records(p)

    def on_result(self, raw: bytes, *, now: float, producer: str | None = None) -> list[Outgoing]:
        """Records for one executor's result; raises NexusKVError for bad input. ``producer``: who signed
        it (None where the deployment signs nothing). Only the destination worker's own executor may
        report a transfer, and only as the command ordered it (its request, source and destination)."""
        result = cast(TransferResult, codec.decode(TRANSFER_RESULTS, raw))
        if producer is not None and producer != executor_of(result.destination.worker):
            raise UnauthenticatedError(f"not_owner: {producer[:80]!r} reports a transfer to worker "
                                       f"{result.destination.worker!r}; only {executor_of(result.destination.worker)!r} may")
        self.scheduler.check(result)
        self.dispatch.started(result.transfer_id, result.started_at)
        return effect_records(self.scheduler.complete(result, now=now), now=now)

    def on_tick(self, *, now: float) -> list[Outgoing]:
        effects = self.scheduler.tick(now=now)
        self.scheduler.forget(before=now - 300.0)
        return effect_records(effects, now=now)
