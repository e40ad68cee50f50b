"""The cost model (whitepaper §2.5): what recomputing costs, what reusing costs, and how sure we are.

Two fitted forms, both linear in their parameters so that one estimator (:mod:`nexuskv.calibration`)
fits both and every prediction carries a variance:

* ``T_compute(e, s) = c0 + c1*e + c2*e*s`` seconds, for ``e`` uncached tokens prefilled in a
  context of ``s`` tokens (``s`` counts the cached prefix and the new tokens), per (model,
  hardware profile). Features ``(1, e, e*s)``.
* ``T_transfer(pages, bytes) = latency + pages*per_page + bytes/bandwidth`` seconds, per
  (hardware profile, source tier -> destination tier) link. Features ``(1, pages, bytes)``;
  the third parameter is seconds per byte. Fixed per-operation and per-page costs are part of
  the form on purpose: they, not bandwidth, made a file-tier hit slower than recomputing in
  sglang#26305.

``T_cache`` of a candidate is ``lookup + queue + max(0, transfer - overlap) + restore + sync +
interference`` (:class:`CacheTerms`); the planner adds the compute of the uncached tail.

Uncertainty: each parameter vector has a covariance. Shipped profiles (:mod:`nexuskv.profiles`)
get a diagonal one from a relative uncertainty per parameter (large where a number is assumed,
small where it was measured); fitted ones get the estimator's posterior. Staleness: a snapshot is
as old as its ``version`` says; the planner records that version in every decision.

Prefetch expected gain: ``E[G] = P_use*G - (1 - P_use)*(T_transfer + C_pollution + C_interference)``
(:func:`prefetch_expected_gain`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import NamedTuple

from nexuskv.descriptor import GranularityKind, StateDescriptor, Tier

__all__ = [
    "Vec3",
    "LinearCost",
    "ComputeCost",
    "LinkCost",
    "HardwareProfile",
    "CacheTerms",
    "CostModel",
    "LinkKey",
    "SizedLinkKey",
    "ComputeKey",
    "page_bytes_of",
    "compose_links",
    "extent_bytes",
    "extent_pages",
    "normal_cdf",
    "prefetch_expected_gain",
]

Vec3 = tuple[float, float, float]
Mat3 = tuple[Vec3, Vec3, Vec3]
ComputeKey = tuple[str, str]  # (model, hardware profile)
LinkKey = tuple[str, Tier, Tier]  # (hardware profile, source tier, destination tier)
SizedLinkKey = tuple[str, Tier, Tier, int]  # ... and the bytes of one copied page (the block size)

_ZERO3: Mat3 = ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


@dataclass(frozen=True, slots=True)
class LinearCost:
    """``y = mean · x`` with parameter covariance ``cov``; ``x`` is a 3-feature vector."""

    mean: Vec3
    cov: Mat3 = _ZERO3
    # (c00, c11, c22, 2*c01, 2*c02, 2*c12): the quadratic form in six products, for the planner's loop.
    _quad: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        c = self.cov
        object.__setattr__(self, "_quad", (c[0][0], c[1][1], c[2][2], c[0][1] + c[1][0], c[0][2] + c[2][0],
                                           c[1][2] + c[2][1]))

    @classmethod
    def independent(cls, mean: Vec3, std: Vec3) -> LinearCost:
        """Independent parameters with standard deviations ``std``."""
        v = [s * s for s in std]
        return cls(mean, ((v[0], 0.0, 0.0), (0.0, v[1], 0.0), (0.0, 0.0, v[2])))

    @classmethod
    def with_relative_uncertainty(cls, mean: Vec3, rel: Vec3) -> LinearCost:
        """Independent parameters, each with standard deviation ``rel[i] * |mean[i]|``."""
        return cls.independent(mean, (rel[0] * abs(mean[0]), rel[1] * abs(mean[1]), rel[2] * abs(mean[2])))

    def predict(self, x0: float, x1: float, x2: float) -> float:
        m = self.mean
        return m[0] * x0 + m[1] * x1 + m[2] * x2

    def variance(self, x0: float, x1: float, x2: float) -> float:
        """Variance of the prediction's mean at ``x`` (parameter uncertainty only): ``x' cov x``."""
        a, b, c, ab, ac, bc = self._quad
        return x0 * (a * x0 + ab * x1 + ac * x2) + x1 * (b * x1 + bc * x2) + c * x2 * x2

    def std(self, i: int) -> float:
        return math.sqrt(max(self.cov[i][i], 0.0))


@dataclass(frozen=True, slots=True)
class ComputeCost:
    """``T_compute(e, s) = c0 + c1*e + c2*e*s`` seconds for one (model, hardware profile)."""

    model: str
    profile: str
    params: LinearCost
    source: str  # where the numbers come from ("anchors.md §3 ...", "fitted from 812 observations")
    observations: int = 0
    version: int = 0

    @property
    def key(self) -> ComputeKey:
        return (self.model, self.profile)

    def seconds(self, e: int, s: int) -> float:
        """Prefill time of ``e`` tokens in a context of ``s`` tokens (0 when nothing is computed)."""
        if e <= 0:
            return 0.0
        return self.params.predict(1.0, e, e * s)

    @staticmethod
    def features(e: int, s: int) -> Vec3:
        return (1.0, float(e), float(e) * float(s)) if e > 0 else (0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class LinkCost:
    """``T_transfer = latency + pages*per_page + bytes*seconds_per_byte`` for one link of a profile.

    ``interference`` is the fraction of the transfer time charged to the consumer as
    interference (copy-engine, PCIe and memory-bandwidth contention; vLLM measured 5-32% for
    kernel-based copies).

    ``page_bytes`` is the size of one copied page the cost was fitted at, or None for a cost valid at
    any size (a shipped profile, whose bytes and pages terms were set apart). A fit from copies of
    one block size cannot tell its per-page cost from its per-byte cost (the two grow in fixed
    proportion), so it is valid only at that size: :meth:`CostModel.link` never hands it out for
    another.
    """

    profile: str
    source: Tier
    destination: Tier
    params: LinearCost
    label: str
    interference: float = 0.0
    observations: int = 0
    version: int = 0
    page_bytes: int | None = None

    @property
    def key(self) -> LinkKey:
        return (self.profile, self.source, self.destination)

    @property
    def sized_key(self) -> SizedLinkKey | None:
        if self.page_bytes is None:
            return None
        return (self.profile, self.source, self.destination, self.page_bytes)

    @property
    def name(self) -> str:
        return f"{self.source.value}->{self.destination.value}"

    @property
    def latency_s(self) -> float:
        return self.params.mean[0]

    @property
    def per_page_s(self) -> float:
        return self.params.mean[1]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        spb = self.params.mean[2]
        return math.inf if spb <= 0 else 1.0 / spb

    def seconds(self, pages: int, nbytes: int) -> float:
        return self.params.predict(1.0, pages, nbytes)

    def variance(self, pages: int, nbytes: int) -> float:
        return self.params.variance(1.0, pages, nbytes)


def page_bytes_of(nbytes: int, pages: int) -> int | None:
    """Bytes of one page of a copy of ``pages`` pages and ``nbytes`` bytes (None: no pages): the block
    size a link fit is kept for, computed the same way from an observation and from a plan."""
    if pages <= 0 or nbytes <= 0:
        return None
    return max(1, round(nbytes / pages))


def _per_page_form(params: LinearCost, page_bytes: int) -> LinearCost:
    """``params`` at one page size with the bytes term folded into the per-page one: ``(latency,
    per_page + page_bytes * seconds_per_byte, 0)`` and its covariance ``J cov J'``. Predictions at that
    size are unchanged; the parameters become the ones a fit at that size actually pins down."""
    m, c, b = params.mean, params.cov, float(page_bytes)
    c01 = c[0][1] + b * c[0][2]
    c11 = c[1][1] + 2.0 * b * c[1][2] + b * b * c[2][2]
    return LinearCost((m[0], m[1] + b * m[2], 0.0), ((c[0][0], c01, 0.0), (c01, c11, 0.0), (0.0, 0.0, 0.0)))


def compose_links(first: LinkCost, second: LinkCost, *, profile: str, source: Tier, destination: Tier) -> LinkCost:
    """Two hops pipelined: latencies and per-page costs add, the slower bandwidth bounds the flow.

    When either hop was fitted at one page size (:attr:`LinkCost.page_bytes`), its per-page and
    per-byte parameters are known only as a sum at that size, so the pipelining cannot be priced:
    both hops are taken at that size in per-page form and added (serial, an upper bound), with
    their covariances, and the composed link holds at that size only.
    """
    a, b = first.params, second.params
    size = first.page_bytes if first.page_bytes is not None else second.page_bytes
    if size is not None:
        pa, pb = _per_page_form(a, size), _per_page_form(b, size)
        mean = (pa.mean[0] + pb.mean[0], pa.mean[1] + pb.mean[1], 0.0)
        cov = tuple(tuple(pa.cov[i][j] + pb.cov[i][j] for j in range(3)) for i in range(3))
        return LinkCost(profile=profile, source=source, destination=destination,
                        params=LinearCost(mean, cov),  # type: ignore[arg-type]
                        label=f"{first.label} then {second.label} (serial at {size}-byte pages)",
                        interference=max(first.interference, second.interference), page_bytes=size)
    slow = a if a.mean[2] >= b.mean[2] else b
    mean = (a.mean[0] + b.mean[0], a.mean[1] + b.mean[1], slow.mean[2])
    cov = ((a.cov[0][0] + b.cov[0][0], 0.0, 0.0), (0.0, a.cov[1][1] + b.cov[1][1], 0.0), (0.0, 0.0, slow.cov[2][2]))
    return LinkCost(profile=profile, source=source, destination=destination, params=LinearCost(mean, cov),
                    label=f"{first.label} then {second.label}",
                    interference=max(first.interference, second.interference))


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Constants of a deployment that are not fitted online (seconds, bytes/s, tokens).

    * ``lookup_s`` — index lookup on the admission path;
    * ``sync_s`` — completion signalling of a transfer before the consumer may read it;
    * ``hbm_bytes_per_s`` and ``prefill_chunk_tokens`` — what in-flight decode costs a prefill: every
      chunk of ``prefill_chunk_tokens`` shares an engine step with the decode batch, which reads its
      KV (``decode_blocks`` blocks) from HBM once per step.
    """

    name: str
    hbm_bytes_per_s: float  # all GPUs of the worker together
    prefill_chunk_tokens: int
    lookup_s: float
    sync_s: float
    label: str

    def decode_seconds(self, decode_blocks: int, block_bytes: int, prefill_tokens: int) -> float:
        """Time in-flight decode adds to a prefill of ``prefill_tokens`` tokens."""
        if decode_blocks <= 0 or prefill_tokens <= 0:
            return 0.0
        steps = -(-prefill_tokens // self.prefill_chunk_tokens)
        return steps * decode_blocks * block_bytes / self.hbm_bytes_per_s


class CacheTerms(NamedTuple):
    """The terms of ``T_cache`` for one candidate, seconds (whitepaper §2.5).

    A named tuple, immutable like the other values here, because the planner builds one per
    option it weighs and a frozen dataclass costs three times as much to build.
    """

    lookup_s: float = 0.0
    queue_s: float = 0.0
    transfer_s: float = 0.0
    overlap_s: float = 0.0
    restore_s: float = 0.0
    sync_s: float = 0.0
    interference_s: float = 0.0
    request_s: float = 0.0  # the fixed per-request cost outside the forward pass (HTTP, tokenisation)

    @property
    def visible_transfer_s(self) -> float:
        return max(0.0, self.transfer_s - self.overlap_s)

    @property
    def total_s(self) -> float:
        """``request + lookup + queue + max(0, transfer - overlap) + restore + sync + interference``."""
        return (self.request_s + self.lookup_s + self.queue_s + self.visible_transfer_s + self.restore_s
                + self.sync_s + self.interference_s)


@dataclass(frozen=True, slots=True)
class CostModel:
    """A versioned snapshot: hardware constants, compute costs per (model, profile), link costs.

    Immutable: :meth:`with_compute` and :meth:`with_link` return a new snapshot with a new version.
    ``base`` names the shipped profile set; ``version`` adds a digest of every fitted entry used.
    ``links`` holds the costs valid at any page size, ``sized_links`` those fitted at one
    (:attr:`LinkCost.page_bytes`); :meth:`link` picks.
    """

    base: str
    hardware: Mapping[str, HardwareProfile]
    compute: Mapping[ComputeKey, ComputeCost]
    links: Mapping[LinkKey, LinkCost]
    version: str = field(default="")
    sized_links: Mapping[SizedLinkKey, LinkCost] = field(default_factory=dict)
    #: Fixed per-request cost outside the forward pass, ``o0 + o1*prompt_tokens`` per (model, profile),
    #: as a ComputeCost over features ``(1, prompt_tokens, 0)`` (:meth:`request_seconds`).
    overheads: Mapping[ComputeKey, ComputeCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hardware", MappingProxyType(dict(self.hardware)))
        object.__setattr__(self, "compute", MappingProxyType(dict(self.compute)))
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "sized_links", MappingProxyType(dict(self.sized_links)))
        object.__setattr__(self, "overheads", MappingProxyType(dict(self.overheads)))
        if not self.version:
            object.__setattr__(self, "version", self._digest())

    @classmethod
    def build(cls, base: str, hardware: Iterable[HardwareProfile], compute: Iterable[ComputeCost],
              links: Iterable[LinkCost]) -> CostModel:
        return cls(base=base, hardware={h.name: h for h in hardware}, compute={c.key: c for c in compute},
                   links={lk.key: lk for lk in links})

    def _digest(self) -> str:
        fitted = sorted(
            [f"c|{c.model}|{c.profile}|{c.version}" for c in self.compute.values() if c.observations]
            + [f"l|{k.profile}|{k.name}|{k.version}" for k in self.links.values() if k.observations]
            + [f"l|{k.profile}|{k.name}|{k.page_bytes}B|{k.version}" for k in self.sized_links.values()
               if k.observations]
            + [f"o|{c.model}|{c.profile}|{c.version}" for c in self.overheads.values() if c.observations]
        )
        if not fitted:
            return self.base
        return f"{self.base}+{hashlib.blake2b('/'.join(fitted).encode(), digest_size=4).hexdigest()}"

    def compute_for(self, model: str, profile: str) -> ComputeCost | None:
        return self.compute.get((model, profile))

    def link(self, profile: str, source: Tier, destination: Tier, page_bytes: int | None = None) -> LinkCost | None:
        """The link's cost for copies of ``page_bytes`` pages: the one fitted at that size, else the one
        valid at any size (never one fitted at another size). ``page_bytes`` None: the latter only."""
        if page_bytes is not None:
            sized = self.sized_links.get((profile, source, destination, page_bytes))
            if sized is not None:
                return sized
        return self.links.get((profile, source, destination))

    def request_seconds(self, model: str, profile: str, prompt_tokens: int) -> float:
        """The fixed per-request cost of a prompt of ``prompt_tokens`` (0 where none was fitted)."""
        cost = self.overheads.get((model, profile))
        if cost is None:
            return 0.0
        return max(0.0, cost.params.predict(1.0, float(prompt_tokens), 0.0))

    def with_overhead(self, cost: ComputeCost) -> CostModel:
        merged = dict(self.overheads)
        merged[cost.key] = cost
        return replace(self, overheads=merged, version="")

    def with_compute(self, cost: ComputeCost) -> CostModel:
        merged = dict(self.compute)
        merged[cost.key] = cost
        return replace(self, compute=merged, version="")

    def with_link(self, cost: LinkCost) -> CostModel:
        prior = self.link(cost.profile, cost.source, cost.destination, cost.page_bytes)
        if prior is not None and cost.interference == 0.0:
            cost = replace(cost, interference=prior.interference)  # observations do not measure it
        sized_key = cost.sized_key
        if sized_key is not None:
            sized = dict(self.sized_links)
            sized[sized_key] = cost
            return replace(self, sized_links=sized, version="")
        merged = dict(self.links)
        merged[cost.key] = cost
        return replace(self, links=merged, version="")


def extent_bytes(descriptor: StateDescriptor, blocks: int) -> int:
    """Bytes of ``blocks`` consecutive blocks of state, every KV group together.

    Token-granular groups contribute ``blocks * block_size * bytes_per_token``; a recurrent group
    contributes one checkpoint (the state at the extent's end) when ``blocks > 0``.
    """
    if blocks <= 0:
        return 0
    tokens = blocks * descriptor.block_size
    total = 0
    for g in descriptor.layer_groups:
        if g.granularity.kind is GranularityKind.CHECKPOINT:
            total += g.bytes_per_checkpoint
        else:
            total += tokens * g.bytes_per_token
    return total


def extent_pages(descriptor: StateDescriptor, blocks: int) -> int:
    """Copy operations of ``blocks`` blocks: one page per block per KV group."""
    return blocks * len(descriptor.layer_groups) if blocks > 0 else 0


def normal_cdf(x: float) -> float:
    """P(Z <= x) for a standard normal Z."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def prefetch_expected_gain(p_use: float, gain_s: float, transfer_s: float, pollution_s: float,
                           interference_s: float) -> float:
    """``P_use*G - (1 - P_use)*(T_transfer + C_pollution + C_interference)`` seconds (whitepaper §2.5)."""
    return p_use * gain_s - (1.0 - p_use) * (transfer_s + pollution_s + interference_s)
