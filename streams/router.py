"""The reference router: which worker should serve a request, and what its first token will cost.

A router only decides which worker a request should go to; it does not send it there (Dynamo's
rule, ``../shared/STYLE.md``). :class:`Router` answers from three inputs it holds in process:

* an index view (:class:`~nexuskv.lookup.IndexView`: a live :class:`~streams.replica.IndexReplica`
  in the service, a :class:`~nexuskv.index.GlobalIndex` in simulations) — where each block of the
  prompt lives;
* the cost model and execution policy (callables, so a live cost-model replica can swap
  snapshots underneath);
* the route hints of ``nexuskv.placement`` (:class:`RouteHints`): when the planner service has
  already decided where a request runs, the router follows that decision instead of its own.

The routing rule is one of :data:`POLICY_NAMES`, all from :mod:`nexuskv.routing_policies` (never
re-implemented here):

* ``nexuskv`` — the worker of the planner's decision: lowest predicted TTFT among the options
  whose Effective Gain passes the gate (:class:`~nexuskv.routing_policies.EffectiveGainRouter`);
* ``dynamo`` — Dynamo's KV-router cost formula (:class:`~nexuskv.routing_policies.DynamoCost`);
* ``llm-d`` — llm-d's longest prefix × tier weight with queue and KV-load scorers
  (:class:`~nexuskv.routing_policies.LlmdScheduler`).

Whatever the rule, every route is *evaluated* the same way (:func:`predict`): the planner is asked
what it would do with the request if that worker were the only candidate — reuse its GPU prefix,
pull state from its host tier, a peer or a remote store, or recompute — and the chosen option's
predicted TTFT, reused blocks and action are reported. The policies differ only in the worker
they pick, so the comparison isolates routing. Times are seconds; ``now`` is seconds since the
epoch, passed in. Token ids are never logged.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nexuskv.contracts.decisions import Action
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import CostModel
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.lookup import IndexView, LookupResult
from nexuskv.planner import PlanQuery, plan
from nexuskv.policy import ExecutionPolicy
from nexuskv.routing_policies import DynamoCost, EffectiveGainRouter, LlmdScheduler, Route

__all__ = ["POLICY_NAMES", "Prediction", "RoutingOutcome", "RouteHints", "Router", "predict", "local_prefix"]

log = logging.getLogger("nexuskv.router")

POLICY_NAMES: tuple[str, ...] = (EffectiveGainRouter.name, DynamoCost.name, LlmdScheduler.name)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What serving a request on one worker costs, as the planner predicts it (seconds, blocks).

    ``ttft_s`` is None when that worker has no cost profile for the model (it cannot be
    estimated); ``queue_s`` is the part of ``ttft_s`` spent waiting behind the worker's queue.
    """

    worker: str
    action: Action
    ttft_s: float | None
    queue_s: float
    reused_blocks: int  # blocks the chosen option restores (in place, or moved from elsewhere)
    local_blocks: int  # the worker's own certain GPU prefix

    @property
    def service_s(self) -> float | None:
        """Time the worker is busy with the request: TTFT without the wait in its queue."""
        return None if self.ttft_s is None else self.ttft_s - self.queue_s


@dataclass(frozen=True, slots=True)
class RoutingOutcome:
    """The router's answer for one request."""

    request_id: str
    policy: str
    worker: str
    source: str  # "policy": the routing rule chose; "placement": a route hint of the planner service
    prediction: Prediction
    formula: str  # the winning score with its numbers (or the hint's reason)
    scores: tuple[tuple[str, float], ...] = ()  # every candidate's score under the rule, when it chose


def local_prefix(lookup: LookupResult, worker: str) -> int:
    """The worker's certain GPU prefix in blocks (every KV group it reports must hold it)."""
    found = [m.prefix_blocks for m in lookup.matches
             if m.location.worker == worker and m.location.tier is Tier.GPU and m.certain]
    return min(found) if found else 0


def predict(query: PlanQuery, lookup: LookupResult, worker: str, model: CostModel, execution: ExecutionPolicy, *,
            now: float) -> Prediction:
    """What the planner would do with ``query`` on ``worker`` alone, and its predicted TTFT."""
    load = next((c for c in query.candidates if c.worker == worker), None)
    if load is None:
        raise ValueError(f"worker {worker!r} is not a candidate of request {query.request_id}")
    alone = dataclasses.replace(query, candidates=(load,))
    p = plan(alone, lookup, model, execution, now=now)
    chosen = p.chosen
    return Prediction(worker=worker, action=chosen.action, ttft_s=chosen.ttft_s, queue_s=chosen.terms.queue_s,
                      reused_blocks=chosen.reused_blocks, local_blocks=local_prefix(lookup, worker))


class RouteHints:
    """Route hints from ``nexuskv.placement``, by request id; bounded, newest first, aged out.

    Only ``route`` hints name where a request should run; the other kinds (pins, prefetches,
    evictions) are for tiers and executors and are not kept. A hint older than ``ttl_s`` (by its
    ``issued_at``) no longer counts: the request it was for has long been served.
    """

    def __init__(self, *, capacity: int = 100_000, ttl_s: float = 300.0) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError("capacity and ttl_s: must be positive")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._by_request: OrderedDict[str, PlacementHint] = OrderedDict()
        self.accepted = 0

    def offer(self, hint: PlacementHint) -> bool:
        """Keep ``hint`` if it is a route hint for a request; True when kept."""
        if hint.kind is not HintKind.ROUTE or hint.request_id is None:
            return False
        self._by_request[hint.request_id] = hint
        self._by_request.move_to_end(hint.request_id)
        while len(self._by_request) > self.capacity:
            self._by_request.popitem(last=False)
        self.accepted += 1
        return True

    def hint_for(self, request_id: str, now: float) -> PlacementHint | None:
        hint = self._by_request.get(request_id)
        if hint is None or now - hint.issued_at > self.ttl_s:
            return None
        return hint

    def __len__(self) -> int:
        return len(self._by_request)


class Router:
    """Routes requests by one policy of :data:`POLICY_NAMES`; see the module docstring."""

    def __init__(self, index: IndexView, descriptor: StateDescriptor, *, policy: str = EffectiveGainRouter.name,
                 model: Callable[[], CostModel], execution: Callable[[], ExecutionPolicy],
                 hints: RouteHints | None = None, secret: bytes = b"", dynamo: DynamoCost | None = None,
                 llmd: LlmdScheduler | None = None, rng: random.Random | None = None) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICY_NAMES)}")
        self.index = index
        self.descriptor = descriptor
        self.scope = IdentityScope.of(descriptor)
        self.policy = policy
        self.model = model
        self.execution = execution
        self.hints = hints
        self.dynamo = dynamo or DynamoCost()
        self.llmd = llmd or LlmdScheduler()
        self.rng = rng
        self._keyer = BlockKeyer(self.scope, descriptor.block_size, secret)

    def query(self, request_id: str, candidates: Sequence[WorkerLoad], *, now: float,
              token_ids: Sequence[int] | None = None, keys: Sequence[int] | None = None,
              prompt_tokens: int | None = None) -> PlanQuery:
        """The planner's query for a request given by its token ids, or its canonical keys and length."""
        if (token_ids is None) == (keys is None):
            raise ValueError("give exactly one of token_ids or keys")
        if token_ids is not None:
            keys = self._keyer.keys(token_ids)
            prompt_tokens = len(token_ids)
        elif prompt_tokens is None:
            raise ValueError("prompt_tokens: required with keys")
        return PlanQuery(request_id=request_id, scope=self.scope, descriptor=self.descriptor, keys=tuple(keys),
                         prompt_tokens=prompt_tokens, arrival_at=now,
                         candidates=tuple(sorted(candidates, key=lambda c: c.worker)))

    def select(self, query: PlanQuery, lookup: LookupResult, *, now: float) -> Route:
        """The routing rule's choice (no hints, no evaluation)."""
        if self.policy == EffectiveGainRouter.name:
            return EffectiveGainRouter(self.model(), self.execution()).select(query, lookup, now=now, rng=self.rng)
        rule = self.dynamo if self.policy == DynamoCost.name else self.llmd
        return rule.select(query, lookup, now=now, rng=self.rng)

    def route(self, query: PlanQuery, *, now: float, lookup: LookupResult | None = None) -> RoutingOutcome:
        """Pick the worker for ``query`` and predict its TTFT there."""
        if lookup is None:
            lookup = self.index.lookup(query.scope, query.keys)
        workers = {c.worker for c in query.candidates}
        hint = self.hints.hint_for(query.request_id, now) if self.hints is not None else None
        if hint is not None and hint.worker in workers:
            worker, source, formula, scores = hint.worker, "placement", f"route hint {hint.hint_id}: {hint.reason}", ()
        else:
            chosen = self.select(query, lookup, now=now)
            worker, source, formula, scores = chosen.worker, "policy", chosen.formula, chosen.scores
        prediction = predict(query, lookup, worker, self.model(), self.execution(), now=now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request=%s policy=%s worker=%s source=%s ttft=%s action=%s :: %s", query.request_id,
                      self.policy, worker, source, prediction.ttft_s, prediction.action.value, formula)
        return RoutingOutcome(query.request_id, self.policy, worker, source, prediction, formula, scores)
