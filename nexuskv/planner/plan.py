"""A plan: what the planner decided, every option with its numbers, and the records that carry it out.

:class:`Plan` is what :func:`nexuskv.planner.decide.plan` returns. Its Decision (the choice, its
terms, the best alternatives and why each lost) is built here, on first use; the hints and
transfer commands come from :func:`nexuskv.planner.records.actions_of`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nexuskv.contracts.decisions import Action, CostTerms, Decision
from nexuskv.contracts.placement import PlacementHint
from nexuskv.contracts.transfers import TransferCommand
from nexuskv.planner.gate import gate_reason, rank
from nexuskv.planner.options import Option
from nexuskv.planner.query import PlanQuery
from nexuskv.planner.records import actions_of, alternative_of, locations_of, terms_of

__all__ = ["Plan", "decision_of"]


@dataclass(slots=True, eq=False)
class Plan:
    """What the planner decided, every option with its numbers, and the records that carry it out.

    Deciding builds only this value (cheap); its fields are never reassigned. :attr:`decision`,
    :attr:`hints` and :attr:`transfers` are the wire contracts derived from it, built on first use
    and kept (a pydantic Decision with its alternatives costs several times the decision itself:
    ``benchmarks/README.md``, ``planner_decision_inprocess_p99``) — which is why a Plan is not a
    frozen dataclass. Equal inputs give equal plans and equal records.
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
    explored: bool = False  # the gate declined the chosen option as uncertain; the exploration budget took it
    _decision: Decision | None = None
    _carried_out: tuple[tuple[PlacementHint, ...], tuple[TransferCommand, ...]] | None = None

    @property
    def action(self) -> Action:
        return self.chosen.action

    @property
    def worker(self) -> str:
        return self.chosen.worker

    @property
    def decision(self) -> Decision:
        if self._decision is None:
            self._decision = decision_of(self)
        return self._decision

    def _records(self) -> tuple[tuple[PlacementHint, ...], tuple[TransferCommand, ...]]:
        if self._carried_out is None:
            self._carried_out = actions_of(self.query, self.decision, self.chosen, self.decided_at)
        return self._carried_out

    @property
    def hints(self) -> tuple[PlacementHint, ...]:
        return self._records()[0]

    @property
    def transfers(self) -> tuple[TransferCommand, ...]:
        return self._records()[1]



def _reason(p: Plan) -> str:
    chosen, t_base, min_gain = p.chosen, p.t_compute_s, p.min_gain_s
    if p.baseline_worker is None:
        return (f"recompute on {chosen.worker} (the least loaded candidate): {chosen.rejected}; reuse cannot be "
                "shown to pay")
    if chosen.action is Action.RECOMPUTE:
        costed = [o for o in p.options if o.action is not Action.RECOMPUTE and o.eg_s is not None]
        if not costed:
            ruled = [o for o in p.options if o.action is not Action.RECOMPUTE]
            why = f"; {ruled[0].rejected}" if ruled else ""
            return f"recompute on {p.baseline_worker}: no compatible, certain state to reuse{why}"
        best = min(costed, key=rank)
        return (f"recompute on {p.baseline_worker}: T_compute {t_base:.4f}s; best reuse option "
                f"{best.action.value} on {best.worker} has EG {best.eg_s:.4f}s (lower {best.eg_lower_s:.4f}s): "
                f"{gate_reason(best, chosen, min_gain)}")
    t = chosen.terms
    src = f" from {chosen.source.worker}/{chosen.source.tier.value}" if chosen.source else ""
    core = (f"{chosen.action.value} on {chosen.worker}{src}: EG {chosen.eg_s:.4f}s = T_compute {t_base:.4f}s "
            f"(recompute on {p.baseline_worker}) - [T_cache {t.total_s:.4f}s ("
            f"{f'request {t.request_s:.4f} + ' if t.request_s else ''}lookup {t.lookup_s:.4f} + queue "
            f"{t.queue_s:.4f} + max(0, transfer {t.transfer_s:.4f} - overlap {t.overlap_s:.4f}) + restore "
            f"{t.restore_s:.4f} + sync {t.sync_s:.4f} + interference {t.interference_s:.4f}) + tail "
            f"{chosen.tail_s:.4f}s]")
    if chosen.p_use is not None:
        core += f"; prefetch: P_use {chosen.p_use:.3f}, E[G] = P_use*G - (1-P_use)*(transfer+pollution+interference)"
    if p.explored:
        return (f"exploration: {core}; lower bound {chosen.eg_lower_s:.4f}s <= {min_gain}s, taken to observe its "
                f"least-observed fit ({chosen.fit_observations} observations)")
    return core + f"; lower bound {chosen.eg_lower_s:.4f}s > {min_gain}s"


def decision_of(p: Plan) -> Decision:
    """The Decision record of a plan: the choice, its terms and the best ``max_alternatives`` options."""
    query, chosen = p.query, p.chosen
    d = query.descriptor
    bs = d.block_size
    group = d.layer_groups[0].kv_group
    ranked = sorted(p.options, key=lambda o: (o is not chosen, o.rejected is not None, rank(o)))
    alternatives = tuple(alternative_of(o, chosen, p.t_compute_s, bs, group, p.min_gain_s)
                         for o in ranked[: p.max_alternatives])
    src, dst = locations_of(chosen, group)
    estimated = p.baseline_worker is not None
    return Decision(
        request_id=query.request_id, tenant_namespace=query.scope.tenant_namespace, decided_at=p.decided_at,
        action=chosen.action, worker=chosen.worker, baseline_worker=p.baseline_worker, source=src, destination=dst,
        backend=chosen.backend, prompt_tokens=query.prompt_tokens, reused_tokens=chosen.reused_blocks * bs,
        reused_blocks=chosen.reused_blocks, deadline_at=chosen.deadline_at, t_compute_s=p.t_compute_s,
        t_tail_s=chosen.tail_s if estimated and chosen.tail_s is not None else 0.0,
        t_with_reuse_s=chosen.ttft_s if estimated and chosen.ttft_s is not None else p.t_compute_s,
        terms=terms_of(chosen) if estimated else CostTerms(), eg_s=chosen.eg_s if estimated and chosen.eg_s else 0.0,
        eg_std_s=chosen.eg_std_s, eg_lower_s=chosen.eg_lower_s if estimated and chosen.eg_lower_s else 0.0,
        p_use=chosen.p_use, reason=_reason(p), alternatives=alternatives, alternatives_total=len(p.options),
        policy_version=p.policy_version, cost_model_version=p.cost_model_version,
        index_lag_events=p.index_lag_events, index_lag_ms=p.index_lag_ms, workload=query.workload,
        trace_id=query.trace_id, explored=p.explored,
    )
