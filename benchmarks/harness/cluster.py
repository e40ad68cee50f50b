"""The simulated cluster: workers, their tiers and capacities, links, and the model they serve.

Every worker runs the same model on the same hardware profile (one of the shipped profiles of
:mod:`nexuskv.profiles`). Per worker: a GPU KV cache, a host-DRAM tier and a local-disk tier, each
an LRU of 16-token blocks with a capacity; the cluster shares one remote store. Links are the
profile's: host->GPU (PCIe), disk->GPU (NVMe), and the network (a peer worker's memory, or the
remote store); a peer's disk is read then sent (two hops pipelined, as the planner composes them).

The default deployment is Llama-3.1-70B on eight TP8 H200 nodes whose cross-node transport is
TCP (``h200x8-tcp4x200``): there a disk read and a recompute cost about the same per token
(~6.5 GB/s against ~6.6 GB/s of "recompute bandwidth" at 12K context), so reuse is a decision and
not a formality. Capacities are scaled down from such a node (~700 GB of KV per node) so that a
slice of a few thousand trace requests, whose working set is ~11M tokens per 1,000 requests,
overflows GPU and host memory as the whole trace overflows the whole cluster it was sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from nexuskv.cost import extent_bytes
from nexuskv.descriptor import StateDescriptor
from nexuskv.models import known_model
from nexuskv.profiles import HARDWARE, MODEL_SPECS

__all__ = ["Capacity", "CAPACITIES", "ClusterSpec", "STORE"]

#: Worker name under which the shared remote store publishes and is addressed.
STORE = "remote-store"


@dataclass(frozen=True, slots=True)
class Capacity:
    """Tier capacities in tokens of KV state: per worker, and the shared store."""

    gpu_tokens: int = 262_144
    host_tokens: int = 1_048_576
    disk_tokens: int = 4_194_304
    remote_tokens: int = 16_777_216

    def __post_init__(self) -> None:
        for name in ("gpu_tokens", "host_tokens", "disk_tokens", "remote_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"capacity.{name}: negative")


#: Named capacity sets. ``pressure``: host a quarter, disk and store an eighth of the default, so
#: the conversation slice's ~11M tokens of working set overfill every tier beyond the GPU several
#: times (the §10.4 tier-admission and eviction ablations need state to compete for room).
CAPACITIES: dict[str, Capacity] = {
    "default": Capacity(),
    "pressure": Capacity(gpu_tokens=262_144, host_tokens=262_144, disk_tokens=524_288, remote_tokens=2_097_152),
}


@dataclass(frozen=True)
class ClusterSpec:
    """What the simulated cluster is made of (the record's hardware and tier fields come from here)."""

    workers: int = 8
    model: str = "meta-llama/Llama-3.1-70B"
    profile: str = "h200x8-tcp4x200"
    capacity: Capacity = field(default_factory=Capacity)
    #: The state restores layer by layer (LMCache's layerwise mode, vLLM's layer-wise connectors):
    #: a copy may overlap the prefill of the layers already there. The planner reads it from the
    #: descriptor; the "transfer overlap" ablation turns it off on both sides.
    layerwise: bool = True
    #: Seconds from an engine publishing a kv-events batch to the index applying it.
    event_delay_s: float = 0.01

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers: at least one")
        if self.profile not in HARDWARE:
            raise ValueError(f"profile: {self.profile!r} is not a shipped profile ({', '.join(HARDWARE)})")
        if self.model not in MODEL_SPECS:
            raise ValueError(f"model: {self.model!r} has no shipped compute profile")
        if self.event_delay_s < 0:
            raise ValueError("event_delay_s: negative")
        if self.capacity.gpu_tokens < 131_072:
            raise ValueError("capacity.gpu_tokens: must hold a 128K-token prompt")

    @cached_property
    def worker_names(self) -> tuple[str, ...]:
        return tuple(f"w{i}" for i in range(self.workers))

    def descriptor(self, tenant: str, *, layerwise: bool | None = None) -> StateDescriptor:
        """The state every worker produces, in ``tenant``'s namespace (same descriptor id for all)."""
        return _descriptor(self.model, tenant, self.layerwise if layerwise is None else layerwise)

    @cached_property
    def block_tokens(self) -> int:
        return self.descriptor("harness").block_size

    @cached_property
    def block_bytes(self) -> int:
        return extent_bytes(self.descriptor("harness"), 1)

    def blocks(self, tokens: int) -> int:
        return tokens // self.block_tokens

    @cached_property
    def tpot_s(self) -> float:
        """Seconds per decode step: the weights read once from HBM per step, plus 5 ms of
        scheduling and sampling (assumed). Decode only matters here as load (its KV blocks are
        what in-flight decode costs a prefill)."""
        spec = MODEL_SPECS[self.model]
        return 2.0 * spec.active_params / HARDWARE[self.profile].hbm_bytes_per_s + 0.005


_DESCRIPTORS: dict[tuple[str, str, bool], StateDescriptor] = {}


def _descriptor(model: str, tenant: str, layerwise: bool) -> StateDescriptor:
    key = (model, tenant, layerwise)
    d = _DESCRIPTORS.get(key)
    if d is None:
        base = known_model(model, tenant_namespace=tenant)
        dumped = base.model_dump()
        dumped["materialization"] = {**dumped["materialization"], "layerwise": layerwise}
        d = _DESCRIPTORS[key] = StateDescriptor.model_validate(dumped)
    return d
