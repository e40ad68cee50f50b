"""Shipped hardware and model profiles: the cost model before any observation, every number labelled.

Sources are ``../shared/reference/anchors.md`` (§3 unless said otherwise). Each number says whether
it was *measured* by someone (and where), *derived* here from measured numbers, an *estimate*
(anchors' own or ours, with the method) or *assumed* (a placeholder of the right order that online
calibration replaces). Uncertainties follow the label: measured bandwidths ±10%, FLOP-derived
compute ±25% per coefficient, estimates ±30%, assumed latencies ±100%.

Hardware profiles (one worker each):

* ``h200x1-rdma4x200`` — one H200, PCIe Gen5 host link (~50 GB/s one way, measured on H100 PCIe5
  pinned, vLLM blog; H200 SXM has the same link), one Gen4 NVMe (~6.5 GB/s), cross-node Mooncake
  Transfer Engine over 4×200 Gbps RDMA (87 GB/s measured on 40 GB transfers).
* ``h200x8-rdma8x400`` — eight H200 (TP8), TE over 8×400 Gbps RDMA (190 GB/s measured).
* ``h200x8-tcp4x200`` — the same node with TE's TCP transport over 4×200 Gbps: 87 GB/s / 4.6
  (anchors: "TCP is 2.4–4.6× slower"; the slow end), about 18.9 GB/s.

Compute profiles are FLOP-derived as in anchors §3: ``flops(n) = 2*P*n + 2*l*d*n^2`` (P active
parameters, l layers, d hidden size; the attention term is causal), divided by
``peak * gpus * MFU`` with BF16 dense peak 989 TFLOPS per H100/H200 GPU, MFU 0.5 on one GPU and 0.4
at TP8. That gives ``c1 = 2P/(peak*gpus*MFU)``, ``c2 = 2*l*d/(peak*gpus*MFU)`` and reproduces the
anchors' table (Llama-3.1-8B 1 GPU, Llama-3.1-70B TP8, Qwen3-32B TP8) to within 3%. ``c0`` (fixed
per-prefill overhead) is not in a FLOP count: it ships as 0 ± 5 ms and calibration fits it.
DeepSeek-V3 is not in the anchors' table; its profile uses the same method with 37B activated
parameters (an estimate: MLA attention is costlier than this form says, and V3 usually runs FP8).

``SGLANG_26305`` encodes the sglang#26305 table (MiniMax-M2.7, SGLang v0.5.10, 90% hit) as two
operating points whose predicted TTFTs equal the published ones: the file-backed L3 hit is slower
than recomputing at 8K and at 128K; the HBM hit wins at both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nexuskv.cost import ComputeCost, CostModel, HardwareProfile, LinearCost, LinkCost, extent_bytes
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.models import gqa_descriptor

__all__ = [
    "SHIPPED_BASE",
    "Accelerator",
    "ModelSpec",
    "H200",
    "MODEL_SPECS",
    "HARDWARE",
    "LINKS",
    "COMPUTE",
    "flop_compute",
    "shipped_cost_model",
    "OperatingPoint",
    "SGLANG_26305",
    "minimax_m27_descriptor",
    "sglang_26305_cost_model",
]

SHIPPED_BASE = "anchors-2026-11"

# Relative uncertainty by kind of source.
MEASURED, ESTIMATE, FLOP_DERIVED, ASSUMED = 0.10, 0.30, 0.25, 1.0


@dataclass(frozen=True, slots=True)
class Accelerator:
    """A GPU model's dense peak and the MFU a profile assumes for it."""

    name: str
    peak_flops: float  # dense BF16 FLOP/s per GPU
    hbm_bytes_per_s: float  # per GPU
    label: str


H200 = Accelerator(
    "H200", 989e12, 4.8e12,
    "peak: anchors §3 (BF16 dense 989 TFLOPS per H100/H200); HBM 4.8 TB/s: NVIDIA H200 datasheet",
)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the FLOP form needs of a model: active parameters, layers, hidden size."""

    model: str
    active_params: float
    layers: int
    hidden: int
    label: str


MODEL_SPECS: dict[str, ModelSpec] = {
    m.model: m for m in (
        ModelSpec("meta-llama/Llama-3.1-8B", 8.03e9, 32, 4096, "published config"),
        ModelSpec("meta-llama/Llama-3.1-70B", 70.6e9, 80, 8192, "published config"),
        ModelSpec("Qwen/Qwen3-32B", 32.8e9, 64, 5120, "published config"),
        ModelSpec("deepseek-ai/DeepSeek-V3", 37e9, 61, 7168,
                  "published config; 37B activated of 671B (MoE); estimate, not in anchors' table"),
    )
}


def _hw(name: str, gpus: int, label: str) -> HardwareProfile:
    return HardwareProfile(
        name=name, hbm_bytes_per_s=H200.hbm_bytes_per_s * gpus,
        # assumed: the order of vLLM's chunked-prefill token budget per engine step
        prefill_chunk_tokens=2048,
        lookup_s=1e-4,  # assumed: an in-process index lookup on the admission path
        sync_s=1e-4,  # assumed: completion event before the engine may read transferred blocks
        label=label,
    )


HARDWARE: dict[str, HardwareProfile] = {
    h.name: h for h in (
        _hw("h200x1-rdma4x200", 1, "1x H200 SXM, PCIe5 host link, 1x Gen4 NVMe, Mooncake TE 4x200 Gbps RDMA"),
        _hw("h200x8-rdma8x400", 8, "8x H200 SXM (TP8), PCIe5 host links, 1x Gen4 NVMe, Mooncake TE 8x400 Gbps RDMA"),
        _hw("h200x8-tcp4x200", 8, "8x H200 SXM (TP8), PCIe5 host links, 1x Gen4 NVMe, Mooncake TE TCP over 4x200 Gbps"),
    )
}
_GPUS = {"h200x1-rdma4x200": 1, "h200x8-rdma8x400": 8, "h200x8-tcp4x200": 8}
_MFU = {1: 0.5, 8: 0.4}  # anchors §3: assumed MFU 0.5 for 1 GPU and 0.4 for TP8


def _link(profile: str, source: Tier, destination: Tier, *, latency: float, per_page: float, bandwidth: float,
          rel_bandwidth: float, interference: float, label: str) -> LinkCost:
    spb = 0.0 if math.isinf(bandwidth) else 1.0 / bandwidth
    params = LinearCost.independent((latency, per_page, spb),
                                    (ASSUMED * latency, ASSUMED * per_page, rel_bandwidth * spb))
    return LinkCost(profile=profile, source=source, destination=destination, params=params, label=label,
                    interference=interference)


def _links_for(profile: str) -> list[LinkCost]:
    gpus = _GPUS[profile]
    # anchors §3: vLLM saw 5-32% contention for kernel-based copies; NVMe reads contend less (DMA).
    copy_interference, disk_interference = 0.10, 0.05
    links = [
        _link(profile, Tier.GPU, Tier.GPU, latency=1e-4, per_page=0.0, bandwidth=math.inf, rel_bandwidth=0.0,
              interference=0.0, label="in place: a local GPU prefix; latency assumed (block-table bookkeeping)"),
        _link(profile, Tier.HOST, Tier.GPU, latency=5e-5, per_page=5e-6,
              bandwidth=50e9 if gpus == 1 else 4 * 50e9,
              rel_bandwidth=MEASURED if gpus == 1 else ESTIMATE, interference=copy_interference,
              label=("PCIe5 pinned ~50 GB/s one way (measured, vLLM blog, >=2 MB blocks)" if gpus == 1 else
                     "PCIe5, 4 host uplinks of ~50 GB/s shared by 2 GPUs each (estimate: HGX-class topology)")
              + "; latency and per-page cost assumed"),
        _link(profile, Tier.DISK, Tier.GPU, latency=1e-4, per_page=2e-5, bandwidth=6.5e9, rel_bandwidth=MEASURED,
              interference=disk_interference,
              label="1x Gen4 NVMe ~6.5 GB/s (anchors §3); latency and per-page file overhead assumed"),
    ]
    if profile == "h200x1-rdma4x200":
        remote, rel, label = 87e9, MEASURED, "Mooncake TE 4x200 Gbps RDMA, 87 GB/s (measured, 40 GB transfers)"
    elif profile == "h200x8-rdma8x400":
        remote, rel, label = 190e9, MEASURED, "Mooncake TE 8x400 Gbps RDMA, 190 GB/s (measured, 40 GB transfers)"
    else:
        remote, rel = 87e9 / 4.6, ESTIMATE
        label = "Mooncake TE TCP over 4x200 Gbps: 87 GB/s / 4.6 (TCP 2.4-4.6x slower)"
    links.append(_link(profile, Tier.REMOTE, Tier.GPU, latency=1e-3, per_page=5e-6, bandwidth=remote,
                       rel_bandwidth=rel, interference=copy_interference,
                       label=label + "; latency (RPC, registration) and per-page cost assumed"))
    return links


LINKS: tuple[LinkCost, ...] = tuple(lk for name in HARDWARE for lk in _links_for(name))


def flop_compute(spec: ModelSpec, profile: str, gpus: int, accelerator: Accelerator = H200) -> ComputeCost:
    """``T_compute`` from FLOPs: ``c1 = 2P/R``, ``c2 = 2*l*d/R`` with ``R = peak*gpus*MFU``; ``c0 = 0 ± 5 ms``."""
    mfu = _MFU[gpus]
    rate = accelerator.peak_flops * gpus * mfu
    c1 = 2.0 * spec.active_params / rate
    c2 = 2.0 * spec.layers * spec.hidden / rate
    params = LinearCost.independent((0.0, c1, c2), (0.005, FLOP_DERIVED * c1, FLOP_DERIVED * c2))
    source = (f"FLOP-derived (anchors §3 method): 2*P*n + 2*l*d*n^2 at {accelerator.name} "
              f"{accelerator.peak_flops / 1e12:.0f} TFLOPS x{gpus}, MFU {mfu}; {spec.label}; not measured")
    return ComputeCost(model=spec.model, profile=profile, params=params, source=source)


_SHIPPED_PAIRS = (
    ("meta-llama/Llama-3.1-8B", "h200x1-rdma4x200"),
    ("meta-llama/Llama-3.1-8B", "h200x8-rdma8x400"),
    ("meta-llama/Llama-3.1-8B", "h200x8-tcp4x200"),
    ("meta-llama/Llama-3.1-70B", "h200x8-rdma8x400"),
    ("meta-llama/Llama-3.1-70B", "h200x8-tcp4x200"),
    ("Qwen/Qwen3-32B", "h200x8-rdma8x400"),
    ("Qwen/Qwen3-32B", "h200x8-tcp4x200"),
    ("deepseek-ai/DeepSeek-V3", "h200x8-rdma8x400"),
    ("deepseek-ai/DeepSeek-V3", "h200x8-tcp4x200"),
)

COMPUTE: tuple[ComputeCost, ...] = tuple(
    flop_compute(MODEL_SPECS[model], profile, _GPUS[profile]) for model, profile in _SHIPPED_PAIRS
)


# -- the reference engine on a CPU (what `nexuskv replay` and the tests run) ------------------------
#: NexusKV's reference engine (``nexuskv.reference_engine``) on the 2-core CI machine: its "GPU" is the
#: device tier's host-memory stand-in. Measured here, not assumed: the links from
#: ``benchmarks/bench_copy.py`` (2 MiB payloads: host->device 5.2 GB/s, disk->host 5.1 GB/s,
#: remote->host 2.5 GB/s; ~20 us of bookkeeping per payload), the compute prior from
#: ``benchmarks/bench_prefill.py`` (GQA variant: 4.4 ms at 128 tokens ... 68 ms at 1,024). Online
#: calibration refines both from the runtime's own observations.
REFERENCE_CPU = "reference-cpu"
REFERENCE_MODELS = ("nexuskv-reference/gqa", "nexuskv-reference/mla", "nexuskv-reference/hybrid")
REFERENCE_HARDWARE = HardwareProfile(
    name=REFERENCE_CPU, hbm_bytes_per_s=20e9, prefill_chunk_tokens=2048, lookup_s=2e-4, sync_s=5e-5,
    label="reference engine on 2 CPU cores; device tier is a host-memory stand-in (measured, 2026-11-29)",
)
_BENCH = "measured on the CI machine by benchmarks/bench_copy.py (2 MiB payloads)"
REFERENCE_LINKS: tuple[LinkCost, ...] = (
    _link(REFERENCE_CPU, Tier.GPU, Tier.GPU, latency=1e-4, per_page=0.0, bandwidth=math.inf, rel_bandwidth=0.0,
          interference=0.0, label="in place: the runtime's own pages"),
    _link(REFERENCE_CPU, Tier.HOST, Tier.GPU, latency=2e-4, per_page=2e-5, bandwidth=5.2e9, rel_bandwidth=MEASURED,
          interference=0.05, label=f"host -> device stand-in 5.2 GB/s, {_BENCH}"),
    _link(REFERENCE_CPU, Tier.DISK, Tier.GPU, latency=3e-4, per_page=3e-5, bandwidth=5.0e9, rel_bandwidth=MEASURED,
          interference=0.05, label=f"disk (page cache) -> host 5.1 GB/s, {_BENCH}"),
    _link(REFERENCE_CPU, Tier.REMOTE, Tier.GPU, latency=1e-3, per_page=3e-5, bandwidth=2.5e9, rel_bandwidth=MEASURED,
          interference=0.05, label=f"remote tier over loopback TCP -> host 2.5 GB/s, {_BENCH}"),
)
#: T = c0 + c1*e + c2*e*s fitted to bench_prefill's GQA medians (c0 2 ms, c1 15 us/token,
#: c2 5e-8 s/token^2); the MLA and hybrid variants are of the same size and start from it.
REFERENCE_COMPUTE: tuple[ComputeCost, ...] = tuple(
    ComputeCost(model=m, profile=REFERENCE_CPU,
                params=LinearCost.independent((2e-3, 1.5e-5, 5e-8), (1e-3, MEASURED * 1.5e-5, MEASURED * 5e-8)),
                source="measured on the CI machine by benchmarks/bench_prefill.py (GQA variant)")
    for m in REFERENCE_MODELS
)


def shipped_cost_model() -> CostModel:
    """The cost model every planner starts from, before calibration publishes anything."""
    return CostModel.build(SHIPPED_BASE, [*HARDWARE.values(), REFERENCE_HARDWARE], [*COMPUTE, *REFERENCE_COMPUTE],
                           [*LINKS, *REFERENCE_LINKS])


# -- sglang#26305 ---------------------------------------------------------------------------------------

MINIMAX_M27 = "MiniMaxAI/MiniMax-M2.7"


def minimax_m27_descriptor(**overrides: object) -> StateDescriptor:
    """MiniMax-M2.7's KV state, *assumed* to have MiniMax-M2's shape (62 layers, 8 KV heads of 128,
    BF16) on SGLang with 64-token pages. The fixture's decisions do not depend on this: its link
    costs are derived from the published times for exactly these bytes."""
    fields: dict[str, object] = dict(model=MINIMAX_M27, num_layers=62, num_kv_heads=8, head_dim=128,
                                     engine_family="sglang", block_size=64)
    fields.update(overrides)
    return gqa_descriptor(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """One row of the sglang#26305 table: TTFTs in seconds at a 90% prefix hit."""

    profile: str
    prompt_tokens: int
    concurrency: int
    recompute_s: float
    hbm_hit_s: float
    file_hit_s: float  # HiCache "Hifile" L3 (file-backed)
    ucm_hit_s: float  # UCM L3 (a remote store)
    hit_fraction: float = 0.9

    def hit_blocks(self, block_size: int) -> int:
        return round(self.hit_fraction * (self.prompt_tokens // block_size))


SGLANG_26305: tuple[OperatingPoint, ...] = (
    OperatingPoint("sglang26305-8k-c16", 8192, 16, 1.725, 0.482, 2.450, 1.447),
    OperatingPoint("sglang26305-128k-c1", 131072, 1, 5.118, 1.027, 5.250, 2.697),
)


def sglang_26305_cost_model(descriptor: StateDescriptor | None = None) -> CostModel:
    """A cost model whose predicted TTFTs equal sglang#26305's, one hardware profile per row.

    Per row: ``c1 = recompute / n`` (c0 = c2 = 0: the row is one operating point, concurrency
    included); the HBM hit's in-place latency, and the file (disk->gpu) and UCM (remote->gpu)
    seconds per byte, are what remains of each published TTFT after computing the uncached 10%.
    Uncertainty ±5% (published measurements of one run each).
    """
    d = descriptor or minimax_m27_descriptor()
    hardware, compute, links = [], [], []
    label = "derived from sglang#26305 (anchors §1.3), MiniMax-M2.7, SGLang v0.5.10, 90% hit"
    for op in SGLANG_26305:
        blocks = op.hit_blocks(d.block_size)
        uncached = op.prompt_tokens - blocks * d.block_size
        c1 = op.recompute_s / op.prompt_tokens
        tail = c1 * uncached
        nbytes = extent_bytes(d, blocks)
        hardware.append(HardwareProfile(name=op.profile, hbm_bytes_per_s=math.inf, prefill_chunk_tokens=2048,
                                        lookup_s=0.0, sync_s=0.0,
                                        label=f"{label}; {op.prompt_tokens} tokens at concurrency {op.concurrency}"))
        compute.append(ComputeCost(model=d.model, profile=op.profile,
                                   params=LinearCost.with_relative_uncertainty((0.0, c1, 0.0), (0.0, 0.05, 0.0)),
                                   source=f"{label}: recompute {op.recompute_s} s for {op.prompt_tokens} tokens"))
        in_place = op.hbm_hit_s - tail
        links.append(LinkCost(profile=op.profile, source=Tier.GPU, destination=Tier.GPU,
                              params=LinearCost.with_relative_uncertainty((in_place, 0.0, 0.0), (0.05, 0.0, 0.0)),
                              label=f"{label}: HBM hit {op.hbm_hit_s} s"))
        for tier, ttft, name in ((Tier.DISK, op.file_hit_s, "Hifile L3"), (Tier.REMOTE, op.ucm_hit_s, "UCM L3")):
            spb = (ttft - tail) / nbytes
            links.append(LinkCost(profile=op.profile, source=tier, destination=Tier.GPU,
                                  params=LinearCost.with_relative_uncertainty((0.0, 0.0, spb), (0.0, 0.0, 0.05)),
                                  label=f"{label}: {name} hit {ttft} s ({1e-9 / spb:.2f} GB/s effective)"))
    return CostModel.build("sglang-26305", hardware, compute, links)
