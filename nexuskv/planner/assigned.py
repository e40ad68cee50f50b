"""The planner's own recent decisions, as load its callers cannot have reported yet.

A caller sends a plan request with each candidate's load as it saw it at ``arrival_at``: the
requests it has already sent there. A request the planner sent to a worker a moment ago is not in
that snapshot when its decision was still on its way back (one bus trip), or when the caller was
still waiting for it. In a burst every request then sees the same empty queues and the planner
sends them all to the one worker holding their prefix (measured in the skewed replay: 67-81% of
requests on one of two engines, 3-11 of 36 decisions with any queue term). A router that decides
adds what it decided at once (Dynamo's router counts a request on its worker when it routes it);
this is that count for a planner whose callers report load.

:class:`RecentAssignments` keeps, per worker, the compute each decision sent there (its prefills,
tokens and token products, as the queue term counts them) and adds to a candidate's load the
decisions younger than the request's snapshot less one trip back: the ones its caller cannot have
counted. Older decisions are the caller's to report (or done). Pure bookkeeping: times are passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from nexuskv.contracts.plans import WorkerLoad

__all__ = ["RecentAssignments"]


class RecentAssignments:
    """Decisions the planner made recently (bounded in time and count)."""

    HORIZON_S = 5.0  # a decision older than this is in any caller's snapshot (or done)
    CAPACITY = 65_536

    def __init__(self) -> None:
        # (decided_at, worker, compute tokens, context tokens), oldest first
        self._made: deque[tuple[float, str, int, int]] = deque()
        self.added = 0  # candidates whose load this added to

    def decided(self, worker: str, *, compute_tokens: int, prompt_tokens: int, at: float) -> None:
        """The planner sent a request to ``worker`` that computes ``compute_tokens`` of ``prompt_tokens``."""
        self._made.append((at, worker, max(0, compute_tokens), prompt_tokens))
        while len(self._made) > self.CAPACITY:
            self._made.popleft()

    def forget(self, *, now: float) -> None:
        made = self._made
        while made and made[0][0] < now - self.HORIZON_S:
            made.popleft()

    def loads(self, candidates: Sequence[WorkerLoad], *, since: float) -> tuple[WorkerLoad, ...]:
        """``candidates`` with every decision made after ``since`` added to its worker's queue."""
        extra: dict[str, list[int]] = {}
        for at, worker, e, n in reversed(self._made):
            if at <= since:
                break
            acc = extra.setdefault(worker, [0, 0, 0])
            acc[0] += 1
            acc[1] += e
            acc[2] += e * n
        if not extra:
            return tuple(candidates)  # the same tuple when given one
        out = []
        for c in candidates:
            acc = extra.get(c.worker)
            if acc is None or acc[0] == 0:
                out.append(c)
                continue
            self.added += 1
            out.append(c.model_copy(update={
                "queued_prefill_requests": c.queued_prefill_requests + acc[0],
                "queued_prefill_tokens": c.queued_prefill_tokens + acc[1],
                "queued_prefill_token_products": c.queued_prefill_token_products + acc[2]}))
        return tuple(out)
