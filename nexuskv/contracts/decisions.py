"""``nexuskv.decisions``: the decision record — what was chosen, why, and every predicted term.

Keyed by request id. A decision is one of full reuse, partial reuse, route to state, transfer
and materialize, prefetch, or recompute. It records the Effective Gain
``EG = T_compute - T_cache`` of the chosen action with every term of ``T_cache``, the
conservative bound the gate used, each alternative considered with its own numbers and the
reason it lost, and the versions of the policy and cost model that decided. Times in seconds.
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
Seconds = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


class Action(StrEnum):
    FULL_REUSE = "full_reuse"
    PARTIAL_REUSE = "partial_reuse"
    ROUTE_TO_STATE = "route_to_state"
    TRANSFER = "transfer"
    PREFETCH = "prefetch"
    RECOMPUTE = "recompute"


class CostTerms(Contract):
    """Terms of ``T_cache`` (whitepaper §2.5), seconds; ``total_s`` is their visible sum."""

    lookup_s: Seconds = 0.0
    queue_s: Seconds = 0.0
    transfer_s: Seconds = 0.0
    overlap_s: Seconds = 0.0
    restore_s: Seconds = 0.0
    sync_s: Seconds = 0.0
    interference_s: Seconds = 0.0
    total_s: Seconds = 0.0


class Alternative(Contract):
    """One option the planner weighed, with its numbers and why it was or was not chosen."""

    action: Action
    worker: Text
    source: EntryLocation | None = None
    destination: EntryLocation | None = None
    reused_tokens: Count = 0
    t_compute_s: Seconds  # recompute time of the whole request on this worker
    t_with_reuse_s: Seconds  # time to first token along this option
    terms: CostTerms = CostTerms()
    eg_s: Seconds  # expected Effective Gain
    eg_lower_s: Seconds  # conservative bound used by the gate
    chosen: bool = False
    rejected_reason: str | None = None


class Decision(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    request_id: Text
    tenant_namespace: Text
    decided_at: Annotated[float, Field(ge=0)]  # seconds since the epoch (passed-in clock)
    action: Action
    worker: Text  # where the request should run
    source: EntryLocation | None = None
    destination: EntryLocation | None = None
    prompt_tokens: Count
    reused_tokens: Count = 0  # tokens whose state is reused (the extent)
    reused_blocks: Count = 0
    deadline_at: float | None = None  # prefetch / transfer readiness deadline
    t_compute_s: Seconds
    t_with_reuse_s: Seconds
    terms: CostTerms = CostTerms()
    eg_s: Seconds
    eg_lower_s: Seconds
    reason: Text
    alternatives: tuple[Alternative, ...] = ()
    policy_version: Text
    cost_model_version: Text
    index_lag_events: Count = 0
    index_lag_ms: Annotated[float, Field(ge=0)] = 0.0
    workload: Text | None = None
    trace_id: str | None = None
