"""``run_harness(config) -> HarnessResult``: every policy (and ablation) over one workload, side by side.

The workload, the cluster, the true costs and every seed are the same for every policy; each
policy runs on a fresh simulated cluster (cold caches). Runs are independent, so they go to
``config.jobs`` processes (forked: the workload and its keys, computed once, are shared). A small
no-reuse control (``recompute`` and ``nexuskv`` only) measures NexusKV's overhead where there is
nothing to reuse.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from nexuskv.identity import IdentityScope
from nexuskv.profiles import shipped_cost_model

from benchmarks.harness.cluster import Capacity, ClusterSpec
from benchmarks.harness.keys import KeyBook
from benchmarks.harness.metrics import Summary, by_policy, reuse_distribution, summarize
from benchmarks.harness.policies import ABLATIONS, BASELINES, POLICY_NOTES, NexusKV, make_policy
from benchmarks.harness.record import build_record
from benchmarks.harness.simulator import Row, RunOutput, simulate
from benchmarks.harness.state import SHARED_TENANT
from benchmarks.harness.truth import DRIFTS, TrueCosts
from benchmarks.harness.workloads import Workload, no_reuse_workload, shapes_workload, trace_workload
from benchmarks.trace_events import CONVERSATION_TRACE, SYNTHETIC_TRACE

__all__ = ["TRACES", "HarnessConfig", "HarnessResult", "run_harness", "build_workload"]

TRACES = ("conversation", "synthetic", "shapes")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class HarnessConfig:
    """One harness run. Every field lands in the reproducibility record."""

    trace: str = "conversation"
    requests: int = 1000
    workers: int = 8
    #: Trace replay: arrival = trace timestamp / time_scale (2 = the trace played twice as fast).
    time_scale: float = 2.0
    #: Generated workloads: arrival rate such that recomputing everything would keep this share
    #: of the workers busy (by the shipped cost model).
    load: float = 0.6
    arrival: str = "poisson"
    seed: int = 0
    trials: int = 1
    policies: tuple[str, ...] = BASELINES
    ablations: bool = False
    drift: str = "drift"
    control_requests: int = 200
    warmup: int = 0
    model: str = ClusterSpec.model
    profile: str = ClusterSpec.profile
    capacity: Capacity = field(default_factory=Capacity)
    event_delay_s: float = ClusterSpec.event_delay_s
    layerwise: bool = True
    jobs: int = 2
    out: Path | None = None
    trace_path: Path | None = None

    def __post_init__(self) -> None:
        if self.trace not in TRACES:
            raise ValueError(f"trace: {self.trace!r} is not one of {TRACES}")
        if self.drift not in DRIFTS:
            raise ValueError(f"drift: {self.drift!r} is not one of {tuple(DRIFTS)}")
        unknown = [p for p in self.policies if p not in BASELINES and p not in ABLATIONS]
        if unknown:
            raise ValueError(f"policies: unknown {unknown}")
        if "oracle" not in self.policies:
            raise ValueError("policies: the oracle is needed (the side by side compares every policy with it)")
        if self.requests < 1 or self.trials < 1 or self.jobs < 1 or self.warmup < 0:
            raise ValueError("requests, trials and jobs must be positive, warmup not negative")
        if self.warmup >= self.requests:
            raise ValueError("warmup: must leave requests to measure")

    def spec(self) -> ClusterSpec:
        return ClusterSpec(workers=self.workers, model=self.model, profile=self.profile, capacity=self.capacity,
                           layerwise=self.layerwise, event_delay_s=self.event_delay_s)

    @property
    def runs(self) -> tuple[str, ...]:
        return tuple(self.policies) + (tuple(a for a in ABLATIONS if a not in self.policies) if self.ablations else ())


@dataclass
class HarnessResult:
    """Rows and figures of a harness run."""

    config: HarnessConfig
    workload: Workload
    rows: list[Row]  # every (trial, policy, request), control runs excluded
    trials: list[dict[str, Summary]]  # per trial, per policy
    counters: dict[str, dict[str, int]]  # per "policy#trial": the policy's own counts
    control: dict | None
    record: dict
    wall_s: float
    files: dict[str, str] = field(default_factory=dict)
    # NexusKV's first trial as the pipeline's decision sink would store it (decisions, transfer
    # results, observations): the harness DuckDB file holds it in the decision store's schema.
    store_records: dict[str, list] = field(default_factory=dict)

    def summary(self, policy: str, trial: int = 0) -> Summary:
        return self.trials[trial][policy]

    def median(self, policy: str, attr: str) -> float | None:
        """The median over trials of one figure of one policy."""
        values = [getattr(t[policy], attr) for t in self.trials]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def best_other(self, attr: str = "eg_vs_oracle") -> tuple[str, float] | None:
        """The best policy other than NexusKV and the oracle by the median of ``attr``."""
        best = None
        for p in self.config.policies:
            if p in ("nexuskv", "oracle"):
                continue
            v = self.median(p, attr)
            if v is not None and (best is None or v > best[1]):
                best = (p, v)
        return best


def _nominal_prefill_s(workload: Workload, spec: ClusterSpec) -> float:
    compute = shipped_cost_model().compute[(spec.model, spec.profile)]
    return statistics.fmean(compute.seconds(r.prompt_tokens, r.prompt_tokens) for r in workload.requests)


def _paced(make, load: float, workers: int, spec: ClusterSpec) -> Workload:
    """A generated workload whose rate keeps ``load`` of the workers busy recomputing (shipped costs)."""
    probe = make(1.0)  # the prompts do not depend on the rate: same seed, same draws
    return make(load * workers / _nominal_prefill_s(probe, spec))


def build_workload(config: HarnessConfig) -> Workload:
    spec = config.spec()
    if config.trace == "conversation":
        return trace_workload(config.trace_path or CONVERSATION_TRACE, requests=config.requests,
                              time_scale=config.time_scale)
    if config.trace == "synthetic":
        return trace_workload(config.trace_path or SYNTHETIC_TRACE, requests=config.requests,
                              time_scale=config.time_scale)
    return _paced(lambda rate: shapes_workload(requests=config.requests, seed=config.seed, rate_per_s=rate,
                                               arrival=config.arrival), config.load, config.workers, spec)


def _control(config: HarnessConfig) -> Workload | None:
    if config.control_requests <= 0:
        return None
    return _paced(lambda rate: no_reuse_workload(requests=config.control_requests, seed=config.seed + 7919,
                                                 rate_per_s=rate), config.load, config.workers, config.spec())


# Shared with forked run processes (set before the pool starts, read-only afterwards).
_SHARED: dict = {}


def _run(task: tuple[str, str, int]) -> RunOutput:
    which, policy, trial = task
    config: HarnessConfig = _SHARED["config"]
    spec = config.spec()
    keep = which == "main" and policy == "nexuskv" and trial == 0  # the run the DuckDB file stores
    return simulate(make_policy(policy, spec.profile, keep_records=keep), _SHARED[which], spec, DRIFTS[config.drift],
                    seed=config.seed + trial, trial=trial, book=_SHARED["book"])


def _key_all(book: KeyBook, spec: ClusterSpec, workloads: list[Workload], tokens_scope: bool) -> None:
    shared = IdentityScope.of(spec.descriptor(SHARED_TENANT))
    for wl in workloads:
        for r in wl.requests:
            book.keys(r, IdentityScope.of(spec.descriptor(r.tenant), lora=r.lora))
            if tokens_scope:
                book.keys(r, shared)


def run_harness(config: HarnessConfig) -> HarnessResult:
    """Run every policy of ``config`` on the same workload; summaries, record and rows."""
    started = time.perf_counter()
    spec = config.spec()
    workload = build_workload(config)
    control = _control(config)
    book = KeyBook(spec.block_tokens)
    _key_all(book, spec, [workload] + ([control] if control else []), "no-semantic-validation" in config.runs)
    tasks = [("main", p, t) for t in range(config.trials) for p in config.runs]
    if control is not None:
        tasks += [("control", p, 0) for p in ("recompute", "nexuskv")]
    _SHARED.update(config=config, main=workload, control=control, book=book)
    try:
        if config.jobs > 1 and len(tasks) > 1:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=config.jobs, mp_context=ctx) as pool:
                outputs = list(pool.map(_run, tasks))
        else:
            outputs = [_run(t) for t in tasks]
    finally:
        _SHARED.clear()
    main = [o for o, t in zip(outputs, tasks) if t[0] == "main"]
    rows = [r for o in main for r in o.rows]
    trials = []
    for trial in range(config.trials):
        grouped = by_policy((r for o in main if o.trial == trial for r in o.rows), warmup=config.warmup)
        oracle_eg = sum(r.eg_s for r in grouped["oracle"])
        trials.append({p: summarize(p, grouped[p], oracle_eg, workers=config.workers) for p in config.runs})
    counters = {f"{o.policy}#{o.trial}": {**o.counters, "kv_batches": o.kv_batches,
                                          "index_memberships_at_end": o.index_memberships,
                                          "run_wall_s": round(o.wall_s, 2)} for o in main}
    control_figures = None
    if control is not None:
        ctl = {o.policy: summarize(o.policy, o.rows, None, workers=config.workers) for o, t in zip(outputs, tasks)
               if t[0] == "control"}
        base, nkv = ctl["recompute"], ctl["nexuskv"]
        control_figures = {
            "workload": control.source, "requests": len(control.requests), "arrival": control.arrival,
            "recompute_ttft_mean_s": base.ttft_mean_s, "nexuskv_ttft_mean_s": nkv.ttft_mean_s,
            "overhead": nkv.ttft_mean_s / base.ttft_mean_s - 1.0,
            "overhead_p50": nkv.ttft_p50_s / base.ttft_p50_s - 1.0,
            "overhead_p99": nkv.ttft_p99_s / base.ttft_p99_s - 1.0,
            "nexuskv_plan_mean_ms": nkv.plan_mean_ms, "nexuskv_plan_p99_ms": nkv.plan_p99_ms,
            "nexuskv_reused_rate": nkv.reused_rate}
    truth = TrueCosts(spec.profile, spec.model, DRIFTS[config.drift], config.seed)
    nexus = make_policy("nexuskv", spec.profile)
    assert isinstance(nexus, NexusKV)
    notes = {p: POLICY_NOTES.get(p) or f"nexuskv with {ABLATIONS[p]}" for p in config.runs}
    out_dir = config.out
    artifacts = {"directory": str(out_dir) if out_dir else None,
                 "duckdb": str(out_dir / "harness.duckdb") if out_dir else None,
                 "record": str(out_dir / "record.json") if out_dir else None}
    record = build_record(
        root=ROOT, spec=spec, truth=truth, believed=shipped_cost_model(), policy=nexus.policy, workload=workload,
        reuse_distribution=reuse_distribution((book.keys(r, IdentityScope.of(spec.descriptor(r.tenant), lora=r.lora))
                                               for r in workload.requests), spec.block_tokens),
        policies=notes, seed=config.seed, trials=config.trials, warmup=config.warmup, control=control_figures,
        artifacts=artifacts, wall_s=time.perf_counter() - started)
    store = next((o.records for o in main if o.policy == "nexuskv" and o.trial == 0), {})
    return HarnessResult(config, workload, rows, trials, counters, control_figures, record,
                         time.perf_counter() - started, store_records=store)
