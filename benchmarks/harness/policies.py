"""The policies compared side by side, and NexusKV with one mechanism switched off for each ablation.

Each policy is a small class whose ``decide(admission)`` returns a :class:`~.paths.Choice`; the
simulator prices and carries it out with the true costs. What a policy may read is what its real
counterpart reads: the index's lookup (a replica that lags the engines by the event delay), the
workers' reported loads, and — for the engine's own connector — the engine's own tiers.

* ``recompute`` — external reuse disabled and engine prefix caching off; the load balancer's worker.
* ``engine-lru`` — engine-native prefix caching (GPU only, LRU), no cache-aware routing.
* ``hit-driven`` — every tier; the load balancer's worker loads the longest prefix the index
  shows anywhere (peer memory, peer disk, the store), always, whatever it costs.
* ``dynamo`` / ``llm-d`` — their routers (:class:`~nexuskv.routing_policies.DynamoCost`,
  :class:`~nexuskv.routing_policies.LlmdScheduler`) pick the worker; that worker's connector then loads,
  always, the longest prefix its own host and disk or the shared store hold (LMCache's lookup order
  host, disk, remote; KVBM's G2, G3, G4). Neither pulls from a peer's memory.
* ``nexuskv`` — :func:`nexuskv.planner.plan` on the index's lookup and the believed cost model,
  budgets from a real :class:`~nexuskv.planner.prefetch.PrefetchScheduler`, the believed model refitted
  online from the run's prefill and copy observations by the calibration agent's own
  :class:`~streams.calibration_agent.CalibrationWorker` (its cadence, on simulated time).
* ``oracle`` — :func:`.oracle.best_path`: true costs, true state; its decision time is not counted.

The load balancer of the non-cache-aware policies (:func:`.simulator.balance`) sends a request to
the worker reporting the fewest queued prefill tokens — the information every router here has.
``recompute`` on that worker is the reference of Effective Gain: its EG is 0 by construction.

Ablations (whitepaper §10.4) are NexusKV with one switch off (:data:`ABLATIONS`). Where the
planner has a switch (``planner.prefetch``, ``p_consume``, budgets, the cost model it is given,
the candidates it is asked about) it is used; mechanisms the planner has no switch for (the copy
starting at admission, deadline fallback, identity) are switched in the simulated data plane.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

from nexuskv.calibration import Calibrator, apply_entry
from nexuskv.config import Settings
from nexuskv.contracts.observations import ObservationRecord, PrefillObservation, TransferObservation
from nexuskv.contracts.transfers import TransferResult, TransferStatus
from nexuskv.cost import CostModel, LinearCost
from nexuskv.descriptor import Tier
from nexuskv.planner import Plan, PlanQuery, plan
from nexuskv.planner.prefetch import PrefetchFallback, PrefetchScheduler
from nexuskv.policy import ExecutionPolicy, PlannerSettings
from nexuskv.profiles import shipped_cost_model
from nexuskv.routing_policies import DynamoCost, LlmdScheduler
from streams.calibration_agent import CalibrationWorker

from benchmarks.harness.cluster import STORE
from benchmarks.harness.paths import Choice, ExecMode, Move, Outcome, Place
from benchmarks.harness.state import Admission, ClusterState

__all__ = ["Policy", "BASELINES", "ABLATIONS", "POLICY_NOTES", "make_policy", "NexusOptions", "strip_interference",
           "certain_links"]

BASELINES = ("recompute", "engine-lru", "hit-driven", "dynamo", "llm-d", "nexuskv", "oracle")


class Policy(ABC):
    """A policy under test. Subclasses set the class attributes and implement :meth:`decide`."""

    name = "policy"
    tiers = "all"  # the data plane's tiers in its runs (state.TIER_SETS)
    identity = "full"  # how its index keys state (state.IDENTITIES)
    layerwise = True  # the state restores layer by layer (overlapping the prefill)
    eviction = "lru"  # how its host, disk and store tiers evict and admit (state.EVICTIONS)
    tier_admission = True  # with utility eviction: a full tier admits only what is worth more
    timed = True  # its decision time is on the request's critical path
    mode = ExecMode()

    def bind(self, state: ClusterState) -> None:
        self.state = state

    def admitted(self, now: float) -> None:
        """Called before each decision (time moved to ``now``)."""

    @abstractmethod
    def decide(self, adm: Admission) -> Choice:
        """Where the request runs and what is copied for it."""

    def decided(self, adm: Admission, choice: Choice, outcome: Outcome) -> None:
        """Called once the choice is carried out (completion hooks go on ``self.state.at``); the
        outcome is as priced at admission: a parked request's slot is not final yet."""

    def finished(self, adm: Admission, choice: Choice, outcome: Outcome) -> None:
        """Called when the request has taken its slot: ``outcome`` is final."""

    def counters(self) -> dict[str, int]:
        return {}

    def store_records(self) -> dict[str, list]:
        """What the policy's run would have put on the decision store's topics (decisions, transfer
        results, observations); empty for the policies that keep no decision record."""
        return {}


def query(adm: Admission, candidates: tuple | None = None) -> PlanQuery:
    """The planner's view of the request (the same one the routers read)."""
    return PlanQuery(request_id=adm.request_id, scope=adm.scope, descriptor=adm.descriptor, keys=tuple(adm.keys),
                     prompt_tokens=adm.prompt_tokens, arrival_at=adm.now, candidates=candidates or adm.loads,
                     workload=adm.workload)


# -- baselines ----------------------------------------------------------------------------------------

class Recompute(Policy):
    name = "recompute"
    tiers = "none"
    timed = False  # no lookup, no plan: this is the system without external reuse
    mode = ExecMode(local_reuse=False)

    def decide(self, adm: Admission) -> Choice:
        return Choice(adm.baseline_worker, action="recompute", predicted_eg_s=0.0)


class EngineLru(Policy):
    name = "engine-lru"
    tiers = "gpu"
    timed = False  # the engine's own prefix-cache lookup is part of its scheduling, not added here

    def decide(self, adm: Admission) -> Choice:
        local = adm.prefixes.get(Place(adm.baseline_worker, Tier.GPU), 0)
        return Choice(adm.baseline_worker, action="reuse" if local else "recompute")


#: Where an index location is, for copying; faster tiers first on equal prefixes.
_TIER_ORDER = {Tier.GPU: 0, Tier.HOST: 1, Tier.DISK: 3, Tier.REMOTE: 2, Tier.OBJECT: 4}


class HitDriven(Policy):
    name = "hit-driven"

    def decide(self, adm: Admission) -> Choice:
        w = adm.baseline_worker
        lookup = adm.lookup()
        local = 0
        best: tuple | None = None
        for m in lookup.matches:
            if not m.certain or m.prefix_blocks == 0:
                continue
            place = Place(m.location.worker, m.location.tier)
            if place == Place(w, Tier.GPU):
                local = m.prefix_blocks
                continue
            rank = (-m.prefix_blocks, m.location.worker != w, _TIER_ORDER[m.location.tier], m.location.worker)
            if best is None or rank < best[0]:
                best = (rank, place, m.prefix_blocks)
        if best is None or best[2] <= local:
            return Choice(w, action="reuse" if local else "recompute")
        _rank, place, prefix = best
        return Choice(w, Move(place, local, prefix, prefix - local), action="load")


def _connector_load(adm: Admission, worker: str) -> Choice:
    """What an engine connector (LMCache, KVBM) loads on ``worker``: the longest prefix among its own
    host and disk and the shared store (first in that order on ties), whatever it costs."""
    local = adm.prefixes.get(Place(worker, Tier.GPU), 0)
    best, where = local, None
    for place in (Place(worker, Tier.HOST), Place(worker, Tier.DISK), Place(STORE, Tier.REMOTE)):
        p = adm.prefixes.get(place, 0)
        if p > best:
            best, where = p, place
    if where is None:
        return Choice(worker, action="reuse" if local else "recompute")
    return Choice(worker, Move(where, local, best, best - local), action="load")


class Routed(Policy):
    """A router of :mod:`nexuskv.routing_policies` picks the worker; its connector loads what it holds."""

    def __init__(self, router: DynamoCost | LlmdScheduler) -> None:
        self.router = router
        self.name = router.name

    def decide(self, adm: Admission) -> Choice:
        route = self.router.select(query(adm), adm.lookup(), now=adm.now)
        return _connector_load(adm, route.worker)


class Oracle(Policy):
    name = "oracle"
    timed = False  # an upper bound: knowing the future costs is not a computation anyone can run

    def decide(self, adm: Admission) -> Choice:
        assert adm.oracle is not None
        return adm.oracle[0]


# -- NexusKV ------------------------------------------------------------------------------------------

def strip_interference(model: CostModel) -> CostModel:
    """``model`` believing that copies and decode interfere with nothing."""
    hardware = [replace(h, hbm_bytes_per_s=math.inf) for h in model.hardware.values()]
    links = [replace(lk, interference=0.0) for lk in model.links.values()]
    return CostModel.build(model.base + "-no-interference", hardware, model.compute.values(), links)


def certain_links(model: CostModel) -> CostModel:
    """``model`` taking every link's cost as exactly known (a ready prefetch is surely used)."""
    links = [replace(lk, params=LinearCost(lk.params.mean)) for lk in model.links.values()]
    return CostModel.build(model.base + "-certain-links", model.hardware.values(), model.compute.values(), links)


@dataclass(frozen=True, slots=True)
class NexusOptions:
    """NexusKV's switches; every default is on (the ablations turn one off)."""

    calibrate: bool = True  # refit the believed cost model online from the run's observations
    routing: bool = True  # cache-aware routing: every worker is a candidate (off: the balancer's only)
    cost_gate: bool = True  # reuse by Effective Gain (off: the option reusing most, whatever its EG)
    budgets: bool = True  # transfer budgets and backpressure (PrefetchScheduler.headroom)
    prefetch: bool = True  # planner.prefetch
    interference: bool = True  # the believed model charges copy and decode interference
    reuse_probability: bool = True  # P_use of a prefetch from the link's uncertainty and p_consume
    eviction_utility: bool = True  # host, disk and store tiers evict by utility per byte (off: LRU)
    tier_admission: bool = True  # a full tier admits only state worth more than its cheapest (off: all)


_OBSERVED_TIER = {"host": Tier.HOST, "disk": Tier.DISK, "net": Tier.REMOTE, "store": Tier.REMOTE}


class NexusKV(Policy):
    name = "nexuskv"

    def __init__(self, options: NexusOptions, profile: str, *, name: str = "nexuskv", identity: str = "full",
                 layerwise: bool = True, mode: ExecMode = ExecMode(), keep_records: bool = False) -> None:
        self.name = name
        self.options = options
        self.identity = identity
        self.eviction = "utility" if options.eviction_utility else "lru"
        self.tier_admission = options.tier_admission  # (LRU tiers admit everything whatever this says)
        self.layerwise = layerwise
        self.mode = mode
        settings = PlannerSettings(default_hardware_profile=profile, prefetch=options.prefetch,
                                   p_consume=0.98 if options.reuse_probability else 1.0)
        self.policy = ExecutionPolicy(version="harness-1", planner=settings)
        self.scheduler = PrefetchScheduler(self.policy)
        base = shipped_cost_model()
        self.profile = profile
        self._now = 0.0
        self.calibration: CalibrationWorker | None = None
        if options.calibrate:
            # The calibration agent's own worker and cadence (NEXUSKV_CALIBRATION_* defaults), on
            # simulated time: entries with 20+ observations, at most one per fit per second.
            s = Settings()
            self.calibration = CalibrationWorker(
                Calibrator(base, default_profile=profile, forgetting=s.calibration_forgetting),
                min_observations=s.calibration_min_observations, publish_s=s.calibration_publish_s,
                publisher="harness-calibrator", clock=lambda: self._now)
        self._fitted = base
        self.model = self._believe(base)
        self._plan: Plan | None = None
        # The records the pipeline's decision sink would store for this run; only when asked (one
        # run's worth is written to DuckDB, and holding them costs memory and collector time).
        self._records: dict[str, list] | None = (
            {"decisions": [], "results": [], "observations": []} if keep_records else None)
        self.count = {"scheduler_fallbacks": 0, "fits_applied": 0, "budget_refusals": 0, "negative_eg_choices": 0}

    def _believe(self, fitted: CostModel) -> CostModel:
        model = fitted
        if not self.options.interference:
            model = strip_interference(model)
        if not self.options.reuse_probability:
            model = certain_links(model)
        return model

    def admitted(self, now: float) -> None:
        self._now = now
        self._publish_due()
        for effect in self.scheduler.tick(now=now):
            if isinstance(effect, PrefetchFallback):
                self.count["scheduler_fallbacks"] += 1

    def decide(self, adm: Admission) -> Choice:
        candidates = None
        if not self.options.routing:
            candidates = tuple(c for c in adm.loads if c.worker == adm.baseline_worker)
        q = query(adm, candidates)
        headroom = self.scheduler.headroom(q.scope.tenant_namespace) if self.options.budgets else None
        p = plan(q, adm.lookup(), self.model, self.policy, now=adm.now, headroom=headroom)
        if not self.options.cost_gate:
            p = _most_reuse(p)
        if p.transfers:
            self.scheduler.track(p, now=adm.now)
        else:
            _ = p.hints  # the route hint a router acts on: built on the decision path
        self._plan = p
        return _choice(p)

    def decided(self, adm: Admission, choice: Choice, outcome: Outcome) -> None:
        p = self._plan
        if p is None:
            return
        if any(o.rejected is not None and o.rejected.startswith("backpressure") for o in p.options):
            self.count["budget_refusals"] += 1
        if p.chosen.eg_s is not None and p.chosen.eg_s < 0:
            self.count["negative_eg_choices"] += 1
        if self._records is not None:
            self._records["decisions"].append(p.decision)  # built after the timed decision
        if p.transfers and outcome.copy_end is not None and outcome.copy_status != "abandoned":
            self.state.at(outcome.copy_end, lambda: self._copy_done(p, outcome))

    def finished(self, adm: Admission, choice: Choice, outcome: Outcome) -> None:
        if self._records is not None:
            # What the engine reports: the whole prefill job's time and the request's wait for it.
            seen = PrefillObservation(model=adm.descriptor.model, profile=self.profile, worker=choice.worker,
                                      uncached_tokens=outcome.uncached_tokens, context_tokens=adm.prompt_tokens,
                                      duration_s=outcome.prefill_s, queued_s=outcome.queue_s)
            self._records["observations"].append(
                (ObservationRecord(observed_at=outcome.end, request_id=adm.request_id, observation=seen),
                 f"{adm.request_id}/prefill"))
        if self.calibration is not None and outcome.uncached_tokens > 0:
            obs = PrefillObservation(model=adm.descriptor.model, profile=self.profile, worker=choice.worker,
                                     uncached_tokens=outcome.uncached_tokens, context_tokens=adm.prompt_tokens,
                                     duration_s=outcome.compute_s)
            self.state.at(outcome.end, lambda: self._observe(obs, outcome.end))

    def _copy_done(self, p: Plan, o: Outcome) -> None:
        done = o.copy_status == "completed"
        for cmd in p.transfers:
            result = TransferResult(
                transfer_id=cmd.transfer_id, request_id=cmd.request_id,
                status=TransferStatus.COMPLETED if done else TransferStatus.NOT_FOUND,
                source=cmd.source, destination=cmd.destination, blocks_moved=len(cmd.keys) if done else 0,
                bytes_moved=cmd.bytes if done else 0, started_at=o.copy_start, finished_at=o.copy_end,
                error=None if done else "simulated: the source no longer holds the blocks")
            if self._records is not None:
                self._records["results"].append(result)
            for effect in self.scheduler.complete(result, now=o.copy_end):
                if isinstance(effect, PrefetchFallback):
                    self.count["scheduler_fallbacks"] += 1
        kind = o.link
        if done and kind in _OBSERVED_TIER and (self.calibration is not None or self._records is not None):
            obs = TransferObservation(source_tier=_OBSERVED_TIER[kind], destination_tier=Tier.GPU,
                                      backend=p.chosen.backend or kind, worker=p.chosen.worker, bytes=o.moved_bytes,
                                      pages=o.moved_blocks * len(p.query.descriptor.layer_groups),
                                      duration_s=o.transfer_s)
            if self._records is not None:
                self._records["observations"].append(
                    (ObservationRecord(observed_at=o.copy_end, request_id=p.query.request_id, observation=obs),
                     f"{p.query.request_id}/transfer"))
            if self.calibration is not None:
                self._observe(obs, o.copy_end)

    def _observe(self, observation: PrefillObservation | TransferObservation, at: float) -> None:
        self._now = at
        self.calibration.fold(ObservationRecord(observed_at=at, observation=observation))  # type: ignore[union-attr]
        self._publish_due()

    def _publish_due(self) -> None:
        """Fold every fit the calibration worker would publish now into the believed model."""
        if self.calibration is None:
            return
        for key in self.calibration.due():
            self._fitted = apply_entry(self._fitted, self.calibration.publish(key))
            self.model = self._believe(self._fitted)
            self.count["fits_applied"] += 1

    def counters(self) -> dict[str, int]:
        return dict(self.count)

    def store_records(self) -> dict[str, list]:
        return dict(self._records) if self._records is not None else {}


def _most_reuse(p: Plan) -> Plan:
    """The plan acting on the usable option that reuses the most blocks, whatever its EG."""
    usable = [o for o in p.options if o.rejected is None and o.eg_s is not None and o.action.value != "recompute"
              and o.reused_blocks > 0]
    if not usable:
        return p
    pick = max(usable, key=lambda o: (o.reused_blocks, o.eg_s, o.worker))
    return dataclasses.replace(p, chosen=pick)


def _choice(p: Plan) -> Choice:
    c = p.chosen
    move = None
    if c.action.value in ("transfer", "prefetch") and c.source is not None:
        if c.contiguous:
            start, end = c.moved
            count = end - start
        else:
            start, end, count = c.moved[0], c.moved[-1] + 1, len(c.moved)
        move = Move(Place(c.source.worker, c.source.tier), start, end, count)
    return Choice(c.worker, move, action=c.action.value, predicted_eg_s=c.eg_s, deadline_at=c.deadline_at)


# -- registry -----------------------------------------------------------------------------------------

#: Ablation name -> (what is switched off, how). Each is NexusKV with exactly that one change.
ABLATIONS: dict[str, str] = {
    "no-semantic-validation": "the index keys state by tokens alone (no tenant, adapter): identity is not checked",
    "no-cost-based-reuse": "the planner's usable option that reuses the most blocks is taken, whatever its EG",
    "no-transfer-overlap": "state restores whole before the prefill starts (descriptor layerwise=false, planner "
                           "and data plane)",
    "no-async-prefetch": "a copy starts when the engine schedules the request, not at admission; "
                         "planner.prefetch=false (the planner still credits queue overlap: it has no switch for it)",
    "no-cache-aware-routing": "the planner is asked about the load balancer's worker only",
    "no-interference-cost": "the believed cost model charges no copy or decode interference",
    "no-reuse-probability": "P_use = 1: p_consume=1 and link costs taken as certain",
    "no-admission-budgets": "no transfer budgets: the planner gets no headroom to respect",
    "no-eviction-utility": "host, disk and store tiers evict least recently used first and admit everything "
                           "(what every other policy's tiers do)",
    "no-tier-admission": "tiers evict by utility but admit every offload and write, worth it or not",
    "no-fallback": "a late copy is waited for instead of abandoned at its deadline",
    "no-calibration": "the believed cost model stays the shipped one (no online fit)",
}

POLICY_NOTES: dict[str, str] = {
    "recompute": "no external reuse, engine prefix caching off, load balancer (EG reference)",
    "engine-lru": "engine-native GPU prefix cache (LRU), load balancer",
    "hit-driven": "load balancer; always loads the longest prefix the index shows anywhere",
    "dynamo": "Dynamo KV-router cost formula; connector loads own host/disk/store prefix",
    "llm-d": "llm-d prefix 3 : kv 2 : queue 2 scorer; connector loads own host/disk/store prefix",
    "nexuskv": "nexuskv.planner.plan on the index replica, believed cost model calibrated online",
    "oracle": "true costs and state, best path per request (per-decision upper bound)",
}


def make_policy(name: str, profile: str, *, keep_records: bool = False) -> Policy:
    """A fresh policy (policies hold run state: build one per run). ``keep_records``: NexusKV keeps
    the records the decision sink would store (:meth:`Policy.store_records`)."""
    simple: dict[str, Callable[[], Policy]] = {"recompute": Recompute, "engine-lru": EngineLru,
                                               "hit-driven": HitDriven, "dynamo": lambda: Routed(DynamoCost()),
                                               "llm-d": lambda: Routed(LlmdScheduler()), "oracle": Oracle}
    if name in simple:
        return simple[name]()
    if name == "nexuskv":
        return NexusKV(NexusOptions(), profile, keep_records=keep_records)
    if name not in ABLATIONS:
        raise ValueError(f"policy: {name!r} is not one of {BASELINES + tuple(ABLATIONS)}")
    o = NexusOptions()
    kwargs: dict = {}
    if name == "no-semantic-validation":
        kwargs["identity"] = "tokens"
    elif name == "no-cost-based-reuse":
        o = replace(o, cost_gate=False)
    elif name == "no-transfer-overlap":
        kwargs["layerwise"] = False
    elif name == "no-async-prefetch":
        o = replace(o, prefetch=False)
        kwargs["mode"] = ExecMode(async_copy=False)
    elif name == "no-cache-aware-routing":
        o = replace(o, routing=False)
    elif name == "no-interference-cost":
        o = replace(o, interference=False)
    elif name == "no-reuse-probability":
        o = replace(o, reuse_probability=False)
    elif name == "no-admission-budgets":
        o = replace(o, budgets=False)
    elif name == "no-eviction-utility":
        o = replace(o, eviction_utility=False)
    elif name == "no-tier-admission":
        o = replace(o, tier_admission=False)
    elif name == "no-fallback":
        kwargs["mode"] = ExecMode(fallback=False)
    elif name == "no-calibration":
        o = replace(o, calibrate=False)
    return NexusKV(o, profile, name=name, **kwargs)
