"""One policy over one request stream on one simulated cluster: the per-request rows.

For each request in arrival order the simulator

1. advances simulated time to the arrival: completions (prefills store their blocks, copies
   finish) and index deliveries (kv-events batches published ``event_delay_s`` earlier) happen in
   time order;
2. builds the admission: the workers' reported loads, the true prefix every place holds, the
   true time to recompute the prompt on each worker, the **baseline** (recomputing on the worker a
   load balancer without cache awareness picks: :func:`balance`), and the oracle's best path on
   this very state;
3. asks the policy, timing the call (index lookup, planning, records): that wall time is the
   request's measured planning time;
4. carries the choice out with the true costs and records a :class:`Row`.

TTFT = queue + visible copy + prefill of the uncached tokens (+ decode and copy interference,
restore, sync) + the measured planning time. The simulated schedule itself is deterministic for
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
from dataclasses import dataclass
from typing import NamedTuple

from nexuskv.contracts.plans import WorkerLoad

from benchmarks.harness.cluster import ClusterSpec
from benchmarks.harness.keys import KeyBook
from benchmarks.harness.oracle import best_path
from benchmarks.harness.policies import Policy
from benchmarks.harness.state import Admission, ClusterState
from benchmarks.harness.truth import Drift, TrueCosts
from benchmarks.harness.workloads import Workload, prompt_tokens

__all__ = ["Row", "ROW_FIELDS", "RunOutput", "simulate", "balance"]


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


def balance(loads: tuple[WorkerLoad, ...]) -> str:
    """The load balancer of the deployment without external reuse: the worker reporting the fewest
    queued prefill tokens (then the fewest decode blocks, then by name). Recomputing there is the
    baseline every policy's Effective Gain is measured against."""
    return min(loads, key=lambda ld: (ld.queued_prefill_tokens, ld.decode_blocks, ld.worker)).worker


def simulate(policy: Policy, workload: Workload, spec: ClusterSpec, drift: Drift, *, seed: int, trial: int,
             book: KeyBook) -> RunOutput:
    """Run ``policy`` over ``workload``; rows in arrival order."""
    started = time.perf_counter()
    truth = TrueCosts(spec.profile, spec.model, drift, seed)
    state = ClusterState(spec, truth, tiers=policy.tiers, identity=policy.identity,
                         layerwise=spec.layerwise and policy.layerwise)
    policy.bind(state)
    bt = state.block_tokens
    rows: list[Row] = []
    clock = time.perf_counter_ns
    for position, r in enumerate(workload.requests):
        now = r.arrival_s
        state.advance(now)
        policy.admitted(now)
        scope = state.scope(r.tenant, r.lora)
        keys = book.keys(r, scope)
        held = keys if state.identity == "full" else book.keys(r, state.true_scope(r.tenant, r.lora))
        loads = state.loads(now)
        decode = {ld.worker: ld.decode_blocks for ld in loads}
        noise = truth.noise(position)
        prefixes, safe = state.prefixes(keys, held)
        n = r.prompt_tokens
        recompute = state.recompute(now, n, noise, decode)
        base = balance(loads)
        adm = Admission(
            position=position, now=now, request_id=r.request_id, workload=r.workload, tenant=r.tenant, lora=r.lora,
            prompt_tokens=n, output_tokens=r.output_tokens, keys=keys, held=held,
            tokens=lambda r=r: prompt_tokens(r), scope=scope,
            descriptor=state.request_descriptor(r.tenant), noise=noise, loads=loads, decode_blocks=decode,
            prefixes=prefixes, safe_prefixes=safe, recompute_s=recompute, baseline_worker=base,
            t_base_s=recompute[base])
        adm._state = state
        adm.oracle = best_path(state, adm)
        t0 = clock()
        choice = policy.decide(adm)
        plan_s = (clock() - t0) * 1e-9 if policy.timed else 0.0
        outcome = state.evaluate(adm, choice, policy.mode, commit=True)
        policy.decided(adm, choice, outcome)
        best = adm.lookup().best_certain_prefix()
        logical = min(n, best.prefix_blocks * bt) if best is not None else 0
        physical = min(n, max(prefixes.values(), default=0) * bt)
        reused = min(n, outcome.reused_blocks * bt)
        ttft = outcome.ttft_s + plan_s
        sim_eg = adm.t_base_s - outcome.ttft_s
        eg = adm.t_base_s - ttft
        mv = choice.move
        rows.append(Row(
            policy=policy.name, trial=trial, workload=r.workload, request_id=r.request_id, tenant=r.tenant,
            arrival_s=now, prompt_tokens=n, output_tokens=r.output_tokens, worker=choice.worker,
            baseline_worker=base, action=choice.action, source=str(mv.source) if mv is not None else None,
            link=outcome.link, logical_tokens=logical, physical_tokens=physical, reused_tokens=reused,
            useful_tokens=reused if (eg > 0 and outcome.unsafe_blocks == 0) else 0,
            unsafe_tokens=min(n, outcome.unsafe_blocks * bt), moved_tokens=outcome.moved_blocks * bt,
            moved_bytes=outcome.moved_bytes, queue_s=outcome.queue_s, visible_transfer_s=outcome.visible_transfer_s,
            transfer_s=outcome.transfer_s, prefill_s=outcome.prefill_s, plan_s=plan_s, sim_ttft_s=outcome.ttft_s,
            ttft_s=ttft, t_recompute_s=adm.t_base_s, sim_eg_s=sim_eg, eg_s=eg, predicted_eg_s=choice.predicted_eg_s,
            oracle_eg_s=adm.t_base_s - adm.oracle[1].ttft_s, fallback=outcome.fallback,
            failed=outcome.fallback is not None and outcome.copy_status == "not_found" and not policy.mode.fallback))
    state.advance(math.inf)
    return RunOutput(policy.name, trial, rows, policy.counters(), time.perf_counter() - started, state.batches,
                     state.index.memberships)

