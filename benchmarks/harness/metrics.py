"""Per-policy figures from the rows of one run: TTFT distribution, throughput, reuse rates, Effective Gain.

* TTFT mean, p50, p99 (seconds, planning time included).
* Throughput: requests (and prompt tokens) per second from the first arrival to the last first
  token. Under an open-loop arrival process it tracks the arrival rate until the cluster saturates;
  prefill busy seconds (``busy_s``) say how much GPU time the policy spent for the same work.
* Reuse rates, each over all prompt tokens: **logical** (the longest prefix the index reported
  anywhere), **physical** (the longest prefix truly held anywhere), **reused** (consumed by the
  executed path), **useful** (reused by requests whose realized EG was positive, and safe).
* Effective Gain: the sum over requests (``eg_s``, planning time charged); **its share of the
  oracle's** (``eg_vs_oracle``): the oracle's EG on the *same states* — its best path priced with
  the true costs on the state this policy's run was in at each admission. No realized gain exceeds
  it, request by request, so the share is at most 1: this is the upper bound. Also its share of the
  oracle *policy's* own run (``eg_vs_oracle_run``): that run is greedy and priced at admission, so
  it is not a bound on what another policy realizes (it can exceed 1).
* Utilization: prefill busy seconds over workers x span.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.harness.simulator import Row

__all__ = ["Summary", "summarize", "by_policy", "reuse_distribution"]


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    requests: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    throughput_tokens_per_s: float
    busy_s: float
    utilization: float  # busy_s / (workers * span)
    logical_rate: float
    physical_rate: float
    reused_rate: float
    useful_rate: float
    unsafe_tokens: int
    eg_s: float  # aggregate realized EG, planning time charged
    eg_mean_s: float
    eg_vs_oracle: float | None  # eg_s / the oracle's EG on this policy's own states (the bound, <= 1)
    eg_vs_oracle_run: float | None  # eg_s / the oracle policy's run's eg_s
    negative_eg_requests: int
    fallbacks: int
    failed: int
    moved_gib: float
    plan_mean_ms: float
    plan_p99_ms: float

    def as_dict(self) -> dict:
        return asdict(self)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def summarize(policy: str, rows: Sequence[Row], oracle_eg_s: float | None, *, workers: int) -> Summary:
    """The figures of one policy's rows; ``oracle_eg_s`` is the oracle run's aggregate EG."""
    if not rows:
        raise ValueError(f"{policy}: no rows to summarize")
    ttft = np.array([r.ttft_s for r in rows])
    prompt = sum(r.prompt_tokens for r in rows)
    first = min(r.arrival_s for r in rows)
    last = max(r.arrival_s + r.ttft_s for r in rows)
    span = max(last - first, 1e-9)
    eg = float(sum(r.eg_s for r in rows))
    bound = float(sum(r.oracle_eg_s for r in rows))
    plan_ms = np.array([r.plan_s * 1e3 for r in rows])
    busy = float(sum(r.prefill_s for r in rows))
    return Summary(
        policy=policy, requests=len(rows), ttft_mean_s=float(ttft.mean()), ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)), throughput_rps=len(rows) / span,
        throughput_tokens_per_s=prompt / span,
        busy_s=busy, utilization=busy / (workers * span),
        logical_rate=sum(r.logical_tokens for r in rows) / prompt,
        physical_rate=sum(r.physical_tokens for r in rows) / prompt,
        reused_rate=sum(r.reused_tokens for r in rows) / prompt,
        useful_rate=sum(r.useful_tokens for r in rows) / prompt,
        unsafe_tokens=sum(r.unsafe_tokens for r in rows), eg_s=eg, eg_mean_s=eg / len(rows),
        eg_vs_oracle=_ratio(eg, bound),
        eg_vs_oracle_run=_ratio(eg, oracle_eg_s) if oracle_eg_s is not None else None,
        negative_eg_requests=sum(1 for r in rows if r.eg_s < 0),
        fallbacks=sum(1 for r in rows if r.fallback is not None), failed=sum(1 for r in rows if r.failed),
        moved_gib=sum(r.moved_bytes for r in rows) / (1 << 30), plan_mean_ms=float(plan_ms.mean()),
        plan_p99_ms=float(np.percentile(plan_ms, 99)))


def by_policy(rows: Iterable[Row], *, warmup: int = 0) -> dict[str, list[Row]]:
    """Rows grouped by policy in arrival order, the first ``warmup`` requests of each left out."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.policy, []).append(r)
    return {p: rs[warmup:] for p, rs in out.items()}


def reuse_distribution(keys: Iterable[Sequence[int]], block_tokens: int) -> dict:
    """How much of each prompt an earlier prompt of the stream already covers (an unbounded cache).

    Policy-independent: the reuse the workload *offers*. Shares are of full blocks; the histogram
    bins are the §10.2 reuse points.
    """
    seen: set[int] = set()
    shares: list[float] = []
    offered = total = 0
    for ks in keys:
        p = 0
        for k in ks:
            if k not in seen:
                break
            p += 1
        if ks:
            shares.append(p / len(ks))
        offered += p
        total += len(ks)
        seen.update(ks)
    edges = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
    labels = ("0%", "(0,25%]", "(25,50%]", "(50,75%]", "(75,90%]", "(90,100%]")
    hist = dict.fromkeys(labels, 0)
    for s in shares:
        i = 0 if s == 0 else next(j for j in range(1, len(edges)) if s <= edges[j] + 1e-12)
        hist[labels[i]] += 1
    return {"offered_prefix_share": offered / total if total else 0.0, "requests_by_share": hist,
            "block_tokens": block_tokens,
            "definition": "blocks of each prompt's prefix already in some earlier prompt of the stream"}
