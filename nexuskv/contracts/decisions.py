"""``nexuskv.decisions``: the decision record — what was chosen, why, and every predicted term.

Keyed by request id. A decision is one of full reuse, partial reuse, route to state, transfer
and materialize, prefetch, or recompute. Every option is compared with the same baseline:
recomputing the whole prompt on the candidate where that is fastest (its queue included),
``t_compute_s``. An option's predicted time to first token is
``t_with_reuse_s = T_cache + t_tail_s`` with
``T_cache = lookup + queue + max(0, transfer - overlap) + restore + sync + interference``
(:class:`CostTerms`) and ``t_tail_s`` the compute of the tokens it does not reuse. Its
Effective Gain is ``eg_s = t_compute_s - t_with_reuse_s``; for a prefetch,
``eg_s = P_use*G - (1 - P_use)*(T_transfer + C_pollution + C_interference)``. The gate acts only
when the conservative bound ``eg_lower_s = eg_s - z*eg_std_s`` is positive, so no action other
than recompute is ever chosen with ``eg_s <= 0``.

The record keeps the alternatives considered (the best ``max_alternatives`` of
``alternatives_total``; rejected candidates with the reason, uncosted ones with ``eg_s`` None),
and the versions of the policy and cost model that decided. ``revision`` 0 is the plan at
admission; a later revision (a prefetch that missed its deadline, a failed transfer) supersedes
it with a recompute. Times in seconds; instants in seconds since the epoch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from nexuskv.contract import Contract
from nexuskv.entries import EntryLocation

__all__ = ["SCHEMA_VERSION", "Action", "CostTerms", "Alternative", "Decision"]

SCHEMA_VERSION = 1
Text = Annotated[str, Field(min_length=1, max_length=1024)]
Reason = Annotated[str, Field(min_length=1, max_length=4096)]
Seconds = Annotated[float, Field(allow_inf_nan=False)]
NonNegSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1)]
Count = Annotated[int, Field(ge=0)]


class Action(StrEnum):
    FULL_REUSE = "full_reuse"
    PARTIAL_REUSE = "partial_reuse"
    ROUTE_TO_STATE = "route_to_state"
    TRANSFER = "transfer"
    PREFETCH = "prefetch"
    RECOMPUTE = "recompute"


class CostTerms(Contract):
    """Terms of ``T_cache`` (whitepaper §2.5), seconds; ``total_s`` is their visible sum.

    ``request_s`` is the fixed per-request cost outside the forward pass (HTTP, tokenisation), fitted
    from request observations; it is in every option's time to first token alike (0 where none was
    fitted, and for an engine's own connector, which plans after it).
    """

    lookup_s: Seconds = 0.0
    queue_s: Seconds = 0.0
    transfer_s: Seconds = 0.0
    overlap_s: Seconds = 0.0
    restore_s: Seconds = 0.0
    sync_s: Seconds = 0.0
    interference_s: Seconds = 0.0
    total_s: Seconds = 0.0
    request_s: Seconds = 0.0


class Alternative(Contract):
    """One option the planner weighed, with its numbers and why it was or was not chosen."""

    action: Action
    worker: Text  # where the request would run
    source: EntryLocation | None = None
    destination: EntryLocation | None = None
    backend: Text | None = None
    reused_tokens: Count = 0
    reused_blocks: Count = 0
    t_compute_s: Seconds  # the recompute baseline (same for every alternative of a decision)
    t_tail_s: NonNegSeconds | None = None  # compute of the tokens this option does not reuse
    t_with_reuse_s: Seconds | None = None  # predicted time to first token along this option
    terms: CostTerms = CostTerms()
    eg_s: Seconds | None = None  # expected Effective Gain; None when it could not be costed
    eg_std_s: NonNegSeconds = 0.0
    eg_lower_s: Seconds | None = None  # conservative bound used by the gate
    p_use: Probability | None = None  # prefetch: P(ready by the deadline and consumed)
    deadline_at: float | None = None
    chosen: bool = False
    rejected_reason: Reason | None = None


class Decision(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    request_id: Text
    revision: Count = 0
    tenant_namespace: Text
    decided_at: Annotated[float, Field(ge=0)]  # seconds since the epoch (passed-in clock)
    action: Action
    worker: Text  # where the request should run
    baseline_worker: Text | None = None  # where recomputing is fastest
    source: EntryLocation | None = None
    destination: EntryLocation | None = None
    backend: Text | None = None
    prompt_tokens: Count
    reused_tokens: Count = 0  # tokens whose state is reused (the extent)
    reused_blocks: Count = 0
    deadline_at: float | None = None  # prefetch / transfer readiness deadline
    t_compute_s: Seconds
    t_tail_s: NonNegSeconds = 0.0
    t_with_reuse_s: Seconds
    terms: CostTerms = CostTerms()
    eg_s: Seconds
    eg_std_s: NonNegSeconds = 0.0
    eg_lower_s: Seconds
    p_use: Probability | None = None
    reason: Reason
    alternatives: tuple[Alternative, ...] = ()
    alternatives_total: Count = 0
    policy_version: Text
    cost_model_version: Text
    index_lag_events: Count = 0
    index_lag_ms: Annotated[float, Field(ge=0)] = 0.0
    workload: Text | None = None
    trace_id: str | None = None
    # The gate declined the chosen option as uncertain (lower bound <= min_gain) and the exploration
    # budget took it anyway, so that the fit it rests on gets observed (nexuskv.planner.gate.explore).
    explored: bool = False
