"""The options the planner weighs for a request, one small class per kind, each with a pure cost method.

* :class:`RecomputeOn` — recompute the whole prompt on a worker, behind its queue;
* :class:`ReuseInPlace` — reuse the worker's own GPU prefix (full or partial reuse; *route to
  state* when the worker is not the baseline's);
* :class:`MoveOverLink` — copy the missing extent ``[local prefix, source prefix)`` from a source
  over one link (same worker's host or disk, another worker's memory, a remote store), valued as
  a transfer the request waits for, or, when the copy hides entirely behind the worker's queue,
  as a :class:`Prefetch`.

Every EG is measured against the :class:`Baseline`, the fastest recompute, and its variance comes
from the cost model's covariances (:meth:`Baseline.eg_variance`: compute terms shared by both
sides cancel, so only the saved tokens' uncertainty counts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from nexuskv.contracts.decisions import Action
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import CacheTerms, ComputeCost, HardwareProfile, LinkCost, normal_cdf, prefetch_expected_gain
from nexuskv.descriptor import Tier
from nexuskv.planner.sources import Shape, Source, moved_blocks

__all__ = ["Option", "Candidate", "Baseline", "Links", "Request", "RecomputeOn", "ReuseInPlace", "MoveOverLink",
           "Prefetch", "GIB", "SHARED_TIERS", "engine_loads"]

GIB = float(1 << 30)
_RECOMPUTE, _ROUTE_TO_STATE = Action.RECOMPUTE, Action.ROUTE_TO_STATE
_TRANSFER, _PREFETCH = Action.TRANSFER, Action.PREFETCH
_FULL_REUSE, _PARTIAL_REUSE = Action.FULL_REUSE, Action.PARTIAL_REUSE
SHARED_TIERS = frozenset({Tier.REMOTE})  # tiers every worker reads, whoever wrote the blocks


def engine_loads(load: WorkerLoad, source_worker: str, source_tier: Tier) -> bool:
    """Whether ``load``'s engine makes a move from ``source_worker``'s ``source_tier`` itself (its
    connector loads when it schedules the request: no transfer command, no hiding behind the queue):
    its own tiers, and the shared tiers when it reads them."""
    if not load.loads_own_tiers:
        return False
    return source_worker == load.worker or (load.loads_shared_tiers and source_tier in SHARED_TIERS)


class Option(NamedTuple):
    """One option weighed for a request, with every term (seconds) and why it lost, if it did.

    A named tuple rather than a frozen dataclass: the planner builds a dozen per decision and a
    frozen dataclass costs four times as much to build (``benchmarks/bench_planner.py``).
    ``eg_s`` is None for an option that could not be costed (no profile, no backend, unusable).
    """

    action: Action
    worker: str
    source: Source | None = None
    backend: str | None = None
    reused_blocks: int = 0
    moved: tuple[int, ...] = ()  # (start, end) when ``contiguous``, else the moved block indices
    contiguous: bool = True
    nbytes: int = 0
    terms: CacheTerms = CacheTerms()
    tail_s: float | None = None
    ttft_s: float | None = None
    eg_s: float | None = None
    eg_std_s: float = 0.0
    eg_lower_s: float | None = None
    p_use: float | None = None
    deadline_at: float | None = None
    rejected: str | None = None
    # Observations of the least-observed fit this option's estimate rests on (compute, link): what
    # the exploration budget's per-fit cap reads. None for an option that rests on no fit.
    fit_observations: int | None = None

    @property
    def passes_gate(self) -> bool:
        return self.rejected is None and self.action is not Action.RECOMPUTE and self.eg_s is not None


class Request(NamedTuple):
    """The per-plan constants every option's cost reads (the query's size, the policy's knobs, the clock)."""

    tokens: int  # n: prompt tokens
    tokens_sq: float  # n * n
    shape: Shape
    z: float  # confidence multiplier of the EG bound
    prefetch: bool  # prefetch allowed by policy
    p_consume: float
    route_to_state: bool
    pollution_s_per_gib: float  # default displacement price
    prices: Mapping[str, float]  # per worker displacement price, seconds per GiB
    now: float
    slo_deadline: float | None
    dispatch: Mapping[str, float]  # per destination worker: seconds before a commanded copy can start


class Candidate(NamedTuple):
    """A candidate worker, costed: its queue, and what recomputing the prompt there takes."""

    load: WorkerLoad
    profile: str
    hardware: HardwareProfile
    compute: ComputeCost
    c0: float
    c1: float
    c2: float
    queue_s: float
    recompute_s: float
    request_s: float = 0.0  # fixed per-request cost outside the forward pass, in every option's TTFT

    @classmethod
    def of(cls, load: WorkerLoad, profile: str, hw: HardwareProfile, cc: ComputeCost, n: int, nn: float,
           block_bytes: int, request_s: float = 0.0) -> Candidate:
        """``recompute = request + queue + T_compute(n, n) + decode``; the queue is the compute of the
        prefills ahead, ``request`` the fixed per-request cost (HTTP, tokenisation)."""
        c0, c1, c2 = cc.params.mean
        queue_s = c0 * load.queued_prefill_requests + c1 * load.queued_prefill_tokens \
            + c2 * load.queued_prefill_token_products
        decode = hw.decode_seconds(load.decode_blocks, block_bytes, n) if load.decode_blocks else 0.0
        return cls(load, profile, hw, cc, c0, c1, c2, queue_s, request_s + queue_s + c0 + c1 * n + c2 * nn + decode,
                   request_s)

    def tail_s(self, e: int, n: int, block_bytes: int) -> float:
        """Compute left after reusing all but ``e`` of the prompt's ``n`` tokens (with in-flight decode)."""
        tail = self.c0 + self.c1 * e + self.c2 * e * n
        decode_blocks = self.load.decode_blocks
        if decode_blocks:
            tail += self.hardware.decode_seconds(decode_blocks, block_bytes, e)
        return tail


class Baseline(NamedTuple):
    """The fastest recompute among the candidates: the zero of every option's Effective Gain."""

    worker: str
    t_s: float
    compute: ComputeCost
    x0: float  # its compute features: prefills (queued and this one), tokens, token products
    x1: float
    x2: float

    @classmethod
    def of(cls, best: Candidate, n: int, nn: float) -> Baseline:
        load = best.load
        return cls(load.worker, best.recompute_s, best.compute, 1.0 + load.queued_prefill_requests,
                   float(n + load.queued_prefill_tokens), nn + load.queued_prefill_token_products)

    def eg_variance(self, w: Candidate, e: int, n: int) -> float:
        """Variance of ``t_compute - tail`` for an option on ``w`` computing ``e`` tokens (compute terms only).

        On the same compute model both sides' features subtract (the shared terms cancel); on
        different models the two variances add.
        """
        load = w.load
        if w.compute is self.compute:
            return self.compute.params.variance(self.x0 - 1.0 - load.queued_prefill_requests,
                                                self.x1 - e - load.queued_prefill_tokens,
                                                self.x2 - float(e) * n - load.queued_prefill_token_products)
        return self.compute.params.variance(self.x0, self.x1, self.x2) + w.compute.params.variance(
            1.0 + load.queued_prefill_requests, float(e + load.queued_prefill_tokens),
            float(e) * n + load.queued_prefill_token_products)


class Links(NamedTuple):
    """A destination profile's links into GPU, resolved once per cost-model snapshot."""

    in_place: LinkCost | None
    by_tier: dict[Tier, LinkCost | None]  # same worker's host/disk, remote store, object store
    network: LinkCost | None  # another worker's memory
    far_disk: LinkCost | None  # another worker's disk, then the network


class RecomputeOn:
    """Recompute the prompt on ``w``: ``EG = t_compute - recompute(w)`` (0 on the baseline worker)."""

    __slots__ = ()

    @staticmethod
    def cost(w: Candidate, base: Baseline) -> Option:
        eg = base.t_s - w.recompute_s
        return Option(_RECOMPUTE, w.load.worker, terms=CacheTerms(queue_s=w.queue_s, request_s=w.request_s),
                      tail_s=w.recompute_s - w.queue_s - w.request_s, ttft_s=w.recompute_s, eg_s=eg, eg_lower_s=eg)


class ReuseInPlace:
    """Reuse ``w``'s own GPU prefix: ``ttft = lookup + queue + restore + tail``."""

    __slots__ = ()

    @staticmethod
    def cost(req: Request, base: Baseline, w: Candidate, local: Source, links: Links, num_blocks: int) -> Option:
        n, shape = req.tokens, req.shape
        e = n - local.prefix * shape.block_size
        e = e if e > 0 else 1
        tail = w.tail_s(e, n, shape.block_bytes)
        hw = w.hardware
        in_place = links.in_place
        restore = in_place.params.mean[0] if in_place is not None else 0.0
        ttft = w.request_s + hw.lookup_s + w.queue_s + restore + tail
        var = base.eg_variance(w, e, n)
        if in_place is not None:
            var += in_place.params.cov[0][0]
        eg = base.t_s - ttft
        std = math.sqrt(var) if var > 0 else 0.0
        wid = w.load.worker
        if wid != base.worker:
            action = _ROUTE_TO_STATE
            why = None if req.route_to_state else "policy: route to state is off"
        else:
            action = _FULL_REUSE if local.prefix == num_blocks else _PARTIAL_REUSE
            why = None
        seen = w.compute.observations
        if in_place is not None and in_place.observations < seen:
            seen = in_place.observations
        return Option(action, wid, local, None, local.prefix, (), True, 0,
                      CacheTerms(hw.lookup_s, w.queue_s, 0.0, 0.0, restore, 0.0, 0.0, w.request_s),
                      tail, ttft, eg, std, eg - req.z * std, None, None, why, seen)


class Prefetch:
    """A copy hidden entirely behind ``w``'s queue, due before the request starts.

    ``E[G] = P_use*G - (1-P_use)*(T_transfer + C_pollution + C_interference)`` with
    ``P_use = P(transfer done before the consumer starts) * p_consume``; the deadline is when the
    consumer starts (now + overlap).
    """

    __slots__ = ()

    @staticmethod
    def value(req: Request, worker: str, transfer: float, var_t: float, overlap: float, gain: float, var_c: float,
              nbytes: int, interference: float) -> tuple[float, float, float, float, float]:
        """``(eg, std, lower bound, p_use, deadline)`` of the prefetch."""
        sd_t = math.sqrt(var_t) if var_t > 0 else 0.0
        p_ready = normal_cdf((overlap - transfer) / sd_t) if sd_t > 0 else 1.0
        p_use = p_ready * req.p_consume
        pollution = nbytes / GIB * req.prices.get(worker, req.pollution_s_per_gib)
        sd_g = math.sqrt(var_c) if var_c > 0 else 0.0
        eg = prefetch_expected_gain(p_use, gain, transfer, pollution, interference)
        std = p_use * sd_g
        lower = prefetch_expected_gain(p_use, gain - req.z * sd_g, transfer, pollution, interference)
        return eg, std, lower, p_use, req.now + overlap


class MoveOverLink:
    """Copy ``[local prefix, source prefix)`` to ``w``'s GPU over one link, then compute the rest.

    ``ttft = lookup + queue + max(0, transfer - overlap) + restore + sync + interference + tail``,
    where the copy overlaps ``w``'s queue (and, restoring layer by layer, all but the last layer's
    share of the tail). A copy the request waits for is a *transfer*, due by ``now + transfer +
    max(0, gain)``; a hidden one is a :class:`Prefetch`. A request's deadline or TTFT SLO caps
    either deadline (a copy that lands later is useless).
    """

    __slots__ = ()

    @staticmethod
    def cost(req: Request, base: Baseline, w: Candidate, local: Source | None, src: Source, link_tier: Tier,
             link: LinkCost | None, backend: str | None) -> Option:
        load, profile, hw, _, _, _, _, queue_s, _, request_s = w
        wid = load.worker
        if link is None or backend is None:
            why = (f"no cost profile for link {link_tier.value}->gpu on {profile}" if link is None
                   else f"policy: no enabled backend for {link_tier.value}->gpu")
            return Option(_TRANSFER, wid, src, backend, src.prefix, rejected=why)
        by_engine = engine_loads(load, src.worker, src.tier)
        if not by_engine and not load.has_executor:
            return Option(_TRANSFER, wid, src, backend, src.prefix,
                          rejected=f"no transfer executor serves {wid}: its engine loads only its own and shared "
                                   f"tiers, not {src.worker}/{src.tier.value}")
        # One unpacking each instead of a dozen attribute reads: this runs for every source and worker.
        n, _, shape, z, prefetch, _, _, _, _, now, slo, dispatch_by_worker = req
        bs, block_bytes, checkpoint_bytes, pages_per_block, _, _, _, layers, restore_fixed, restore_per_token = shape
        prefix = src.prefix
        local_prefix = local.prefix if local is not None else 0
        if local is not None and local.extents:
            moved, contiguous = moved_blocks(local_prefix, prefix, local.extents)
            count = len(moved) if not contiguous else prefix - local_prefix
        else:
            moved, contiguous, count = (local_prefix, prefix), True, prefix - local_prefix
        nbytes = count * block_bytes + checkpoint_bytes
        pages = count * pages_per_block
        lp = link.params
        # A copy an executor makes starts once its command reached it (the bus, the executor's queue);
        # an engine loading its own tier starts it itself. The transfer term is delivery plus copy.
        dispatch = 0.0 if by_engine else dispatch_by_worker.get(wid, 0.0)
        transfer = dispatch + lp.predict(1.0, pages, nbytes)
        var_t = lp.variance(1.0, pages, nbytes)
        e = n - prefix * bs
        e = e if e > 0 else 1
        tail = w.tail_s(e, n, block_bytes)
        layered = tail * (layers - 1) / layers if layers > 1 else 0.0
        # An engine that loads its own tiers starts the copy when the request leaves its queue.
        overlap = layered if by_engine else queue_s + layered
        interference = transfer * link.interference
        restore = restore_fixed + restore_per_token * count * bs
        visible = transfer - overlap if transfer > overlap else 0.0
        ttft = request_s + hw.lookup_s + queue_s + visible + restore + hw.sync_s + interference + tail
        gain = base.t_s - ttft
        var_c = base.eg_variance(w, e, n)
        if visible == 0.0 and overlap > 0 and prefetch:  # hidden behind the queue: a prefetch
            action = _PREFETCH
            eg, std, lower, p_use, deadline = Prefetch.value(req, wid, transfer, var_t, overlap, gain, var_c, nbytes,
                                                             interference)
        else:
            action, p_use = _TRANSFER, None
            var = var_c + var_t * (1.0 + link.interference) ** 2
            std = math.sqrt(var) if var > 0 else 0.0
            eg, lower = gain, gain - z * std
            deadline = now + transfer + (gain if gain > 0 else 0.0)
        if slo is not None and slo < deadline:
            deadline = slo
        seen = w.compute.observations
        return Option(action, wid, src, backend, prefix, moved, contiguous, nbytes,
                      CacheTerms(hw.lookup_s, queue_s, transfer, overlap, restore, hw.sync_s, interference, request_s),
                      tail, ttft, eg, std, lower, p_use, deadline, None,
                      min(seen, link.observations))
