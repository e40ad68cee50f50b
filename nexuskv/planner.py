"""The planner: reuse, route to the state, move it, prefetch it, or recompute — by Effective Gain.

``plan(query, lookup, model, policy, now=...)`` is a pure function of its snapshots (the query,
the index's :class:`~nexuskv.lookup.LookupResult`, a :class:`~nexuskv.cost.CostModel`, the
:class:`~nexuskv.policy.ExecutionPolicy`, the prefetch budgets' :class:`Headroom`) and the time
passed in. It returns a :class:`Plan`: the frozen :class:`~nexuskv.contracts.decisions.Decision`,
the placement hints and the transfer commands that carry it out.

How it decides (whitepaper §2.5-2.7, §7.2-7.4):

1. **Baseline.** For each candidate worker ``w``: ``recompute(w) = queue(w) + T_compute(n, n) +
   decode(w, n)``, with ``queue(w) = c0 * queued_prefill_requests + c1 * queued_prefill_tokens +
   c2 * queued_prefill_token_products`` (the compute of the prefills ahead; the two other terms are
   0 when the engine reports tokens only) and ``decode`` the time in-flight
   decode steals from the prefill (:meth:`~nexuskv.cost.HardwareProfile.decode_seconds`). The
   baseline ``t_compute_s`` is the fastest of these: the best the request can do without reuse.
2. **Candidates.** Index matches are grouped per (worker, tier); a location is usable only if
   every KV group of the descriptor is present there, *certain* (an uncertain publisher is a
   miss), its tier an allowed source, and its prefix legal to restore (partial prefixes only when
   the descriptor allows them; recurrent groups only at checkpoints). Anything else is recorded
   as a rejected alternative with the reason, never chosen.
3. **Options per destination worker ``w``.** Reuse the local GPU prefix in place (full or partial
   reuse; *route to state* when ``w`` is not the baseline worker); or move the missing extent
   ``[local prefix, source prefix)`` from a usable source (same worker's host or disk, another
   worker's memory over the network, a remote store) through the policy's backend for that link;
   or recompute on ``w``. A move hides behind ``w``'s queue (``overlap``); when it is hidden
   entirely it is a *prefetch* with a deadline, valued
   ``P_use*G - (1-P_use)*(T_transfer + C_pollution + C_interference)`` where
   ``P_use = P(transfer done before the consumer starts) * p_consume``.
4. **Gate.** ``EG = t_compute - (T_cache + tail)``; its standard deviation comes from the cost
   model's covariances (compute terms shared by both sides cancel, so only the saved tokens'
   uncertainty counts). An option acts only if ``EG - z*sd(EG) > min_gain_s`` and ``EG > 0``; the
   largest EG among those wins; otherwise the baseline recompute. Options that would break a
   budget (:class:`Headroom`) or move state on an index lagging past the policy's limit are
   rejected with the reason. A request's deadline or TTFT SLO caps every transfer's deadline (a
   copy that lands later is useless). The SLO needs no rule of its own: EG is measured against the
   fastest way to recompute, so an option that passes the gate is also faster than recomputing,
   with the same confidence.

Every number lands in the decision; :func:`explain` renders it as formula plus numbers for logs.
Identifiers of hints and transfers derive from the request id, so the same inputs give the same
plan, byte for byte.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from nexuskv.contracts.decisions import Action, Alternative, CostTerms, Decision
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.contracts.transfers import TransferCommand, TransferKind
from nexuskv.cost import (
    CacheTerms,
    ComputeCost,
    CostModel,
    HardwareProfile,
    LinkCost,
    compose_links,
    normal_cdf,
    prefetch_expected_gain,
)
from nexuskv.descriptor import GranularityKind, StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.identity import IdentityScope
from nexuskv.lookup import LocationMatch, LookupResult
from nexuskv.policy import ExecutionPolicy

__all__ = ["Headroom", "PlanQuery", "Plan", "Option", "plan", "explain", "fallback_decision"]

GIB = float(1 << 30)
# Module constants: an enum member read through its class costs a descriptor call per use.
_GPU, _HOST, _DISK, _REMOTE, _OBJECT = Tier.GPU, Tier.HOST, Tier.DISK, Tier.REMOTE, Tier.OBJECT
_RECOMPUTE, _ROUTE_TO_STATE = Action.RECOMPUTE, Action.ROUTE_TO_STATE
_TRANSFER, _PREFETCH = Action.TRANSFER, Action.PREFETCH
_FULL_REUSE, _PARTIAL_REUSE = Action.FULL_REUSE, Action.PARTIAL_REUSE
_ACTION_ORDER = {a: i for i, a in enumerate(
    (Action.FULL_REUSE, Action.PARTIAL_REUSE, Action.ROUTE_TO_STATE, Action.PREFETCH, Action.TRANSFER,
     Action.RECOMPUTE))}


@dataclass(frozen=True, slots=True)
class Headroom:
    """Budget left for planned movement (from :class:`~nexuskv.prefetch.PrefetchScheduler`).

    ``None`` for a tenant field means the tenant has no quota of its own on that resource.
    """

    transfers: int
    bytes_per_s: float
    pinned_bytes: int
    tenant_transfers: int | None = None
    tenant_bytes: int | None = None
    tenant_pinned_bytes: int | None = None

    def refusal(self, nbytes: int, window_s: float) -> str | None:
        """Why moving ``nbytes`` within ``window_s`` (until its deadline) would break a budget (None: fits).

        A transfer claims the bandwidth it needs to meet its deadline, ``nbytes / window_s``, not
        its link's peak: a prefetch due in two seconds leaves room for others.
        """
        if self.transfers < 1:
            return "backpressure: no transfer slot left (transfers in flight at the budget)"
        if self.tenant_transfers is not None and self.tenant_transfers < 1:
            return "backpressure: the tenant's transfers-in-flight quota is used up"
        rate = nbytes / window_s if window_s > 0 else math.inf
        if rate > self.bytes_per_s:
            return f"backpressure: needs {rate / 1e9:.2f} GB/s, {self.bytes_per_s / 1e9:.2f} GB/s of the budget left"
        if nbytes > self.pinned_bytes:
            return f"backpressure: needs {nbytes} pinned bytes, {self.pinned_bytes} left"
        if self.tenant_bytes is not None and nbytes > self.tenant_bytes:
            return f"backpressure: the tenant's bytes-in-flight quota has {self.tenant_bytes} left, needs {nbytes}"
        if self.tenant_pinned_bytes is not None and nbytes > self.tenant_pinned_bytes:
            return f"backpressure: the tenant's pinned-bytes quota has {self.tenant_pinned_bytes} left, needs {nbytes}"
        return None


@dataclass(frozen=True, slots=True)
class PlanQuery:
    """What the planner is asked: one request at admission (token ids never reach it)."""

    request_id: str
    scope: IdentityScope
    descriptor: StateDescriptor
    keys: tuple[int, ...]  # canonical block keys of the full blocks, block 0 first
    prompt_tokens: int
    arrival_at: float
    candidates: tuple[WorkerLoad, ...]
    deadline_at: float | None = None
    slo_ttft_s: float | None = None
    workload: str | None = None
    trace_id: str | None = None

    def __post_init__(self) -> None:
        if self.scope.descriptor_id != self.descriptor.descriptor_id:
            raise ValueError("descriptor: does not match the query's scope")
        if len(self.keys) != self.prompt_tokens // self.descriptor.block_size:
            raise ValueError("keys: one key per full block of prompt_tokens")
        if not self.candidates:
            raise ValueError("candidates: at least one worker")

    @classmethod
    def from_request(cls, request: PlanRequest, descriptor: StateDescriptor,
                     keys: Sequence[int] | None = None) -> PlanQuery:
        """The query of a plan request; ``keys`` when the request carried token ids instead."""
        chosen = request.keys if request.keys is not None else keys
        if chosen is None:
            raise ValueError("keys: the request carries token ids; compute its keys first")
        return cls(request_id=request.request_id, scope=request.scope, descriptor=descriptor, keys=tuple(chosen),
                   prompt_tokens=request.prompt_tokens, arrival_at=request.arrival_at,
                   candidates=tuple(sorted(request.candidates, key=lambda c: c.worker)),
                   deadline_at=request.deadline_at, slo_ttft_s=request.slo_ttft_s, workload=request.workload,
                   trace_id=request.trace_id)

    @property
    def slo_deadline(self) -> float | None:
        """The earliest of the request's deadline and arrival + TTFT SLO (None: no constraint)."""
        bounds = [b for b in (self.deadline_at,
                              self.arrival_at + self.slo_ttft_s if self.slo_ttft_s is not None else None)
                  if b is not None]
        return min(bounds) if bounds else None


@dataclass(frozen=True)
class Plan:
    """What the planner decided, every option with its numbers, and the records that carry it out.

    Deciding builds only this immutable value (cheap); :attr:`decision`, :attr:`hints` and
    :attr:`transfers` are the wire contracts derived from it, built on first use and cached (a
    pydantic Decision with its alternatives costs several times the decision itself:
    ``benchmarks/README.md``, ``planner_decision_inprocess_p99``). Equal inputs give equal plans
    and equal records.
    """

    query: PlanQuery
    options: tuple[Option, ...]
    chosen: Option
    baseline_worker: str | None  # None when no candidate could be estimated
    t_compute_s: float
    decided_at: float
    index_lag_events: int
    index_lag_ms: float
    policy_version: str
    cost_model_version: str
    max_alternatives: int
    min_gain_s: float

    @property
    def action(self) -> Action:
        return self.chosen.action

    @property
    def worker(self) -> str:
        return self.chosen.worker

    @cached_property
    def decision(self) -> Decision:
        return _decision(self)

    @cached_property
    def _carried_out(self) -> tuple[tuple[PlacementHint, ...], tuple[TransferCommand, ...]]:
        return _actions(self.query, self.decision, self.chosen, self.decided_at)

    @property
    def hints(self) -> tuple[PlacementHint, ...]:
        return self._carried_out[0]

    @property
    def transfers(self) -> tuple[TransferCommand, ...]:
        return self._carried_out[1]


# -- internals ----------------------------------------------------------------------------------------

class _Source(NamedTuple):
    worker: str
    tier: Tier
    prefix: int  # usable prefix, blocks
    extents: tuple[tuple[int, int], ...]  # blocks present beyond the prefix (every group), [start, end)


class Option(NamedTuple):
    """One option weighed for a request, with every term (seconds) and why it lost, if it did.

    A named tuple rather than a frozen dataclass: the planner builds a dozen per decision and a
    frozen dataclass costs four times as much to build (``benchmarks/bench_planner.py``).
    ``eg_s`` is None for an option that could not be costed (no profile, no backend, unusable).
    """

    action: Action
    worker: str
    source: _Source | None = None
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

    @property
    def passes_gate(self) -> bool:
        return self.rejected is None and self.action is not Action.RECOMPUTE and self.eg_s is not None


def _rank(o: Option) -> tuple:
    eg = o.eg_s if o.eg_s is not None else -math.inf
    src = f"{o.source.worker}/{o.source.tier.value}" if o.source else ""
    return (-eg, _ACTION_ORDER[o.action], o.worker, src)


class _Worker(NamedTuple):
    load: WorkerLoad
    profile: str
    hardware: HardwareProfile
    compute: ComputeCost
    queue_s: float
    recompute_s: float


def _block_groups(descriptor: StateDescriptor) -> tuple[int, ...]:
    return tuple(g.kv_group for g in descriptor.layer_groups)


class _Shape(NamedTuple):
    """What the planner reads of a descriptor, derived once per descriptor id (content-addressed)."""

    block_size: int
    block_bytes: int  # one block of every token-granular group
    checkpoint_bytes: int  # one checkpoint of every recurrent group
    pages_per_block: int
    groups: tuple[int, ...]
    step: int | None  # blocks between legal reuse boundaries; None: never legal
    partial_ok: bool
    layers: int  # layers that may restore layer by layer (0: not layerwise)
    restore_fixed_s: float
    restore_per_token_s: float

    def nbytes(self, blocks: int) -> int:
        return blocks * self.block_bytes + self.checkpoint_bytes if blocks > 0 else 0


_SHAPES: dict[tuple, _Shape] = {}


def _shape(d: StateDescriptor) -> _Shape:
    # descriptor_id covers what the state *is*; how it may be restored is outside the digest.
    m, r = d.materialization, d.restore_cost
    key = (d.descriptor_id, m.partial_prefix, m.layerwise, r.fixed_s, r.per_token_s)
    shape = _SHAPES.get(key)
    if shape is None:
        tokens = d.block_size
        per_block = sum(g.bytes_per_token * tokens for g in d.layer_groups
                        if g.granularity.kind is GranularityKind.BLOCK)
        checkpoints = sum(g.bytes_per_checkpoint for g in d.layer_groups)
        layers = sum(len(g.layers) for g in d.layer_groups) if m.layerwise else 0
        shape = _Shape(tokens, per_block, checkpoints, len(d.layer_groups), _block_groups(d), _checkpoint_step(d),
                       m.partial_prefix, layers, r.fixed_s, r.per_token_s)
        if len(_SHAPES) > 4096:  # a bounded memo of a pure function, not state
            _SHAPES.clear()
        _SHAPES[key] = shape
    return shape


def _checkpoint_step(descriptor: StateDescriptor) -> int | None:
    """Blocks between legal reuse boundaries (1 for pure block state; None: never legal)."""
    step = 1
    for g in descriptor.layer_groups:
        if g.granularity.kind is GranularityKind.CHECKPOINT:
            if g.granularity.tokens % descriptor.block_size:
                return None
            step = math.lcm(step, g.granularity.tokens // descriptor.block_size)
    return step


def _intersect(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _sources(query: PlanQuery, shape: _Shape, lookup: LookupResult, policy: ExecutionPolicy,
             rejected: list[Option]) -> list[_Source]:
    """Usable (worker, tier) locations; every unusable one becomes a rejected alternative."""
    if not lookup.matches:
        return []
    groups = shape.groups
    single = groups[0] if len(groups) == 1 else None
    num_blocks = len(query.keys)
    by_place: dict[tuple[str, Tier], dict[int, LocationMatch]] = {}
    for m in lookup.matches:
        loc = m.location
        found = by_place.get((loc.worker, loc.tier))
        if found is None:
            by_place[(loc.worker, loc.tier)] = {loc.group: m}
        else:
            found[loc.group] = m
    step = shape.step
    sources_ok = policy.source_tiers
    out: list[_Source] = []
    for place in sorted(by_place):  # (worker, tier): a Tier is a str, so places sort as strings
        worker, tier = place
        found = by_place[place]
        reason = None
        if single is not None and len(found) == 1 and single in found:
            m = found[single]
            prefix = best = m.prefix_blocks if m.prefix_blocks < num_blocks else num_blocks
            certain = m.certain
        else:
            best = max(min(m.prefix_blocks, num_blocks) for m in found.values())
            prefix = min(min(m.prefix_blocks, num_blocks) for m in found.values())
            certain = all(m.certain for m in found.values())
            foreign = sorted(set(found) - set(groups))
            missing = [g for g in groups if g not in found]
            if foreign:
                reason = (f"incompatible: KV group {foreign[0]} at {worker}/{tier.value} is not a group of "
                          f"descriptor {query.descriptor.descriptor_id}")
            elif missing:
                reason = f"incompatible: KV group {missing[0]} of the descriptor is missing at {worker}/{tier.value}"
        if reason is None:
            if not certain:
                reason = f"publisher of {worker}/{tier.value} is uncertain (sequence gap or restart): treated as a miss"
            elif tier not in sources_ok:
                reason = f"policy: tier {tier.value} is not an allowed source"
            elif step is None:
                reason = "incompatible: checkpoint interval is not a multiple of the block size"
            else:
                if step > 1:
                    prefix -= prefix % step
                if prefix and prefix < num_blocks and not shape.partial_ok:
                    reason = (f"incompatible: descriptor allows only full reuse; {worker}/{tier.value} holds "
                              f"{prefix} of {num_blocks} blocks")
        if reason is not None:
            if best > 0:
                rejected.append(Option(_FULL_REUSE if tier is _GPU else _TRANSFER, worker,
                                       _Source(worker, tier, best, ()), reused_blocks=best, rejected=reason))
            continue
        if prefix > 0:
            extents: tuple[tuple[int, int], ...] = ()
            for i, m in enumerate(found.values()):
                if not m.extents:
                    mine: tuple[tuple[int, int], ...] = ()
                else:
                    mine = tuple((e.start, min(e.end, num_blocks)) for e in m.extents if e.start < num_blocks)
                extents = mine if i == 0 else _intersect(extents, mine)
            out.append(_Source(worker, tier, prefix, extents))
    return out


class _Links(NamedTuple):
    """A destination profile's links into GPU, resolved once per plan."""

    in_place: LinkCost | None
    by_tier: dict[Tier, LinkCost | None]  # same worker's host/disk, remote store, object store
    network: LinkCost | None  # another worker's memory
    far_disk: LinkCost | None  # another worker's disk, then the network


def _links(model: CostModel, profile: str, default_profile: str) -> _Links:
    key = ("planner-links", profile, default_profile)
    links = model.memo.get(key)
    if links is None:
        links = model.memo[key] = _resolve_links(model, profile, default_profile)
    return links


def _resolve_links(model: CostModel, profile: str, default_profile: str) -> _Links:
    get = model.links.get
    network = get((profile, _REMOTE, _GPU))
    read = get((default_profile, _DISK, _GPU))
    far_disk = None
    if network is not None and read is not None:
        far_disk = compose_links(read, network, profile=profile, source=_REMOTE, destination=_GPU)
    by_tier = {t: get((profile, t, _GPU)) for t in (_HOST, _DISK, _REMOTE, _OBJECT)}
    return _Links(get((profile, _GPU, _GPU)), by_tier, network, far_disk)


def _moved_blocks(start: int, end: int, local_extents: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], bool]:
    """Blocks of ``[start, end)`` the destination lacks: ``(start, end)`` if contiguous, else indices."""
    holes = [(max(s, start), min(e, end)) for s, e in local_extents if s < end and e > start]
    if not holes:
        return (start, end), True
    have = set()
    for s, e in holes:
        have.update(range(s, e))
    return tuple(i for i in range(start, end) if i not in have), False


def plan(query: PlanQuery, lookup: LookupResult, model: CostModel, policy: ExecutionPolicy, *, now: float,
         headroom: Headroom | None = None, pollution_s_per_gib: Mapping[str, float] | None = None) -> Plan:
    """Decide for ``query`` at time ``now`` (seconds since the epoch). Pure; see the module docstring.

    ``pollution_s_per_gib`` maps a worker to the price of displacing its resident GPU state
    (:func:`nexuskv.admission.displacement_price`); the policy's default applies elsewhere.
    """
    d = query.descriptor
    shape = _shape(d)
    n = query.prompt_tokens
    nn = float(n) * n
    bs = shape.block_size
    num_blocks = len(query.keys)
    block_bytes = shape.block_bytes
    settings = policy.planner
    z = settings.confidence_z
    min_gain = settings.min_gain_s
    default_profile = settings.default_hardware_profile

    options: list[Option] = []
    workers: list[_Worker] = []
    for load in query.candidates:
        profile = load.profile or default_profile
        hw = model.hardware.get(profile)
        cc = model.compute.get((d.model, profile))
        if hw is None or cc is None:
            options.append(Option(_RECOMPUTE, load.worker,
                                  rejected=f"no cost profile for {d.model} on {profile}: cannot be estimated"))
            continue
        c0, c1, c2 = cc.params.mean
        queue_s = c0 * load.queued_prefill_requests + c1 * load.queued_prefill_tokens \
            + c2 * load.queued_prefill_token_products
        decode = hw.decode_seconds(load.decode_blocks, block_bytes, n) if load.decode_blocks else 0.0
        workers.append(_Worker(load, profile, hw, cc, queue_s, queue_s + c0 + c1 * n + c2 * nn + decode))
    if not workers:
        return Plan(query, tuple(options), options[0], None, 0.0, now, lookup.lag_events, lookup.lag_ms,
                    policy.tag, model.version, settings.max_alternatives, min_gain)

    base = min(workers, key=lambda w: (w.recompute_s, w.load.worker))
    base_worker = base.load.worker
    base_cov = base.compute.params
    t_base = base.recompute_s
    # The baseline's compute features (the queue ahead and the prompt): the variance of an option's
    # EG is that of the difference of the two sides' features when they share a compute model.
    xb0 = 1.0 + base.load.queued_prefill_requests
    xb1 = float(n + base.load.queued_prefill_tokens)
    xb2 = nn + base.load.queued_prefill_token_products
    rejected: list[Option] = []
    sources = _sources(query, shape, lookup, policy, rejected)
    lagging = lookup.lag_ms > policy.budgets.max_index_lag_ms
    slo = query.slo_deadline
    target_ok = _GPU in policy.target_tiers
    backends = policy.backend_table
    layers = shape.layers
    prices = pollution_s_per_gib or {}
    links_by_profile: dict[str, _Links] = {}
    # Sources by how they reach a destination: a worker's own host and disk, and, ranked longest
    # first, every source another worker can copy from (memory and disk over the network, stores).
    own: dict[str, list[_Source]] = {}
    far: dict[tuple[Tier, bool], list[_Source]] = {}
    for src in sources:
        if src.tier is _HOST or src.tier is _DISK:
            own.setdefault(src.worker, []).append(src)
        if src.tier is _GPU or src.tier is _HOST:
            far.setdefault((_REMOTE, False), []).append(src)
        elif src.tier is _DISK:
            far.setdefault((_REMOTE, True), []).append(src)
        else:
            far.setdefault((src.tier, False), []).append(src)
    for ranked in far.values():
        ranked.sort(key=lambda s_: (-s_.prefix, s_.worker, s_.tier))

    for w in workers:
        wid = w.load.worker
        cc, hw, queued = w.compute, w.hardware, w.load.queued_prefill_tokens
        queued_jobs, queued_products = w.load.queued_prefill_requests, w.load.queued_prefill_token_products
        same = cc is base.compute
        c0, c1, c2 = cc.params.mean
        decode_blocks = w.load.decode_blocks
        links = links_by_profile.get(w.profile)
        if links is None:
            links = links_by_profile[w.profile] = _links(model, w.profile, default_profile)
        local = None
        for s in sources:
            if s.worker == wid and s.tier is _GPU:
                local = s
                break
        local_prefix = local.prefix if local else 0

        eg_r = t_base - w.recompute_s
        options.append(Option(_RECOMPUTE, wid, terms=CacheTerms(queue_s=w.queue_s), tail_s=w.recompute_s - w.queue_s,
                              ttft_s=w.recompute_s, eg_s=eg_r, eg_lower_s=eg_r))

        if local is not None:  # reuse the local GPU prefix in place
            e = n - local_prefix * bs
            e = e if e > 0 else 1
            tail = c0 + c1 * e + c2 * e * n
            if decode_blocks:
                tail += hw.decode_seconds(decode_blocks, block_bytes, e)
            in_place = links.in_place
            restore = in_place.params.mean[0] if in_place is not None else 0.0
            ttft = hw.lookup_s + w.queue_s + restore + tail
            if same:
                var = base_cov.variance(xb0 - 1.0 - queued_jobs, xb1 - e - queued,
                                        xb2 - float(e) * n - queued_products)
            else:
                var = base_cov.variance(xb0, xb1, xb2) + cc.params.variance(
                    1.0 + queued_jobs, float(e + queued), float(e) * n + queued_products)
            if in_place is not None:
                var += in_place.params.cov[0][0]
            eg = t_base - ttft
            std = math.sqrt(var) if var > 0 else 0.0
            if wid != base_worker:
                action = _ROUTE_TO_STATE
                why = None if settings.route_to_state else "policy: route to state is off"
            else:
                action = _FULL_REUSE if local_prefix == num_blocks else _PARTIAL_REUSE
                why = None
            options.append(Option(action, wid, local, None, local_prefix, (), True, 0,
                                  CacheTerms(hw.lookup_s, w.queue_s, 0.0, 0.0, restore, 0.0, 0.0),
                                  tail, ttft, eg, std, eg - z * std, None, None, why))

        # Move a longer prefix from elsewhere: per link, only the longest source is worth costing.
        best_by_link: list[tuple[Tier, _Source, LinkCost | None]] = []
        for src in own.get(wid, ()):
            if src.prefix > local_prefix:
                best_by_link.append((src.tier, src, links.by_tier.get(src.tier)))
        for (link_tier, far_disk), ranked in far.items():
            for src in ranked:
                if src.worker == wid and src.tier is not _REMOTE and src.tier is not _OBJECT:
                    continue  # its own memory and disk are the same-worker links above
                if src.prefix > local_prefix:
                    link = (links.far_disk if far_disk else links.network if src.tier is _GPU or src.tier is _HOST
                            else links.by_tier.get(src.tier))
                    best_by_link.append((link_tier, src, link))
                break
        for link_tier, src, link in best_by_link:
            backend = backends.get((link_tier, _GPU))
            if link is None or backend is None:
                why = (f"no cost profile for link {link_tier.value}->gpu on {w.profile}" if link is None
                       else f"policy: no enabled backend for {link_tier.value}->gpu")
                options.append(Option(_TRANSFER, wid, src, backend, src.prefix, rejected=why))
                continue
            if local is not None and local.extents:
                moved, contiguous = _moved_blocks(local_prefix, src.prefix, local.extents)
                count = len(moved) if not contiguous else src.prefix - local_prefix
            else:
                moved, contiguous, count = (local_prefix, src.prefix), True, src.prefix - local_prefix
            nbytes = count * block_bytes + shape.checkpoint_bytes
            pages = count * shape.pages_per_block
            lp = link.params
            transfer = lp.predict(1.0, pages, nbytes)
            var_t = lp.variance(1.0, pages, nbytes)
            e = n - src.prefix * bs
            e = e if e > 0 else 1
            tail = c0 + c1 * e + c2 * e * n
            if decode_blocks:
                tail += hw.decode_seconds(decode_blocks, block_bytes, e)
            overlap = w.queue_s + (tail * (layers - 1) / layers if layers > 1 else 0.0)
            interference = transfer * link.interference
            restore = shape.restore_fixed_s + shape.restore_per_token_s * count * bs
            visible = transfer - overlap if transfer > overlap else 0.0
            ttft = hw.lookup_s + w.queue_s + visible + restore + hw.sync_s + interference + tail
            gain = t_base - ttft
            if same:
                var_c = base_cov.variance(xb0 - 1.0 - queued_jobs, xb1 - e - queued,
                                          xb2 - float(e) * n - queued_products)
            else:
                var_c = base_cov.variance(xb0, xb1, xb2) + cc.params.variance(
                    1.0 + queued_jobs, float(e + queued), float(e) * n + queued_products)
            if visible == 0.0 and overlap > 0 and settings.prefetch:
                sd_t = math.sqrt(var_t) if var_t > 0 else 0.0
                p_ready = normal_cdf((overlap - transfer) / sd_t) if sd_t > 0 else 1.0
                p_use = p_ready * settings.p_consume
                pollution = nbytes / GIB * prices.get(wid, settings.pollution_s_per_gib)
                sd_g = math.sqrt(var_c) if var_c > 0 else 0.0
                action = _PREFETCH
                eg = prefetch_expected_gain(p_use, gain, transfer, pollution, interference)
                std = p_use * sd_g
                lower = prefetch_expected_gain(p_use, gain - z * sd_g, transfer, pollution, interference)
                deadline = now + overlap
            else:
                action, p_use = _TRANSFER, None
                var = var_c + var_t * (1.0 + link.interference) ** 2
                std = math.sqrt(var) if var > 0 else 0.0
                eg, lower = gain, gain - z * std
                deadline = now + transfer + (gain if gain > 0 else 0.0)
            if slo is not None and slo < deadline:
                deadline = slo
            if not target_ok:
                why = "policy: gpu is not an allowed target tier"
            elif lagging:
                why = (f"index lag {lookup.lag_ms:.0f} ms > {policy.budgets.max_index_lag_ms:.0f} ms: "
                       "no movement is planned on facts that old")
            elif headroom is not None:
                why = headroom.refusal(nbytes, max(deadline - now, transfer))
            else:
                why = None
            options.append(Option(
                action, wid, src, backend, src.prefix, moved, contiguous, nbytes,
                CacheTerms(hw.lookup_s, w.queue_s, transfer, overlap, restore, hw.sync_s, interference),
                tail, ttft, eg, std, lower, p_use, deadline, why))

    options.extend(rejected)
    winner = None
    for o in options:
        if o.rejected is None and o.action is not _RECOMPUTE and o.eg_s is not None and o.eg_s > 0 \
                and o.eg_lower_s is not None and o.eg_lower_s > min_gain:
            if winner is None or o.eg_s > winner.eg_s or (o.eg_s == winner.eg_s and _rank(o) < _rank(winner)):
                winner = o
    if winner is None:
        winner = next(o for o in options if o.action is _RECOMPUTE and o.worker == base_worker)
    return Plan(query, tuple(options), winner, base_worker, t_base, now, lookup.lag_events, lookup.lag_ms,
                policy.tag, model.version, settings.max_alternatives, min_gain)


def _gate_reason(opt: Option, chosen: Option, min_gain: float) -> str:
    if opt.rejected is not None:
        return opt.rejected
    if opt.action is Action.RECOMPUTE:
        return (f"recompute on {opt.worker}: {opt.ttft_s:.4f}s to first token vs {chosen.action.value} on "
                f"{chosen.worker}")
    if opt.eg_s is None or opt.eg_s <= 0:
        return f"EG {opt.eg_s:.4f}s <= 0"
    if opt.eg_lower_s is None or opt.eg_lower_s <= min_gain:
        return f"EG lower bound {opt.eg_lower_s:.4f}s <= {min_gain}s: not sure enough to act"
    return f"EG {opt.eg_s:.4f}s below the chosen {chosen.eg_s:.4f}s"


def _terms(o: Option) -> CostTerms:
    t = o.terms
    return CostTerms(lookup_s=t.lookup_s, queue_s=t.queue_s, transfer_s=t.transfer_s, overlap_s=t.overlap_s,
                     restore_s=t.restore_s, sync_s=t.sync_s, interference_s=t.interference_s, total_s=t.total_s)


def _locations(opt: Option, group: int) -> tuple[EntryLocation | None, EntryLocation | None]:
    if opt.source is None:
        return None, None
    src = EntryLocation(worker=opt.source.worker, tier=opt.source.tier, group=group)
    if opt.action in (Action.TRANSFER, Action.PREFETCH):
        return src, EntryLocation(worker=opt.worker, tier=Tier.GPU, group=group)
    return src, None


def _alternative(opt: Option, chosen: Option, t_base: float, bs: int, group: int, min_gain: float) -> Alternative:
    src, dst = _locations(opt, group)
    is_chosen = opt is chosen
    return Alternative(
        action=opt.action, worker=opt.worker, source=src, destination=dst, backend=opt.backend,
        reused_tokens=opt.reused_blocks * bs, reused_blocks=opt.reused_blocks, t_compute_s=t_base,
        t_tail_s=opt.tail_s, t_with_reuse_s=opt.ttft_s, terms=_terms(opt), eg_s=opt.eg_s,
        eg_std_s=opt.eg_std_s, eg_lower_s=opt.eg_lower_s, p_use=opt.p_use, deadline_at=opt.deadline_at,
        chosen=is_chosen, rejected_reason=None if is_chosen else _gate_reason(opt, chosen, min_gain),
    )


def _reason(p: Plan) -> str:
    chosen, t_base, min_gain = p.chosen, p.t_compute_s, p.min_gain_s
    if p.baseline_worker is None:
        return f"recompute on {chosen.worker}: {chosen.rejected}; reuse cannot be shown to pay"
    if chosen.action is Action.RECOMPUTE:
        costed = [o for o in p.options if o.action is not Action.RECOMPUTE and o.eg_s is not None]
        if not costed:
            ruled = [o for o in p.options if o.action is not Action.RECOMPUTE]
            why = f"; {ruled[0].rejected}" if ruled else ""
            return f"recompute on {p.baseline_worker}: no compatible, certain state to reuse{why}"
        best = min(costed, key=_rank)
        return (f"recompute on {p.baseline_worker}: T_compute {t_base:.4f}s; best reuse option "
                f"{best.action.value} on {best.worker} has EG {best.eg_s:.4f}s (lower {best.eg_lower_s:.4f}s): "
                f"{_gate_reason(best, chosen, min_gain)}")
    t = chosen.terms
    src = f" from {chosen.source.worker}/{chosen.source.tier.value}" if chosen.source else ""
    core = (f"{chosen.action.value} on {chosen.worker}{src}: EG {chosen.eg_s:.4f}s = T_compute {t_base:.4f}s "
            f"(recompute on {p.baseline_worker}) - [T_cache {t.total_s:.4f}s (lookup {t.lookup_s:.4f} + queue "
            f"{t.queue_s:.4f} + max(0, transfer {t.transfer_s:.4f} - overlap {t.overlap_s:.4f}) + restore "
            f"{t.restore_s:.4f} + sync {t.sync_s:.4f} + interference {t.interference_s:.4f}) + tail "
            f"{chosen.tail_s:.4f}s]")
    if chosen.p_use is not None:
        core += f"; prefetch: P_use {chosen.p_use:.3f}, E[G] = P_use*G - (1-P_use)*(transfer+pollution+interference)"
    return core + f"; lower bound {chosen.eg_lower_s:.4f}s > {min_gain}s"


def _decision(p: Plan) -> Decision:
    query, chosen = p.query, p.chosen
    d = query.descriptor
    bs = d.block_size
    group = d.layer_groups[0].kv_group
    ranked = sorted(p.options, key=lambda o: (o is not chosen, o.rejected is not None, _rank(o)))
    alternatives = tuple(_alternative(o, chosen, p.t_compute_s, bs, group, p.min_gain_s)
                         for o in ranked[: p.max_alternatives])
    src, dst = _locations(chosen, group)
    estimated = p.baseline_worker is not None
    return Decision(
        request_id=query.request_id, tenant_namespace=query.scope.tenant_namespace, decided_at=p.decided_at,
        action=chosen.action, worker=chosen.worker, baseline_worker=p.baseline_worker, source=src, destination=dst,
        backend=chosen.backend, prompt_tokens=query.prompt_tokens, reused_tokens=chosen.reused_blocks * bs,
        reused_blocks=chosen.reused_blocks, deadline_at=chosen.deadline_at, t_compute_s=p.t_compute_s,
        t_tail_s=chosen.tail_s if estimated and chosen.tail_s is not None else 0.0,
        t_with_reuse_s=chosen.ttft_s if estimated and chosen.ttft_s is not None else p.t_compute_s,
        terms=_terms(chosen) if estimated else CostTerms(), eg_s=chosen.eg_s if estimated and chosen.eg_s else 0.0,
        eg_std_s=chosen.eg_std_s, eg_lower_s=chosen.eg_lower_s if estimated and chosen.eg_lower_s else 0.0,
        p_use=chosen.p_use, reason=_reason(p), alternatives=alternatives, alternatives_total=len(p.options),
        policy_version=p.policy_version, cost_model_version=p.cost_model_version,
        index_lag_events=p.index_lag_events, index_lag_ms=p.index_lag_ms, workload=query.workload,
        trace_id=query.trace_id,
    )


def _actions(query: PlanQuery, decision: Decision, chosen: Option,
             now: float) -> tuple[tuple[PlacementHint, ...], tuple[TransferCommand, ...]]:
    d = query.descriptor
    rid = query.request_id
    tenant = query.scope.tenant_namespace
    root = query.keys[0] if query.keys else None
    hints = [PlacementHint(hint_id=f"{rid}/h0", request_id=rid, tenant_namespace=tenant, prefix_root=root,
                           kind=HintKind.ROUTE, worker=decision.worker, tier=Tier.GPU,
                           blocks=decision.reused_blocks, issued_at=now, reason=decision.reason)]
    transfers: list[TransferCommand] = []
    src = chosen.source
    if chosen.action in (Action.FULL_REUSE, Action.PARTIAL_REUSE, Action.ROUTE_TO_STATE) and src is not None:
        until = now + (decision.t_with_reuse_s or 0.0)
        for g in _block_groups(d):
            hints.append(PlacementHint(hint_id=f"{rid}/h{len(hints)}", request_id=rid, tenant_namespace=tenant,
                                       prefix_root=root, kind=HintKind.PIN, worker=src.worker, tier=src.tier, group=g,
                                       blocks=chosen.reused_blocks, expires_at=until, issued_at=now,
                                       reason="keep the reused prefix until the request has consumed it"))
    elif chosen.action in (Action.TRANSFER, Action.PREFETCH) and src is not None:
        if chosen.contiguous:
            start, end = chosen.moved  # type: ignore[misc]
            keys = query.keys[start:end]
        else:
            start, end = chosen.moved[0], chosen.moved[-1] + 1
            keys = tuple(query.keys[i] for i in chosen.moved)
        count = len(keys)
        kind = TransferKind.PREFETCH if chosen.action is Action.PREFETCH else TransferKind.MATERIALIZE
        deadline = decision.deadline_at if decision.deadline_at is not None else now
        for i, g in enumerate(_block_groups(d)):
            tid = f"{rid}/t{i}"
            group_bytes = _group_bytes(d, g, count)
            transfers.append(TransferCommand(
                transfer_id=tid, request_id=rid, kind=kind, descriptor_id=d.descriptor_id, tenant_namespace=tenant,
                keys=keys, source=EntryLocation(worker=src.worker, tier=src.tier, group=g),
                destination=EntryLocation(worker=chosen.worker, tier=Tier.GPU, group=g), bytes=group_bytes,
                issued_at=now, deadline_at=deadline, priority=7 if kind is TransferKind.MATERIALIZE else 4,
                backend=chosen.backend))
            hints.append(PlacementHint(hint_id=f"{rid}/h{len(hints)}", request_id=rid, tenant_namespace=tenant,
                                       prefix_root=root, kind=HintKind.PIN, worker=src.worker, tier=src.tier, group=g,
                                       first_block=start, blocks=end - start, transfer_id=tid, expires_at=deadline,
                                       issued_at=now, reason="source of a transfer: keep until its deadline"))
            if kind is TransferKind.PREFETCH:
                hints.append(PlacementHint(
                    hint_id=f"{rid}/h{len(hints)}", request_id=rid, tenant_namespace=tenant, prefix_root=root,
                    kind=HintKind.PREFETCH, worker=chosen.worker, tier=Tier.GPU, group=g, first_block=start,
                    blocks=end - start, transfer_id=tid, expires_at=deadline, issued_at=now,
                    reason="reserve room for a prefetch due before the request starts"))
    return tuple(hints), tuple(transfers)


def _group_bytes(d: StateDescriptor, kv_group: int, blocks: int) -> int:
    g = d.group(kv_group)
    if g is None or blocks <= 0:
        return 0
    if g.granularity.kind is GranularityKind.CHECKPOINT:
        return g.bytes_per_checkpoint
    return blocks * d.block_size * g.bytes_per_token


def fallback_decision(original: Decision, reason: str, *, now: float) -> Decision:
    """The superseding record when planned state is not ready: recompute where the request runs.

    The request's first token then costs what recomputing on that worker costs (the original's
    recompute alternative for that worker, when it kept one; else the baseline), so ``eg_s`` is the
    baseline minus that: zero on the baseline worker, negative elsewhere.
    """
    own = next((a for a in original.alternatives if a.action is Action.RECOMPUTE and a.worker == original.worker
                and a.t_with_reuse_s is not None), None)
    ttft = own.t_with_reuse_s if own is not None else original.t_compute_s
    terms = own.terms if own is not None else CostTerms()
    tail = own.t_tail_s if own is not None and own.t_tail_s is not None else ttft
    eg = original.t_compute_s - ttft
    return Decision(
        request_id=original.request_id, revision=original.revision + 1, tenant_namespace=original.tenant_namespace,
        decided_at=now, action=Action.RECOMPUTE, worker=original.worker, baseline_worker=original.baseline_worker,
        prompt_tokens=original.prompt_tokens, t_compute_s=original.t_compute_s, t_tail_s=tail,
        t_with_reuse_s=ttft, terms=terms, eg_s=eg, eg_lower_s=eg,
        reason=f"fallback to recompute on {original.worker}: {reason}", policy_version=original.policy_version,
        cost_model_version=original.cost_model_version, index_lag_events=original.index_lag_events,
        index_lag_ms=original.index_lag_ms, workload=original.workload, trace_id=original.trace_id,
    )


def explain(decision: Decision) -> str:
    """One log line: the decision as formula plus numbers (no token ids, no prompt text)."""
    return (f"request={decision.request_id} rev={decision.revision} action={decision.action.value} "
            f"worker={decision.worker} reused={decision.reused_tokens}/{decision.prompt_tokens} "
            f"EG={decision.eg_s:.4f}s sd={decision.eg_std_s:.4f}s lower={decision.eg_lower_s:.4f}s "
            f"policy={decision.policy_version} cost_model={decision.cost_model_version} :: {decision.reason}")
