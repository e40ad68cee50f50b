"""One policy over one request stream on one simulated cluster: the per-request rows.

For each request in arrival order the simulator

1. advances simulated time to the arrival: completions (prefills store their blocks, copies
   finish) and index deliveries (kv-events batches published ``event_delay_s`` earlier) happen in
   time order;
2. builds the admission: the workers' reported loads, the true prefix every place holds, the
   true time to recompute the prompt on each worker, the **baseline** (recomputing on the worker a
   load balancer without cache awareness picks: :func:`balance`), and the oracle's best path on
   this very state (priced on the state as it is: what arrives later can only delay a path);
3. asks the policy, timing the call (index lookup, planning, records): that wall time is the
   request's measured planning time;
4. carries the choice out with the true costs and records a :class:`Row`.

TTFT = queue + visible copy + prefill of the uncached tokens (+ decode and copy interference,
restore, sync) + the measured planning time. A request waiting for its copy is parked and takes
its slot when the copy is done; its row is written then. The simulated schedule itself is deterministic for
a seed: the measured planning time is added to the request's own TTFT and EG only and does not
shift later requests (it is well under a millisecond against queues of tenths of seconds), so a
rerun reproduces every decision and every simulated time exactly.

Realized Effective Gain = the baseline's true recompute TTFT - the chosen path's true TTFT
(planning time included): what the request gained over the same deployment without external
reuse (whitepaper §2.7). ``oracle_eg_s`` is the same quantity for the oracle's path on the same
state: no path a policy takes on that state beats it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from nexuskv.contracts.plans import WorkerLoad

from benchmarks.harness.cluster import ClusterSpec
from benchmarks.harness.keys import KeyBook
from benchmarks.harness.oracle import best_path
from benchmarks.harness.paths import Choice, Outcome
from benchmarks.harness.policies import Policy
from benchmarks.harness.state import Admission, ClusterState
from benchmarks.harness.truth import Drift, TrueCosts
from benchmarks.harness.workloads import Request, Workload, prompt_tokens

__all__ = ["Row", "ROW_FIELDS", "RunOutput", "simulate", "admit", "balance"]


class Row(NamedTuple):
    """One request under one policy (seconds, tokens)."""

    policy: str
    trial: int
    workload: str
    request_id: str
    tenant: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    worker: str
    baseline_worker: str
    action: str
    source: str | None  # where a copy came from ("w3/host", "remote-store/remote")
    link: str | None
    logical_tokens: int  # the longest prefix the index reported anywhere
    physical_tokens: int  # the longest prefix truly held anywhere
    reused_tokens: int  # what the executed path consumed
    useful_tokens: int  # reused tokens of requests whose realized EG > 0 (and safe)
    unsafe_tokens: int  # reused tokens of another identity (without semantic validation)
    moved_tokens: int
    moved_bytes: int
    queue_s: float
    visible_transfer_s: float
    transfer_s: float
    prefill_s: float
    plan_s: float  # measured wall time of the policy's decision
    sim_ttft_s: float  # simulated TTFT (deterministic)
    ttft_s: float  # sim_ttft_s + plan_s
    t_recompute_s: float  # the baseline: true TTFT of recomputing on the fastest worker
    sim_eg_s: float  # t_recompute_s - sim_ttft_s
    eg_s: float  # t_recompute_s - ttft_s
    predicted_eg_s: float | None
    oracle_eg_s: float  # the oracle's EG on the same state
    fallback: str | None
    failed: bool  # a copy failed and the policy had no fallback


ROW_FIELDS = Row._fields


@dataclass(frozen=True, slots=True)
class RunOutput:
    """What one run produced."""

    policy: str
    trial: int
    rows: list[Row]
    counters: dict[str, int]
    wall_s: float
    kv_batches: int
    index_memberships: int
    records: dict[str, list]  # what the decision sink would store (Policy.store_records)


def balance(loads: tuple[WorkerLoad, ...]) -> str:
    """The load balancer of the deployment without external reuse: the worker reporting the fewest
    queued prefill tokens (then the fewest decode blocks, then by name). Recomputing there is the
    baseline every policy's Effective Gain is measured against."""
    return min(loads, key=lambda ld: (ld.queued_prefill_tokens, ld.decode_blocks, ld.worker)).worker


def admit(state: ClusterState, request: Request, position: int, book: KeyBook) -> Admission:
    """The admission of ``request`` at its arrival (time must have been advanced to it)."""
    now = request.arrival_s
    scope = state.scope(request.tenant, request.lora)
    keys = book.keys(request, scope)
    held = keys if state.identity == "full" else book.keys(request, state.true_scope(request.tenant, request.lora))
    loads = state.loads(now)
    decode = {ld.worker: ld.decode_blocks for ld in loads}
    noise = state.truth.noise(position)
    prefixes, safe = state.prefixes(keys, held)
    n = request.prompt_tokens
    recompute = state.recompute(now, n, noise, decode, position)
    base = balance(loads)
    adm = Admission(
        position=position, now=now, request_id=request.request_id, workload=request.workload, tenant=request.tenant,
        lora=request.lora, prompt_tokens=n, output_tokens=request.output_tokens, keys=keys, held=held,
        tokens=lambda: prompt_tokens(request), scope=scope, descriptor=state.request_descriptor(request.tenant),
        noise=noise, loads=loads, decode_blocks=decode, prefixes=prefixes, safe_prefixes=safe,
        recompute_s=recompute, baseline_worker=base, t_base_s=recompute[base])
    adm._state = state
    adm.oracle = best_path(state, adm)
    return adm


def simulate(policy: Policy, workload: Workload, spec: ClusterSpec, drift: Drift, *, seed: int, trial: int,
             book: KeyBook, on_finish: Callable[[ClusterState], None] | None = None) -> RunOutput:
    """Run ``policy`` over ``workload``; rows in arrival order. ``on_finish`` sees the final state
    (every completion applied, every kv-events batch delivered to the index)."""
    started = time.perf_counter()
    truth = TrueCosts(spec.profile, spec.model, drift, seed)
    state = ClusterState(spec, truth, tiers=policy.tiers, identity=policy.identity,
                         layerwise=spec.layerwise and policy.layerwise, eviction=policy.eviction,
                         tier_admission=policy.tier_admission)
    policy.bind(state)
    bt = state.block_tokens
    rows: dict[int, Row] = {}
    clock = time.perf_counter_ns
    for position, r in enumerate(workload.requests):
        state.advance(r.arrival_s)
        policy.admitted(r.arrival_s)
        adm = admit(state, r, position, book)
        t0 = clock()
        choice = policy.decide(adm)
        plan_s = (clock() - t0) * 1e-9 if policy.timed else 0.0

        def placed(outcome: Outcome, adm: Admission = adm, choice: Choice = choice, plan_s: float = plan_s,
                   r: Request = r) -> None:
            policy.finished(adm, choice, outcome)
            rows[adm.position] = _row(policy, trial, r, adm, choice, outcome, plan_s, bt)

        outcome = state.evaluate(adm, choice, policy.mode, commit=True, done=placed)
        policy.decided(adm, choice, outcome)
    state.advance(math.inf)
    if on_finish is not None:
        on_finish(state)
    return RunOutput(policy.name, trial, [rows[i] for i in range(len(rows))], policy.counters(),
                     time.perf_counter() - started, state.batches, state.index.memberships,
                     policy.store_records())


def _row(policy: Policy, trial: int, r: Request, adm: Admission, choice: Choice, outcome: Outcome, plan_s: float,
         bt: int) -> Row:
    n = adm.prompt_tokens
    best = adm.lookup().best_certain_prefix()
    reused = min(n, outcome.reused_blocks * bt)
    ttft = outcome.ttft_s + plan_s
    eg = adm.t_base_s - ttft
    mv = choice.move
    return Row(
        policy=policy.name, trial=trial, workload=r.workload, request_id=r.request_id, tenant=r.tenant,
        arrival_s=adm.now, prompt_tokens=n, output_tokens=r.output_tokens, worker=choice.worker,
        baseline_worker=adm.baseline_worker, action=choice.action, source=str(mv.source) if mv is not None else None,
        link=outcome.link, logical_tokens=min(n, best.prefix_blocks * bt) if best is not None else 0,
        physical_tokens=min(n, max(adm.prefixes.values(), default=0) * bt), reused_tokens=reused,
        useful_tokens=reused if (eg > 0 and outcome.unsafe_blocks == 0) else 0,
        unsafe_tokens=min(n, outcome.unsafe_blocks * bt), moved_tokens=outcome.moved_blocks * bt,
        moved_bytes=outcome.moved_bytes, queue_s=outcome.queue_s, visible_transfer_s=outcome.visible_transfer_s,
        transfer_s=outcome.transfer_s, prefill_s=outcome.prefill_s, plan_s=plan_s, sim_ttft_s=outcome.ttft_s,
        ttft_s=ttft, t_recompute_s=adm.t_base_s, sim_eg_s=adm.t_base_s - outcome.ttft_s, eg_s=eg,
        predicted_eg_s=choice.predicted_eg_s, oracle_eg_s=adm.t_base_s - adm.oracle[1].ttft_s,  # type: ignore[index]
        fallback=outcome.fallback,
        failed=outcome.fallback is not None and outcome.copy_status == "not_found" and not policy.mode.fallback)
