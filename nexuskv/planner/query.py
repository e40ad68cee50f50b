"""What the planner is asked (:class:`PlanQuery`) and the movement budget it plans within (:class:`Headroom`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nexuskv.contracts.plans import PlanRequest, WorkerLoad
from nexuskv.descriptor import StateDescriptor
from nexuskv.identity import IdentityScope

__all__ = ["Headroom", "PlanQuery"]


@dataclass(frozen=True, slots=True)
class Headroom:
    """Budget left for planned movement (from :class:`~nexuskv.planner.prefetch.PrefetchScheduler`).

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
    # Planned before the engine has the request (a fleet planner at admission): its fixed per-request
    # cost (HTTP, tokenisation) is still ahead and is in every predicted TTFT. False for an engine's
    # own connector, which is asked once the engine has tokenised the request.
    at_admission: bool = True

    def __post_init__(self) -> None:
        if self.scope.descriptor_id != self.descriptor.descriptor_id:
            raise ValueError("descriptor: does not match the query's scope")
        if len(self.keys) != self.prompt_tokens // self.descriptor.block_size:
            raise ValueError("keys: one key per full block of prompt_tokens")
        if not self.candidates:
            raise ValueError("candidates: at least one worker")

    @classmethod
    def from_request(cls, request: PlanRequest, descriptor: StateDescriptor) -> PlanQuery:
        """The query of a plan request."""
        return cls(request_id=request.request_id, scope=request.scope, descriptor=descriptor, keys=request.keys,
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
