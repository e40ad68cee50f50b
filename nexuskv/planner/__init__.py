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

The package, one concept per module: :mod:`~nexuskv.planner.query` (what is asked, the movement
budget), :mod:`~nexuskv.planner.sources` (the descriptor's shape, usable sources),
:mod:`~nexuskv.planner.options` (one class per option kind, each with a pure cost method),
:mod:`~nexuskv.planner.gate` (which option may act and which one does),
:mod:`~nexuskv.planner.decide` (:func:`plan` itself) and :mod:`~nexuskv.planner.records` (the
Decision, hints, transfers and fallback records).
"""

from nexuskv.planner.decide import plan
from nexuskv.planner.options import Option
from nexuskv.planner.plan import Plan
from nexuskv.planner.query import Headroom, PlanQuery
from nexuskv.planner.records import explain, fallback_decision

__all__ = ["Headroom", "PlanQuery", "Plan", "Option", "plan", "explain", "fallback_decision"]
