"""The vLLM connector's scheduler side takes a repeated GEMM probe from its worker's report only when
its spread is bounded (the cold-start prior's anchor)."""

from __future__ import annotations

from connectors.vllm.meta import WorkerReport
from connectors.vllm.scheduler_side import Readable, SchedulerSide
from nexuskv.descriptor import Tier
from nexuskv.policy import ExecutionPolicy
from nexuskv.priors import ColdStart
from nexuskv.profiles import ModelSpec, shipped_cost_model

from tests.factories import descriptor
from tests.planning import KeyIndex

SPEC = ModelSpec("acme/tiny", active_params=3e5, layers=2, hidden=128, label="test")


def _side() -> tuple[SchedulerSide, ColdStart]:
    d = descriptor(model=SPEC.model, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32)
    cold = ColdStart(SPEC, "vllm-cpu", block_bytes=16384, prefill_chunk_tokens=4096)
    model = shipped_cost_model()
    side = SchedulerSide(d, worker="w", index=KeyIndex(), model=lambda: model,
                         execution=lambda: ExecutionPolicy(version="t"), readable=Readable("w"),
                         probe=lambda tier, keys: [False] * len(keys), save_tier=Tier.DISK, profile="vllm-cpu",
                         cold_start=cold)
    return side, cold


def test_an_unstable_probe_is_refused_and_a_stable_one_anchors_the_prior():
    side, cold = _side()
    flops = 1e9
    swinging = tuple(flops / r for r in (13.4e9, 392e9, 40e9, 300e9, 20e9, 250e9))
    side.update_connector_output(WorkerReport(gemm_flops=flops, gemm_samples_s=(1.0, *swinging), gemm_label="test"))
    assert cold.compute is None and cold.probes_refused
    steady = tuple(flops / r for r in (60e9, 61e9, 59e9, 60e9, 60.5e9))
    side.update_connector_output(WorkerReport(gemm_flops=flops, gemm_samples_s=(1.0, *steady), gemm_label="test"))
    assert cold.compute is not None and abs(cold.compute.gemm_flops_per_s - 60e9) < 1e9


def test_reports_merge_the_probe_once():
    a = WorkerReport(gemm_flops=1e9, gemm_samples_s=(0.1, 0.1, 0.1))
    merged = WorkerReport().merged(a)
    assert merged.gemm_samples_s == (0.1, 0.1, 0.1) and merged.gemm_flops == 1e9 and bool(merged)
