"""The simulator's ground-truth costs: what prefill and copies really take, which the planner only believes.

The planner starts from the shipped cost model (:func:`nexuskv.profiles.shipped_cost_model`). The
truth is that model changed by a :class:`Drift` — the ways a real deployment differs from a
datasheet: a fixed per-prefill overhead the FLOP count misses, a lower MFU, a contended NVMe, a
busier network — plus multiplicative log-normal noise per operation. The ``none`` drift makes the
truth equal to the belief, without noise.

Noise is drawn per request from ``(seed, request index)``: every policy meets the same draws for
the same request, whatever it chose, so the comparison is paired. One factor scales the prefill
compute; one per link kind scales a copy's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from nexuskv.cost import ComputeCost, CostModel, HardwareProfile, LinearCost, LinkCost, compose_links
from nexuskv.descriptor import Tier
from nexuskv.profiles import shipped_cost_model

__all__ = ["Drift", "DRIFTS", "LINK_KINDS", "TrueCosts", "Noise"]

#: Link kinds of a copy into a worker's GPU: its own host or disk, a peer's memory over the
#: network, a peer's disk (read, then the network), the shared store (network).
LINK_KINDS = ("host", "disk", "net", "peer-disk", "store")


@dataclass(frozen=True, slots=True)
class Drift:
    """How the true costs differ from the shipped profile (scales multiply; 1 = as shipped)."""

    name: str
    c0_s: float  # true fixed seconds per prefill (shipped: 0 ± 5 ms)
    compute_scale: float  # true c1 and c2 over shipped (MFU shipped / MFU true)
    host_bandwidth_scale: float
    disk_bandwidth_scale: float
    network_bandwidth_scale: float
    compute_noise: float  # sigma of log(factor) per prefill
    transfer_noise: float  # sigma of log(factor) per copy
    label: str


DRIFTS: dict[str, Drift] = {d.name: d for d in (
    Drift("none", 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, "truth = the shipped profile, no noise"),
    Drift("drift", 0.015, 1.10, 1.0, 0.55, 0.80, 0.05, 0.15,
          "truth differs from the shipped profile: +15 ms fixed per prefill, MFU 10% below the assumed one, "
          "NVMe at 55% of its datasheet bandwidth (contended), network at 80%; log-normal noise sigma 5% "
          "on prefill and 15% on copies"),
)}


@dataclass(frozen=True, slots=True)
class Noise:
    """One request's noise factors (multiplicative)."""

    compute: float
    links: dict[str, float]


class TrueCosts:
    """The true cost model of one hardware profile and model, with its noise."""

    def __init__(self, profile: str, model: str, drift: Drift, seed: int) -> None:
        shipped = shipped_cost_model()
        self.drift = drift
        self.seed = seed
        self.profile = profile
        hw = shipped.hardware[profile]
        cc = shipped.compute[(model, profile)]
        c0, c1, c2 = cc.params.mean
        self.compute = ComputeCost(model=model, profile=profile, params=LinearCost(
            (c0 + drift.c0_s, c1 * drift.compute_scale, c2 * drift.compute_scale)),
            source=f"harness truth ({drift.name}): {drift.label}")
        scale = {Tier.HOST: drift.host_bandwidth_scale, Tier.DISK: drift.disk_bandwidth_scale,
                 Tier.REMOTE: drift.network_bandwidth_scale, Tier.GPU: 1.0}
        links = []
        for (p, src, dst), link in shipped.links.items():
            if p != profile:
                continue
            lat, page, spb = link.params.mean
            links.append(replace(link, params=LinearCost((lat, page, spb / scale[src] if spb else spb)),
                                 label=f"harness truth ({drift.name})"))
        self.model = CostModel.build(f"harness-truth-{drift.name}", [hw], [self.compute], links)
        self.hardware: HardwareProfile = hw
        get = self.model.links.get
        net = get((profile, Tier.REMOTE, Tier.GPU))
        disk = get((profile, Tier.DISK, Tier.GPU))
        self.in_place_s = get((profile, Tier.GPU, Tier.GPU)).params.mean[0]
        self.links: dict[str, LinkCost] = {
            "host": get((profile, Tier.HOST, Tier.GPU)), "disk": disk, "net": net, "store": net,
            "peer-disk": compose_links(disk, net, profile=profile, source=Tier.REMOTE, destination=Tier.GPU),
        }

    def noise(self, index: int) -> Noise:
        """The noise factors of the request at position ``index`` of the stream."""
        d = self.drift
        if d.compute_noise == 0 and d.transfer_noise == 0:
            return Noise(1.0, dict.fromkeys(LINK_KINDS, 1.0))
        draws = np.random.default_rng([self.seed, index]).standard_normal(1 + len(LINK_KINDS))
        return Noise(math.exp(d.compute_noise * draws[0]),
                     {k: math.exp(d.transfer_noise * draws[1 + i]) for i, k in enumerate(LINK_KINDS)})

    def compute_s(self, e: int, n: int, factor: float) -> float:
        """True prefill seconds of ``e`` uncached tokens in an ``n``-token context."""
        return self.compute.seconds(e, n) * factor

    def decode_s(self, decode_blocks: int, block_bytes: int, e: int) -> float:
        """What in-flight decode adds to that prefill (HBM reads of the decode batch per chunk)."""
        return self.hardware.decode_seconds(decode_blocks, block_bytes, e)

    def transfer_s(self, kind: str, pages: int, nbytes: int, factor: float) -> float:
        return self.links[kind].seconds(pages, nbytes) * factor

    def latency_s(self, kind: str) -> float:
        return self.links[kind].latency_s

    def interference(self, kind: str) -> float:
        return self.links[kind].interference

