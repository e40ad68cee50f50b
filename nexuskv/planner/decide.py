"""``plan()``: every option for a request costed, the gate applied, the choice returned as a :class:`Plan`."""

from __future__ import annotations

from collections.abc import Mapping

from nexuskv.contracts.decisions import Action
from nexuskv.cost import CostModel, LinkCost, compose_links, page_bytes_of
from nexuskv.descriptor import Tier
from nexuskv.lookup import LookupResult
from nexuskv.planner.gate import choose, exploration_draw, explore, movement_refusal
from nexuskv.planner.options import (
    Baseline,
    Candidate,
    Links,
    MoveOverLink,
    Option,
    RecomputeOn,
    Request,
    ReuseInPlace,
)
from nexuskv.planner.plan import Plan
from nexuskv.planner.query import Headroom, PlanQuery
from nexuskv.planner.sources import Source, shape_of, usable_sources
from nexuskv.policy import ExecutionPolicy

__all__ = ["plan"]

# Module constants: an enum member read through its class costs a descriptor call per use.
_GPU, _HOST, _DISK, _REMOTE, _OBJECT = Tier.GPU, Tier.HOST, Tier.DISK, Tier.REMOTE, Tier.OBJECT
_RECOMPUTE, _TRANSFER, _FULL_REUSE = Action.RECOMPUTE, Action.TRANSFER, Action.FULL_REUSE


# Resolved links per (cost-model snapshot, profile, page size): a bounded memo of a pure function, keyed
# by the snapshot's identity (the snapshot is held, so its id cannot be reused while the entry lives).
_LINKS: dict[tuple[int, str, str, int | None], tuple[CostModel, Links]] = {}
_LINKS_MAX = 256


def _links(model: CostModel, profile: str, default_profile: str, page_bytes: int | None) -> Links:
    key = (id(model), profile, default_profile, page_bytes)
    hit = _LINKS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    links = _resolve_links(model, profile, default_profile, page_bytes)
    if len(_LINKS) >= _LINKS_MAX:
        _LINKS.clear()
    _LINKS[key] = (model, links)
    return links


def _resolve_links(model: CostModel, profile: str, default_profile: str, page_bytes: int | None) -> Links:
    """The destination profile's links for copies of ``page_bytes`` pages: a fit at that size, else a
    size-free prior (:meth:`CostModel.link`), never a fit of another block size."""
    def get(p: str, src: Tier, dst: Tier) -> LinkCost | None:
        return model.link(p, src, dst, page_bytes)

    network = get(profile, _REMOTE, _GPU)
    read = get(default_profile, _DISK, _GPU)
    far_disk = None
    if network is not None and read is not None:
        far_disk = compose_links(read, network, profile=profile, source=_REMOTE, destination=_GPU)
    by_tier = {t: get(profile, t, _GPU) for t in (_HOST, _DISK, _REMOTE, _OBJECT)}
    return Links(get(profile, _GPU, _GPU), by_tier, network, far_disk)


def plan(query: PlanQuery, lookup: LookupResult, model: CostModel, policy: ExecutionPolicy, *, now: float,
         headroom: Headroom | None = None, pollution_s_per_gib: Mapping[str, float] | None = None,
         dispatch_s: Mapping[str, float] | None = None) -> Plan:
    """Decide for ``query`` at time ``now`` (seconds since the epoch). Pure; see :mod:`nexuskv.planner`.

    ``pollution_s_per_gib`` maps a worker to the price of displacing its resident GPU state
    (:func:`nexuskv.admission.displacement_price`); the policy's default applies elsewhere.
    ``dispatch_s`` maps a destination worker to the time a transfer command takes to start there
    (its trip over the bus and the executor's queue, as measured): a commanded copy's transfer
    time and deadline include it (0 where not given).
    """
    d = query.descriptor
    shape = shape_of(d)
    n = query.prompt_tokens
    nn = float(n) * n
    # The engine always computes the prompt's last token itself (its logits are the first output), so
    # the last block of a block-aligned prompt is never reused: a fully matched prompt of 640 tokens in
    # blocks of 32 loads 608 (vLLM's get_num_new_matched_tokens and its own prefix cache both stop at
    # prompt_tokens - 1). Every option's reused blocks, copies and pins stop there too.
    num_blocks = min(len(query.keys), (n - 1) // d.block_size) if n > 0 else 0
    settings = policy.planner
    min_gain = settings.min_gain_s
    default_profile = settings.default_hardware_profile

    options: list[Option] = []
    workers: list[Candidate] = []
    for load in query.candidates:
        profile = load.profile or default_profile
        hw = model.hardware.get(profile)
        cc = model.compute.get((d.model, profile))
        if hw is None or cc is None:
            options.append(Option(_RECOMPUTE, load.worker,
                                  rejected=f"no cost profile for {d.model} on {profile}: cannot be estimated"))
            continue
        # The fixed per-request cost is still ahead of a request planned at admission; an engine's own
        # connector plans after its HTTP and tokenisation, so for it the term is 0.
        request_s = model.request_seconds(d.model, profile, n) if query.at_admission else 0.0
        workers.append(Candidate.of(load, profile, hw, cc, n, nn, shape.block_bytes, request_s))
    if not workers:  # nothing can be priced: recompute where the least work waits (a load balancer's choice)
        least = min(query.candidates, key=lambda c: (c.queued_prefill_tokens, c.queued_prefill_requests, c.worker))
        chosen = next(o for o in options if o.worker == least.worker)
        return Plan(query, tuple(options), chosen, None, 0.0, now, lookup.lag_events, lookup.lag_ms,
                    policy.tag, model.version, settings.max_alternatives, min_gain)

    base = Baseline.of(min(workers, key=lambda w: (w.recompute_s, w.load.worker)), n, nn)
    sources, unusable = usable_sources(d, num_blocks, shape, lookup, policy)
    req = Request(n, nn, shape, settings.confidence_z, settings.prefetch, settings.p_consume, settings.route_to_state,
                  settings.pollution_s_per_gib, pollution_s_per_gib or {}, now, query.slo_deadline, dispatch_s or {})
    max_lag = policy.budgets.max_index_lag_ms
    lagging = lookup.lag_ms > max_lag
    target_ok = _GPU in policy.target_tiers
    restricted = lagging or not target_ok
    backends = policy.backend_table
    page_bytes = page_bytes_of(shape.block_bytes, shape.pages_per_block)
    links_by_profile: dict[str, Links] = {}
    # Sources by how they reach a destination: a worker's own host and disk, and, ranked longest
    # first, every source another worker can copy from (memory and disk over the network, stores).
    own: dict[str, list[Source]] = {}
    far: dict[tuple[Tier, bool], list[Source]] = {}
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
        links = links_by_profile.get(w.profile)
        if links is None:
            links = links_by_profile[w.profile] = _links(model, w.profile, default_profile, page_bytes)
        local = None
        for s in sources:
            if s.worker == wid and s.tier is _GPU:
                local = s
                break
        local_prefix = local.prefix if local else 0

        options.append(RecomputeOn.cost(w, base))
        if local is not None:
            options.append(ReuseInPlace.cost(req, base, w, local, links, num_blocks))

        # Move a longer prefix from elsewhere: per link, only the longest source is worth costing.
        best_by_link: list[tuple[Tier, Source, LinkCost | None]] = []
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
            move = MoveOverLink.cost(req, base, w, local, src, link_tier, link, backends.get((link_tier, _GPU)))
            if move.rejected is None and (restricted or headroom is not None):
                why = movement_refusal(target_ok, lookup.lag_ms, max_lag, lagging, headroom, move.nbytes,
                                       max(move.deadline_at - now, move.terms.transfer_s))
                if why is not None:
                    move = move._replace(rejected=why)
            options.append(move)

    for u in unusable:
        options.append(Option(_FULL_REUSE if u.source.tier is _GPU else _TRANSFER, u.source.worker, u.source,
                              reused_blocks=u.source.prefix, rejected=u.reason))
    winner = choose(options, base.worker, min_gain)
    explored = False
    if winner.action is _RECOMPUTE and settings.explore_share > 0 \
            and exploration_draw(query.request_id) < settings.explore_share:
        tried = explore(options, min_gain, settings.explore_max_observations)
        if tried is not None:
            winner, explored = tried, True
    return Plan(query, tuple(options), winner, base.worker, base.t_s, now, lookup.lag_events, lookup.lag_ms,
                policy.tag, model.version, settings.max_alternatives, min_gain, explored)
