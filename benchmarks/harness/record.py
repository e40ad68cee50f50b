"""The reproducibility record of whitepaper §10.6, written with every harness result.

Every field of §10.6 is present (:data:`RECORD_FIELDS`), plus the cache state (cold start or
warm) and the evidence state: these figures are *Measured* in a simulation, with the simulated
data plane moving no bytes.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from nexuskv.cost import CostModel
from nexuskv.policy import ExecutionPolicy

from benchmarks.harness.cluster import ClusterSpec
from benchmarks.harness.truth import TrueCosts
from benchmarks.harness.workloads import Workload

__all__ = ["RECORD_FIELDS", "KNOWN_LIMITATIONS", "revision", "build_record"]

RECORD_FIELDS = (
    "revision", "hardware_topology", "software_versions", "model_and_attention_state", "dataset_or_trace",
    "request_arrival_process", "context_and_output_lengths", "reuse_distribution", "cache_tiers_and_capacities",
    "transfer_backends", "policy_and_cost_model", "warmup_and_trial_count", "baseline", "raw_artifact_location",
    "known_limitations",
)

KNOWN_LIMITATIONS = (
    "simulated backend, not native transfer: no bytes move; copy and prefill times come from the harness's true "
    "cost model (the shipped profile changed by the drift, plus noise), not from measured hardware",
    "the true cost model is itself a model: FLOP-derived prefill, linear link costs; no real GPU, NVMe or network "
    "was exercised",
    "one prefill at a time per worker (first fit with backfilling); chunked prefill batching several requests is "
    "not modelled",
    "decode is load only (its KV blocks slow prefills through HBM reads); TPOT, inter-token latency and decode "
    "memory are not measured; decode KV does not take prefix-cache capacity",
    "in-flight decode load is read at admission for the whole prefill",
    "blocks a request reuses are touched at admission (pinned in effect until consumed)",
    "copies on one link resource (a worker's PCIe, NVMe or NIC) queue first in first out; the shared store's own "
    "bandwidth is unlimited; writes (offload, write-through to the store) cost nothing",
    "the planner's measured decision time is added to its request's TTFT and EG but does not shift later requests",
    "the oracle is greedy: the best path per decision on the state it finds, not a bound on a whole run",
    "the prefill observations that calibrate the cost model carry the compute part only (no decode interference)",
    "copies from a peer's disk (disk then network) are not observed by calibration",
    "token counts are synthetic token ids drawn per trace hash id, not a tokenizer's output",
)


def revision(root: Path) -> dict[str, Any]:
    """``git rev-parse HEAD`` of the repository and whether the tree had uncommitted changes."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(status) if status is not None else None}


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for pkg in ("numpy", "pydantic", "duckdb", "pyarrow", "nexuskv"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed as a distribution (source tree)"
    return out


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _links(model: CostModel, profile: str) -> dict[str, dict]:
    out = {}
    for (p, src, dst), link in sorted(model.links.items(), key=lambda kv: (kv[0][1].value, kv[0][2].value)):
        if p != profile:
            continue
        bw = link.bandwidth_bytes_per_s
        out[f"{src.value}->{dst.value}"] = {
            "latency_s": link.latency_s, "per_page_s": link.per_page_s,
            "bandwidth_gb_s": None if bw == float("inf") else bw / 1e9, "interference": link.interference,
            "label": link.label}
    return out


def build_record(*, root: Path, spec: ClusterSpec, truth: TrueCosts, believed: CostModel, policy: ExecutionPolicy,
                 workload: Workload, reuse_distribution: dict, policies: dict[str, str], seed: int, trials: int,
                 warmup: int, control: dict | None, artifacts: dict[str, str], wall_s: float) -> dict[str, Any]:
    """The §10.6 record of one harness run (JSON-serialisable)."""
    d = spec.descriptor("harness")
    hw = truth.hardware
    cap = spec.capacity
    bt = spec.block_tokens
    compute = believed.compute[(spec.model, spec.profile)]
    trace_file = Path(workload.source) if not workload.source.startswith("generated") else None
    return {
        "revision": revision(root),
        "hardware_topology": {
            "workers": spec.workers, "profile": spec.profile, "label": hw.label,
            "hbm_bytes_per_s": hw.hbm_bytes_per_s, "prefill_chunk_tokens": hw.prefill_chunk_tokens,
            "links_believed": _links(believed, spec.profile), "links_true": _links(truth.model, spec.profile),
            "link_resources": "per worker: pcie (host->gpu), nvme (disk->gpu, disk reads for peers), nic (network "
                              "in and out); copies on one resource queue first in first out",
            "simulated": True},
        "software_versions": _versions(),
        "model_and_attention_state": {
            "model": spec.model, "descriptor_id": d.descriptor_id, "semantic_type": d.semantic_type.value,
            "bytes_per_token": sum(d.bytes_per_token.values()), "block_tokens": bt, "dtype": "bfloat16",
            "layerwise_restore": spec.layerwise, "tpot_s": spec.tpot_s},
        "dataset_or_trace": {"workload": workload.name, "source": workload.source,
                             "sha256": _digest(trace_file) if trace_file is not None else None,
                             "params": workload.params},
        "request_arrival_process": {"process": workload.arrival, "time_scale": workload.time_scale},
        "context_and_output_lengths": workload.describe(),
        "reuse_distribution": reuse_distribution,
        "cache_tiers_and_capacities": {
            "gpu_tokens_per_worker": cap.gpu_tokens, "host_tokens_per_worker": cap.host_tokens,
            "disk_tokens_per_worker": cap.disk_tokens, "remote_store_tokens": cap.remote_tokens,
            "gpu_gib_per_worker": cap.gpu_tokens * spec.block_bytes / bt / (1 << 30),
            "eviction": "LRU per tier; GPU -> host -> disk -> dropped; store write-through, LRU",
            "cache_state": "cold start: every tier empty at t=0"
                           + (f"; the first {warmup} requests of each run left out of the figures" if warmup else ""),
            "index_event_delay_s": spec.event_delay_s},
        "transfer_backends": {
            "policy_backends": [b.model_dump(mode="json") for b in policy.backends],
            "execution": "simulated: copies take their true cost-model time on queued link resources; no bytes move"},
        "policy_and_cost_model": {
            "execution_policy": policy.tag, "believed_cost_model": believed.version,
            "believed_compute": {"mean": list(compute.params.mean), "source": compute.source},
            "true_cost_model": {"drift": truth.drift.name, "label": truth.drift.label,
                                "compute_mean": list(truth.compute.params.mean)},
            "calibration": "online: streams.calibration_agent.CalibrationWorker with the NEXUSKV_CALIBRATION_* "
                           "defaults, on simulated time",
            "policies": policies},
        "warmup_and_trial_count": {"warmup_requests": warmup, "trials": trials, "seed": seed,
                                   "trial_seeds": [seed + t for t in range(trials)],
                                   "trial_varies": "the true-cost noise draws (the workload is the same)"},
        "baseline": {"eg_reference": "recompute: engine prefix caching and external reuse off, requests on the "
                                     "worker reporting the fewest queued prefill tokens",
                     "oracle": "true costs, true state, best path per decision (per-decision upper bound)",
                     "no_reuse_control": control},
        "raw_artifact_location": artifacts,
        "known_limitations": list(KNOWN_LIMITATIONS),
        "evidence_state": "Measured (simulation): reproducible with the command and revision above; not native "
                          "hardware evidence",
        "harness_wall_s": wall_s,
    }
