"""How long a transfer command takes to start at its destination, measured: the planner adds it
to a commanded copy's transfer time and deadline (a prefetch must hide delivery plus copy).
Pure bookkeeping: times are passed in."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["DispatchDelays"]


class DispatchDelays:
    """How long a transfer command takes to start at its destination, measured (seconds).

    Two measurements: a command's own, ``started_at - issued_at`` from its result (per destination
    worker: the bus, the executor's queue), and every plan request's trip to this planner
    (``now - arrival_at``: the same bus, a lower bound for a command's). The estimate for a worker
    is the larger of its commands' moving mean and the requests'; before its first result, twice
    the requests' (a trip, then the executor's poll and queue, assumed as long). Without it a deadline is a copy
    time after the decision, and a command that spends longer on the bus is refused unstarted
    ("deadline passed before the transfer started").
    """

    ALPHA = 0.3  # weight of the newest measurement in each moving mean
    MAX_TRIP_S = 1.0  # a plan request's delay beyond this is a backlog, not the bus's trip time
    CAPACITY = 4096  # commands awaiting their result

    def __init__(self) -> None:
        self.bus_s = 0.0
        self.by_worker: dict[str, float] = {}
        self._issued: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def request_arrived(self, arrival_at: float, now: float) -> None:
        delay = now - arrival_at
        if 0.0 <= delay < self.MAX_TRIP_S:  # longer: a backlog (a planner starting, catching up), not a trip
            self.bus_s += self.ALPHA * (delay - self.bus_s)

    def issued(self, transfer_id: str, worker: str, issued_at: float) -> None:
        self._issued[transfer_id] = (worker, issued_at)
        while len(self._issued) > self.CAPACITY:
            self._issued.popitem(last=False)

    def started(self, transfer_id: str, started_at: float) -> None:
        entry = self._issued.pop(transfer_id, None)
        if entry is None:
            return
        worker, issued_at = entry
        delay = max(0.0, started_at - issued_at)
        was = self.by_worker.get(worker)
        self.by_worker[worker] = delay if was is None else was + self.ALPHA * (delay - was)

    def estimates(self, workers: Iterable[str]) -> dict[str, float]:
        # Before a worker's first command result: a trip over the bus and as long again for the
        # executor's poll and queue (assumed); after it, what its commands took, never below a trip.
        return {w: max(self.by_worker[w], self.bus_s) if w in self.by_worker else 2.0 * self.bus_s for w in workers}
