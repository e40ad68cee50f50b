"""Routing policies to compare with: Dynamo's cost formula, llm-d's scorer, and NexusKV's EG.

Each policy is a small frozen class with one pure method, ``select(query, lookup, *, now, rng)``,
returning a :class:`Route` (the worker, every candidate's score, and the chosen one's formula with
its numbers). They read the same inputs as the planner — a :class:`~nexuskv.planner.PlanQuery`
and the index's :class:`~nexuskv.lookup.LookupResult` — so a harness can run all of them on one
trace. Like Dynamo's selectors, they only say where a request should go.

* :class:`DynamoCost` — NVIDIA Dynamo's KV router (``../shared/reference/engines.md`` §6.1,
  v1.2+): ``logit = prefill_load_scale * max(0, raw_prefill_blocks - overlap_credit_blocks)
  + decode_blocks + decode_active_request_weight * active_requests`` with
  ``overlap_credit_blocks = credit * decay * device_overlap + host_weight * host_overlap
  + disk_weight * disk_overlap + shared_multiplier * shared_hits_beyond_device`` and
  ``decay = 1 / (1 + credit_decay * excess_active_prefill_blocks / request_blocks)``; lowest wins;
  temperature > 0 samples a softmax of the negated min-max-normalised logits.
  Where Dynamo's inputs have no exact counterpart here: ``raw_prefill_blocks`` is the request's
  blocks plus the worker's queued prefill tokens in blocks, which also stand for
  ``excess_active_prefill_blocks``; each tier's overlap is the prefix it adds beyond the faster
  tiers; the shared pool is the longest ``remote`` prefix anywhere; ties go to the smaller worker
  name (Dynamo breaks them by radix-tree size, which the lookup does not carry). Dynamo has no
  notion of uncertain publishers, so neither does this policy.
* :class:`LlmdScheduler` — llm-d's EPP: the ``LongestPrefix`` prefix-cache scorer (walk blocks
  from 0 while a pod holds every one; each block scores its best tier weight, gpu 1.0 and cpu 0.8
  by default; other tiers are not in llm-d's default backend config and do not count) combined
  with a queue scorer and a KV-cache scorer by weights 3 : 2 : 2 (``engines.md`` §5). Each scorer
  is normalised to [0, 1] across the candidates: prefix by the best pod, queue and KV load by
  min-max (the KV-utilisation capacity is not in a plan request, so decode blocks stand for it).
* :class:`EffectiveGainRouter` — NexusKV: the worker of the planner's decision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nexuskv.cost import CostModel
from nexuskv.descriptor import Tier
from nexuskv.lookup import LocationMatch, LookupResult
from nexuskv.planner import PlanQuery, plan
from nexuskv.policy import ExecutionPolicy

__all__ = ["Route", "DynamoCost", "LlmdScheduler", "EffectiveGainRouter", "ROUTING_POLICIES",
           "tier_prefixes", "weighted_consecutive_prefix"]


@dataclass(frozen=True, slots=True)
class Route:
    """Where a policy sends the request, with every candidate's score and the winning formula."""

    policy: str
    worker: str
    scores: tuple[tuple[str, float], ...]  # (worker, score) in candidate order
    lower_is_better: bool
    formula: str


def tier_prefixes(lookup: LookupResult, worker: str) -> dict[Tier, int]:
    """Longest prefix (blocks from 0) per tier at ``worker`` over every KV group it reports.

    A tier's prefix is the shortest over its groups (every group is needed), as the planner reads it.
    """
    per_tier: dict[Tier, list[int]] = {}
    for m in lookup.matches:
        if m.location.worker == worker:
            per_tier.setdefault(m.location.tier, []).append(m.prefix_blocks)
    return {t: min(v) for t, v in per_tier.items()}


def _pick(name: str, scores: list[tuple[str, float]], *, lower: bool, temperature: float,
          rng: random.Random | None) -> str:
    if temperature <= 0 or len(scores) == 1:
        best = min(scores, key=lambda ws: ((ws[1] if lower else -ws[1]), ws[0]))
        return best[0]
    if rng is None:
        raise ValueError(f"{name}: temperature > 0 samples; pass rng (randomness is an input)")
    values = [s for _w, s in scores]
    lo, hi = min(values), max(values)
    span = hi - lo
    norm = [((v - lo) / span if span else 0.0) for v in values]
    logits = [(-x if lower else x) / temperature for x in norm]
    top = max(logits)
    weights = [math.exp(v - top) for v in logits]
    return rng.choices([w for w, _s in scores], weights=weights, k=1)[0]


@dataclass(frozen=True, slots=True)
class DynamoCost:
    """Dynamo's KV-router cost (flags and defaults as in engines.md §6.1)."""

    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.5
    decode_active_request_weight: float = 0.0
    temperature: float = 0.0

    name = "dynamo"

    def logits(self, query: PlanQuery, lookup: LookupResult) -> list[tuple[str, float, str]]:
        """``(worker, logit, formula with numbers)`` per candidate."""
        bs = query.descriptor.block_size
        request_blocks = max(1, -(-query.prompt_tokens // bs))
        shared = max((m.prefix_blocks for m in lookup.matches if m.location.tier is Tier.REMOTE), default=0)
        out = []
        for c in query.candidates:
            pre = tier_prefixes(lookup, c.worker)
            device = pre.get(Tier.GPU, 0)
            host = max(0, pre.get(Tier.HOST, 0) - device)
            disk = max(0, pre.get(Tier.DISK, 0) - max(device, pre.get(Tier.HOST, 0)))
            shared_beyond = max(0, shared - device)
            active = c.queued_prefill_tokens / bs
            raw = request_blocks + active
            decay = 1.0 / (1.0 + self.overlap_score_credit_decay * active / request_blocks)
            credit = (self.overlap_score_credit * decay * device + self.host_cache_hit_weight * host
                      + self.disk_cache_hit_weight * disk + self.shared_cache_multiplier * shared_beyond)
            logit = (self.prefill_load_scale * max(0.0, raw - credit) + c.decode_blocks
                     + self.decode_active_request_weight * c.active_requests)
            formula = (f"{c.worker}: logit {logit:.1f} = {self.prefill_load_scale} * max(0, raw {raw:.1f} - credit "
                       f"{credit:.1f} [{self.overlap_score_credit}*{decay:.3f}*device {device} + "
                       f"{self.host_cache_hit_weight}*host {host} + {self.disk_cache_hit_weight}*disk {disk} + "
                       f"{self.shared_cache_multiplier}*shared {shared_beyond}]) + decode {c.decode_blocks} + "
                       f"{self.decode_active_request_weight}*active {c.active_requests}")
            out.append((c.worker, logit, formula))
        return out

    def select(self, query: PlanQuery, lookup: LookupResult, *, now: float = 0.0,
               rng: random.Random | None = None) -> Route:
        rows = self.logits(query, lookup)
        scores = [(w, s) for w, s, _f in rows]
        worker = _pick(self.name, scores, lower=True, temperature=self.temperature, rng=rng)
        formula = next(f for w, _s, f in rows if w == worker)
        return Route(self.name, worker, tuple(scores), True, formula)


def weighted_consecutive_prefix(matches: list[LocationMatch], weights: Mapping[Tier, float],
                                num_blocks: int) -> float:
    """llm-d's LongestPrefix score of one pod: blocks from 0 while some weighted tier holds each,
    each block counting its best tier weight."""
    runs: list[tuple[int, int, float]] = []  # (start, end, weight) of every weighted run
    for m in matches:
        w = weights.get(m.location.tier)
        if not w:
            continue
        if m.prefix_blocks:
            runs.append((0, min(m.prefix_blocks, num_blocks), w))
        runs.extend((e.start, min(e.end, num_blocks), w) for e in m.extents)
    score, pos = 0.0, 0
    while pos < num_blocks:
        here = [(end, w) for start, end, w in runs if start <= pos < end]
        if not here:
            break
        best = max(w for _e, w in here)
        # advance to the next point where the set of covering runs changes
        nxt = min([end for end, _w in here] + [s for s, _e, _w in runs if pos < s])
        score += best * (nxt - pos)
        pos = nxt
    return score


@dataclass(frozen=True, slots=True)
class LlmdScheduler:
    """llm-d's EPP scoring: prefix-cache 3 : kv-cache 2 : queue 2, highest wins."""

    prefix_weight: float = 3.0
    kv_cache_weight: float = 2.0
    queue_weight: float = 2.0
    tier_weights: Mapping[Tier, float] = field(
        default_factory=lambda: MappingProxyType({Tier.GPU: 1.0, Tier.HOST: 0.8}))

    name = "llm-d"

    def select(self, query: PlanQuery, lookup: LookupResult, *, now: float = 0.0,
               rng: random.Random | None = None) -> Route:
        num_blocks = len(query.keys)
        prefix = {c.worker: weighted_consecutive_prefix(
            [m for m in lookup.matches if m.location.worker == c.worker], self.tier_weights, num_blocks)
            for c in query.candidates}
        best_prefix = max(prefix.values())
        queue = {c.worker: c.queued_prefill_tokens for c in query.candidates}
        kv = {c.worker: c.decode_blocks for c in query.candidates}

        def minmax_low(values: dict[str, int], w: str) -> float:
            lo, hi = min(values.values()), max(values.values())
            return 1.0 if hi == lo else (hi - values[w]) / (hi - lo)

        rows = []
        for c in query.candidates:
            p = prefix[c.worker] / best_prefix if best_prefix else 0.0
            qs, ks = minmax_low(queue, c.worker), minmax_low(kv, c.worker)
            score = self.prefix_weight * p + self.kv_cache_weight * ks + self.queue_weight * qs
            rows.append((c.worker, score, f"{c.worker}: score {score:.3f} = {self.prefix_weight}*prefix {p:.3f} "
                                          f"(weighted {prefix[c.worker]:.1f} blocks) + {self.kv_cache_weight}*kv "
                                          f"{ks:.3f} + {self.queue_weight}*queue {qs:.3f}"))
        scores = [(w, s) for w, s, _f in rows]
        worker = _pick(self.name, scores, lower=False, temperature=0.0, rng=rng)
        return Route(self.name, worker, tuple(scores), False, next(f for w, _s, f in rows if w == worker))


@dataclass(frozen=True, slots=True)
class EffectiveGainRouter:
    """NexusKV: where the planner's decision runs the request (score: each worker's best EG)."""

    model: CostModel
    policy: ExecutionPolicy

    name = "nexuskv"

    def select(self, query: PlanQuery, lookup: LookupResult, *, now: float = 0.0,
               rng: random.Random | None = None) -> Route:
        p = plan(query, lookup, self.model, self.policy, now=now)
        best: dict[str, float] = {}
        for o in p.options:
            if o.eg_s is not None and o.rejected is None:
                best[o.worker] = max(best.get(o.worker, -math.inf), o.eg_s)
        scores = tuple((c.worker, best.get(c.worker, -math.inf)) for c in query.candidates)
        return Route(self.name, p.worker, scores, False, p.decision.reason)


ROUTING_POLICIES: Mapping[str, type] = MappingProxyType({
    DynamoCost.name: DynamoCost, LlmdScheduler.name: LlmdScheduler, EffectiveGainRouter.name: EffectiveGainRouter,
})
