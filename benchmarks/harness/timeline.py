"""Time on the simulated workers: prefill slots, in-flight decode, and busy links.

* :class:`Timeline` — one worker's prefill engine as busy intervals. A job goes in the earliest
  gap at or after the time it is ready that fits it (first come first served with backfilling):
  a request parked while its state is copied in does not hold up the requests behind it, as an
  engine that parks requests waiting for remote KV does (vLLM's ``WAITING_FOR_REMOTE_KVS``).
* :class:`DecodeLoad` — requests decoding on a worker, as KV blocks (what decode costs a prefill).
* :class:`Links` — when each link resource (a worker's PCIe, NVMe, NIC) is next free: copies on
  one resource queue behind each other.
"""

from __future__ import annotations

import bisect

__all__ = ["Timeline", "DecodeLoad", "Links"]


class Timeline:
    """Busy prefill intervals of one worker, ``[start, end)`` seconds, sorted by start."""

    __slots__ = ("_starts", "_jobs")

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._jobs: list[tuple[float, float, int]] = []  # (start, end, uncached tokens)

    def earliest(self, ready: float, duration: float) -> float:
        """The earliest start ``>= ready`` of a job of ``duration`` seconds."""
        t = ready
        end_needed = t + duration
        for start, end, _tokens in self._jobs:
            if end <= t:
                continue
            if start >= end_needed:
                return t
            t = end
            end_needed = t + duration
        return t

    def reserve(self, start: float, duration: float, tokens: int) -> None:
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._jobs.insert(i, (start, start + duration, tokens))

    def prune(self, now: float) -> None:
        """Forget jobs that ended before ``now``."""
        if self._jobs and self._jobs[0][1] <= now:
            keep = [j for j in self._jobs if j[1] > now]
            self._jobs = keep
            self._starts = [j[0] for j in keep]

    def queued_tokens(self, now: float) -> int:
        """Prefill tokens not yet computed at ``now`` (a running job counts its remaining share)."""
        total = 0.0
        for start, end, tokens in self._jobs:
            if end <= now:
                continue
            if start >= now:
                total += tokens
            else:
                total += tokens * (end - now) / (end - start)
        return int(total)

    def jobs(self, now: float) -> int:
        return sum(1 for _s, end, _t in self._jobs if end > now)

    def busy_until(self) -> float:
        return max((end for _s, end, _t in self._jobs), default=0.0)


class DecodeLoad:
    """Requests decoding on one worker: ``(start, end, blocks)`` each."""

    __slots__ = ("_spans",)

    def __init__(self) -> None:
        self._spans: list[tuple[float, float, int]] = []

    def add(self, start: float, end: float, blocks: int) -> None:
        self._spans.append((start, end, blocks))

    def blocks(self, now: float) -> int:
        """KV blocks of the requests decoding at ``now``."""
        live = [s for s in self._spans if s[1] > now]
        if len(live) != len(self._spans):
            self._spans = live
        return sum(b for start, _end, b in live if start <= now)

    def requests(self, now: float) -> int:
        return sum(1 for start, end, _b in self._spans if start <= now < end)


class Links:
    """When each link resource is next free, seconds."""

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: dict[str, float] = {}

    def free_at(self, resources: tuple[str, ...]) -> float:
        return max((self._free.get(r, 0.0) for r in resources), default=0.0)

    def hold(self, resources: tuple[str, ...], until: float) -> None:
        for r in resources:
            if self._free.get(r, 0.0) < until:
                self._free[r] = until
