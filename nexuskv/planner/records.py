"""The wire records of a plan's options: each option as a Decision's alternative (its numbers and why
it lost), the placement hints and transfer commands that carry a decision out, the fallback that
supersedes it, and :func:`explain`, the decision as one log line of formula plus numbers (the
Decision itself is built by :class:`nexuskv.planner.plan.Plan`).

Identifiers of hints and transfers derive from the request id, so the same inputs give the same
records, byte for byte.
"""

from __future__ import annotations

from nexuskv.contracts.decisions import Action, Alternative, CostTerms, Decision
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.transfers import TransferCommand, TransferKind
from nexuskv.descriptor import GranularityKind, StateDescriptor, Tier
from nexuskv.entries import EntryLocation
from nexuskv.planner.gate import gate_reason
from nexuskv.planner.options import Option, engine_loads
from nexuskv.planner.query import PlanQuery
from nexuskv.planner.sources import block_groups

__all__ = ["actions_of", "alternative_of", "explain", "fallback_decision", "locations_of", "terms_of"]


def terms_of(o: Option) -> CostTerms:
    t = o.terms
    return CostTerms(lookup_s=t.lookup_s, queue_s=t.queue_s, transfer_s=t.transfer_s, overlap_s=t.overlap_s,
                     restore_s=t.restore_s, sync_s=t.sync_s, interference_s=t.interference_s, total_s=t.total_s,
                     request_s=t.request_s)


def locations_of(opt: Option, group: int) -> tuple[EntryLocation | None, EntryLocation | None]:
    if opt.source is None:
        return None, None
    src = EntryLocation(worker=opt.source.worker, tier=opt.source.tier, group=group)
    if opt.action in (Action.TRANSFER, Action.PREFETCH):
        return src, EntryLocation(worker=opt.worker, tier=Tier.GPU, group=group)
    return src, None


def alternative_of(opt: Option, chosen: Option, t_base: float, bs: int, group: int, min_gain: float) -> Alternative:
    src, dst = locations_of(opt, group)
    is_chosen = opt is chosen
    return Alternative(
        action=opt.action, worker=opt.worker, source=src, destination=dst, backend=opt.backend,
        reused_tokens=opt.reused_blocks * bs, reused_blocks=opt.reused_blocks, t_compute_s=t_base,
        t_tail_s=opt.tail_s, t_with_reuse_s=opt.ttft_s, terms=terms_of(opt), eg_s=opt.eg_s,
        eg_std_s=opt.eg_std_s, eg_lower_s=opt.eg_lower_s, p_use=opt.p_use, deadline_at=opt.deadline_at,
        chosen=is_chosen, rejected_reason=None if is_chosen else gate_reason(opt, chosen, min_gain),
    )


def actions_of(query: PlanQuery, decision: Decision, chosen: Option,
               now: float) -> tuple[tuple[PlacementHint, ...], tuple[TransferCommand, ...]]:
    """The placement hints (route, pins, prefetch reservations) and transfer commands of a decision."""
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
        reused = query.keys[:chosen.reused_blocks]
        for g in block_groups(d):
            hints.append(PlacementHint(hint_id=f"{rid}/h{len(hints)}", request_id=rid, tenant_namespace=tenant,
                                       prefix_root=root, kind=HintKind.PIN, worker=src.worker, tier=src.tier, group=g,
                                       blocks=chosen.reused_blocks, keys=reused,
                                       bytes=_group_bytes(d, g, chosen.reused_blocks), descriptor_id=d.descriptor_id,
                                       expires_at=until, issued_at=now,
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
        if _engine_loads(query, chosen.worker, src.worker, src.tier):
            # The engine's connector reads its own tier (or the shared one) when it schedules the
            # request: no command, only the pin that keeps the source until then.
            for g in block_groups(d):
                hints.append(PlacementHint(hint_id=f"{rid}/h{len(hints)}", request_id=rid, tenant_namespace=tenant,
                                           prefix_root=root, kind=HintKind.PIN, worker=src.worker, tier=src.tier,
                                           group=g, first_block=start, blocks=end - start, keys=keys,
                                           bytes=_group_bytes(d, g, count), descriptor_id=d.descriptor_id,
                                           expires_at=deadline, issued_at=now,
                                           reason="the engine loads it from its own tier: keep it until then"))
            return tuple(hints), ()
        for i, g in enumerate(block_groups(d)):
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
                                       first_block=start, blocks=end - start, keys=keys, bytes=group_bytes,
                                       descriptor_id=d.descriptor_id, transfer_id=tid, expires_at=deadline,
                                       issued_at=now, reason="source of a transfer: keep until its deadline"))
            if kind is TransferKind.PREFETCH:
                hints.append(PlacementHint(
                    hint_id=f"{rid}/h{len(hints)}", request_id=rid, tenant_namespace=tenant, prefix_root=root,
                    kind=HintKind.PREFETCH, worker=chosen.worker, tier=Tier.GPU, group=g, first_block=start,
                    blocks=end - start, keys=keys, bytes=group_bytes, descriptor_id=d.descriptor_id, transfer_id=tid,
                    expires_at=deadline, issued_at=now,
                    reason="reserve room for a prefetch due before the request starts"))
    return tuple(hints), tuple(transfers)


def _group_bytes(d: StateDescriptor, kv_group: int, blocks: int) -> int:
    g = d.group(kv_group)
    if g is None or blocks <= 0:
        return 0
    if g.granularity.kind is GranularityKind.CHECKPOINT:
        return g.bytes_per_checkpoint
    return blocks * d.block_size * g.bytes_per_token


def _engine_loads(query: PlanQuery, worker: str, source_worker: str, source_tier: Tier) -> bool:
    return any(c.worker == worker and engine_loads(c, source_worker, source_tier) for c in query.candidates)


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
