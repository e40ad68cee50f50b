"""The oracle: the best path for a request under the true costs, the true state and the noise draws.

For every worker it weighs recomputing there (consuming the worker's own GPU prefix) and copying
the rest of the prefix from every place that truly holds more of it — each other worker's GPU,
host and disk, its own host and disk, the store — in full, and also only as far as a copy fully
hidden behind the worker's queue reaches. It prices each with :meth:`ClusterState.evaluate` (true
costs, link queues, gaps in the worker's schedule, this request's noise) and keeps the fastest.

It is an upper bound *per decision*: no policy's path on the same state is faster, because every
path a policy can take is among these, and what arrives later can only delay a path (a request
parked for its copy may be overtaken), never speed it up — the harness's tests check it request by
request. It is not a bound on a whole run: it is greedy (a decision that is best now can shape a
later state), and it prices paths at admission, so the oracle *policy* realizes less than it
planned whenever later arrivals overtake the requests it parked for copies.
Only the request's own state is considered: without semantic validation a policy may reuse
another tenant's blocks, which no bound should count.
"""

from __future__ import annotations

import dataclasses
import math

from nexuskv.descriptor import Tier

from benchmarks.harness.paths import Choice, ExecMode, Move, Outcome, Place
from benchmarks.harness.state import Admission, ClusterState

__all__ = ["ORACLE_MODE", "best_path"]

#: The data plane the oracle assumes: every mechanism on, no deadline (it knows when copies land).
ORACLE_MODE = ExecMode(local_reuse=True, async_copy=True, layerwise=True, fallback=False)


def _hidden_end(state: ClusterState, adm: Admission, worker: str, source: Place, local: int, end: int,
                start: float) -> int | None:
    """The last block a copy from ``source`` can bring before ``start``, when the worker would
    begin the request anyway (None: no such block strictly between ``local`` and ``end``)."""
    link, resources = state.route(source, worker)
    copy_start = max(adm.now, state.links.free_at(resources))
    cost = state.truth.links[link]
    factor = adm.noise.links[link]
    per_block = (cost.per_page_s * state.groups + state.block_bytes / cost.bandwidth_bytes_per_s) * factor
    spare = start - copy_start - cost.latency_s * factor
    if spare <= 0 or per_block <= 0 or math.isinf(per_block):
        return None
    b = local + int(spare / per_block)
    return b if local < b < end else None


def best_path(state: ClusterState, adm: Admission) -> tuple[Choice, Outcome]:
    """The fastest path for ``adm`` on ``state`` (ties: fewer blocks copied, then worker name)."""
    own = adm if state.identity == "full" else dataclasses.replace(adm, prefixes=adm.safe_prefixes)
    best: tuple[tuple, Choice, Outcome] | None = None
    sources = sorted(own.prefixes.items(), key=lambda kv: str(kv[0]))
    for w in state.workers:
        local = own.prefixes.get(Place(w, Tier.GPU), 0)
        gpu = state.places.get(Place(w, Tier.GPU))
        stay = Choice(w, None, action="recompute" if local == 0 else "reuse")
        stayed = state.evaluate(own, stay, ORACLE_MODE)
        weighed = [(stay, stayed)]
        for place, prefix in sources:
            if prefix <= local or place == Place(w, Tier.GPU):
                continue
            ends = [prefix]
            cut = _hidden_end(state, own, w, place, local, prefix, stayed.start)
            if cut is not None:
                ends.append(cut)
            for end in ends:
                count = end - local if gpu is None else sum(1 for k in own.keys[local:end] if k not in gpu.blocks)
                c = Choice(w, Move(place, local, end, count), action="copy")
                weighed.append((c, state.evaluate(own, c, ORACLE_MODE)))
        for c, o in weighed:
            rank = (o.ttft_s, o.moved_blocks, w)
            if best is None or rank < best[0]:
                best = (rank, c, o)
    assert best is not None
    _rank, choice, outcome = best
    return dataclasses.replace(choice, predicted_eg_s=adm.t_base_s - outcome.ttft_s), outcome
