"""Cold-start priors: a cost model for a model or worker no shipped profile covers, corrected online.

The planner refuses to move state it cannot price ("no cost profile ... cannot be estimated"),
and the shipped profiles (:mod:`nexuskv.profiles`) cover a handful of models on H200 machines;
the calibration agent publishes a fitted entry only after ``NEXUSKV_CALIBRATION_MIN_OBSERVATIONS``
observations. In between, a user's own model would never get reuse. :class:`ColdStart` fills
exactly what a :class:`~nexuskv.cost.CostModel` snapshot lacks for one (model, hardware profile),
from the model's shape and what this worker measured, and says so in the snapshot's ``base`` (so
every decision's ``cost_model_version`` names the prior it used). Whatever the snapshot already
has — a shipped profile, a calibrated entry — is left alone: the prior only ever fills gaps.

**Compute.** ``T_compute(e, s) = c0 + f(e, s) / R`` with the FLOP count of
:func:`nexuskv.profiles.flop_compute`, ``f(e, s) = 2*P*e + 2*l*d*e*s`` (P active parameters, l
layers, d hidden size), so ``c1 = 2P/R`` and ``c2 = 2ld/R`` share one unknown, the achieved rate
``R``. :class:`FlopFit` is a Bayesian linear regression in ``(c0, 1/R)``: the prior puts ``1/R``
at ``1 / (MFU * G)`` with ``G`` a GEMM rate measured on the worker's device and MFU 0.5 (assumed,
the shipped profiles' single-GPU figure), relative standard deviation 1 (an order-of-magnitude
guess: the gate will not act on it alone), and ``c0`` at 0 ± 5 ms (the shipped profiles' figure);
each observed prefill (duration ``y`` at ``e``, ``s``) is weighed with relative noise 10% (the
calibration agent's assumption), inflated by the residuals once there are more than two. The
posterior's covariance maps to ``(c0, c1, c2)`` exactly (``c1`` and ``c2`` are perfectly
correlated), so the gate's ``EG - z*sd(EG)`` tightens as observations arrive: reuse starts after a
few prefills, never on the guess alone. ``c0`` is kept non-negative (refit with ``c0 = 0``).

**The GEMM rate, measured stably.** One timing of a small GEMM swung from 13.4 to 392 GFLOP/s
between engine processes on one machine (thread start-up, frequency scaling, a neighbour's load).
:class:`GemmProbe` takes repeated timings (the first ``warmup`` discarded), reports the median rate
with its spread (interquartile range over the median, and max/min) and is *stable* only when the
spread is within ``max_spread`` (:data:`MAX_GEMM_SPREAD`, 25%). :meth:`ColdStart.measured_probe`
refuses an unstable probe (the reason is kept; a later probe may still be taken) rather than anchor
the prior on a number that a second measurement would contradict.

**Links.** ``T(pages) = latency + pages * per_page`` per (profile, source tier -> GPU):
:class:`PagedLinkFit`, the same regression over ``(1, pages)`` from copies this worker timed
(a read probe at start, then every load). The bandwidth term stays 0: the connector copies
blocks of one descriptor, so bytes are a fixed multiple of pages and ``per_page`` carries them (a
link fitted here is only valid for that block size, and the label says so). Prior: latency 0 ±
10 ms, per page 0 ± 10 ms (vague: the first copies decide).

**Hardware profile.** A missing one gets ``prefill_chunk_tokens`` from the engine's token budget,
and assumed lookup and synchronisation latencies (labelled).

Pure and deterministic: observations in, snapshots out; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nexuskv.cost import ComputeCost, CostModel, HardwareProfile, LinearCost, LinkCost
from nexuskv.descriptor import Tier
from nexuskv.profiles import ModelSpec

__all__ = ["ASSUMED_MFU", "RELATIVE_NOISE", "MAX_GEMM_SPREAD", "GemmProbe", "FlopFit", "PagedLinkFit", "ColdStart",
           "assumed_hardware", "with_assumed_hardware", "with_assumed_reads"]

ASSUMED_MFU = 0.5  # as nexuskv.profiles assumes for one GPU
RELATIVE_NOISE = 0.1  # one timing's relative error, as nexuskv.calibration assumes
_C0_STD = 5e-3  # seconds: the shipped profiles' c0 uncertainty
_RATE_REL_STD = 1.0  # the measured GEMM rate says little about the model's achieved rate
_LINK_STD = 1e-2  # seconds: vague prior of a link's latency and per-page cost

MAX_GEMM_SPREAD = 0.25  # interquartile range over median of the probe's rates beyond which it is refused
_Mat2 = tuple[tuple[float, float], tuple[float, float]]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class GemmProbe:
    """A device's GEMM rate from repeated timings of one GEMM of ``flops`` FLOPs.

    ``rate_flops_per_s`` is the median of the per-run rates; ``spread`` their interquartile range
    over that median, ``max_over_min`` the ratio of the fastest to the slowest run; ``stable`` when
    there were at least 3 runs and ``spread <= max_spread``.
    """

    rate_flops_per_s: float
    spread: float
    max_over_min: float
    samples: int
    max_spread: float
    what: str

    @classmethod
    def of(cls, flops: float, durations_s: Sequence[float], *, warmup: int = 1, max_spread: float = MAX_GEMM_SPREAD,
           what: str = "GEMM") -> GemmProbe:
        """The probe of these timings (seconds per run), the first ``warmup`` discarded when more remain."""
        if not flops > 0:
            raise ValueError("flops must be positive")
        kept = list(durations_s[warmup:]) if len(durations_s) > warmup + 2 else list(durations_s)
        rates = sorted(flops / d for d in kept if d > 0 and math.isfinite(d))
        if not rates:
            return cls(0.0, math.inf, math.inf, 0, max_spread, what)
        median = _quantile(rates, 0.5)
        iqr = _quantile(rates, 0.75) - _quantile(rates, 0.25)
        return cls(median, iqr / median, rates[-1] / rates[0], len(rates), max_spread, what)

    @classmethod
    def measure(cls, run: Callable[[], float], flops: float, *, repeats: int = 15, warmup: int = 2,
                max_spread: float = MAX_GEMM_SPREAD, what: str = "GEMM") -> GemmProbe:
        """Call ``run`` (one timed GEMM, returning its seconds) ``warmup + repeats`` times."""
        if repeats < 3:
            raise ValueError("repeats: at least 3 runs to bound a spread")
        return cls.of(flops, [run() for _ in range(warmup + repeats)], warmup=warmup, max_spread=max_spread,
                      what=what)

    @property
    def stable(self) -> bool:
        return self.samples >= 3 and self.rate_flops_per_s > 0 and self.spread <= self.max_spread

    @property
    def label(self) -> str:
        return (f"{self.what}: median of {self.samples} runs {self.rate_flops_per_s / 1e9:.3g} GFLOP/s, IQR "
                f"{self.spread:.0%} of the median (bound {self.max_spread:.0%}), max/min {self.max_over_min:.2f}")

    @property
    def refusal(self) -> str | None:
        """Why the probe may not anchor a prior (None: it may)."""
        if self.samples < 3:
            return f"{self.what}: {self.samples} usable runs, at least 3 are needed to bound the spread"
        if not self.stable:
            return f"unstable GEMM probe refused: {self.label}"
        return None


class _Bayes2:
    """``y = theta . x`` over two features, Gaussian prior, relative-noise weights (1/(0.1 y)^2)."""

    __slots__ = ("prior_mean", "prior_prec", "xtwx", "xtwy", "n", "wrr", "obs")

    def __init__(self, mean: tuple[float, float], std: tuple[float, float]) -> None:
        self.prior_mean = mean
        self.prior_prec = (1.0 / (std[0] * std[0]), 1.0 / (std[1] * std[1]))
        self.xtwx = [[0.0, 0.0], [0.0, 0.0]]
        self.xtwy = [0.0, 0.0]
        self.n = 0
        self.obs: list[tuple[float, float, float]] = []

    def update(self, x0: float, x1: float, y: float) -> None:
        if not (y > 0 and math.isfinite(y) and math.isfinite(x0) and math.isfinite(x1)):
            return
        w = 1.0 / (RELATIVE_NOISE * y) ** 2
        self.xtwx[0][0] += w * x0 * x0
        self.xtwx[0][1] += w * x0 * x1
        self.xtwx[1][1] += w * x1 * x1
        self.xtwy[0] += w * x0 * y
        self.xtwy[1] += w * x1 * y
        self.obs.append((x0, x1, y))
        self.n += 1

    def _solve(self, fix_first_at_zero: bool) -> tuple[tuple[float, float], _Mat2]:
        p0, p1 = self.prior_prec
        m0, m1 = self.prior_mean
        a, b, d = self.xtwx[0][0] + p0, self.xtwx[0][1], self.xtwx[1][1] + p1
        r0, r1 = self.xtwy[0] + p0 * m0, self.xtwy[1] + p1 * m1
        if fix_first_at_zero:
            return (0.0, r1 / d), ((0.0, 0.0), (0.0, 1.0 / d))
        det = a * d - b * b
        cov = ((d / det, -b / det), (-b / det, a / det))
        return (cov[0][0] * r0 + cov[0][1] * r1, cov[1][0] * r0 + cov[1][1] * r1), cov

    def posterior(self) -> tuple[tuple[float, float], _Mat2]:
        """Mean (first coordinate kept >= 0) and covariance, inflated by the residuals past 2 observations."""
        mean, cov = self._solve(False)
        if mean[0] < 0.0:
            mean, cov = self._solve(True)
        if self.n > 2:
            ss = sum(((y - mean[0] * x0 - mean[1] * x1) / (RELATIVE_NOISE * y)) ** 2 for x0, x1, y in self.obs)
            k = max(1.0, ss / (self.n - 2))
            cov = ((cov[0][0] * k, cov[0][1] * k), (cov[1][0] * k, cov[1][1] * k))
        return mean, cov


@dataclass(slots=True)
class FlopFit:
    """``T_compute = c0 + f(e, s) / R`` for one model, prior from a measured GEMM rate (see the module docstring)."""

    spec: ModelSpec
    gemm_flops_per_s: float
    rate_label: str
    _fit: _Bayes2 = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.gemm_flops_per_s > 0:
            raise ValueError("gemm_flops_per_s must be positive")
        inv_rate = 1.0 / (ASSUMED_MFU * self.gemm_flops_per_s)
        self._fit = _Bayes2((0.0, inv_rate), (_C0_STD, _RATE_REL_STD * inv_rate))

    def flops(self, e: int, s: int) -> float:
        return 2.0 * self.spec.active_params * e + 2.0 * self.spec.layers * self.spec.hidden * e * s

    def observe(self, e: int, s: int, duration_s: float) -> None:
        """One prefill of ``e`` tokens in a context of ``s`` took ``duration_s``."""
        if e > 0:
            self._fit.update(1.0, self.flops(e, s), duration_s)

    @property
    def observations(self) -> int:
        return self._fit.n

    def cost(self, profile: str) -> ComputeCost:
        (c0, inv_rate), cov = self._fit.posterior()
        a, b = 2.0 * self.spec.active_params, 2.0 * self.spec.layers * self.spec.hidden
        # (c0, c1, c2) = J (c0, 1/R) with J = [[1, 0], [0, a], [0, b]]: cov3 = J cov J'.
        v00, v01, v11 = cov[0][0], cov[0][1], cov[1][1]
        cov3 = ((v00, a * v01, b * v01), (a * v01, a * a * v11, a * b * v11), (b * v01, a * b * v11, b * b * v11))
        rate = 1.0 / inv_rate if inv_rate > 0 else math.inf
        source = (f"cold-start prior: FLOP-derived 2*P*e + 2*l*d*e*s ({self.spec.label}) at an achieved "
                  f"{rate / 1e9:.3g} GFLOP/s; prior {ASSUMED_MFU} x {self.gemm_flops_per_s / 1e9:.3g} GFLOP/s "
                  f"({self.rate_label}), corrected by {self.observations} observed prefills")
        return ComputeCost(model=self.spec.model, profile=profile, params=LinearCost((c0, a * inv_rate, b * inv_rate),
                                                                                     cov3), source=source,
                           observations=self.observations)


@dataclass(slots=True)
class PagedLinkFit:
    """``T = latency + pages * per_page`` for one link of one profile, from timed copies of one block size."""

    profile: str
    source: Tier
    destination: Tier
    block_bytes: int
    _fit: _Bayes2 = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._fit = _Bayes2((0.0, 0.0), (_LINK_STD, _LINK_STD))

    @property
    def page_bytes(self) -> int:
        return self.block_bytes

    def observe(self, pages: int, duration_s: float) -> None:
        if pages > 0:
            self._fit.update(1.0, float(pages), duration_s)

    @property
    def observations(self) -> int:
        return self._fit.n

    def cost(self) -> LinkCost:
        (latency, per_page), cov = self._fit.posterior()
        cov3 = ((cov[0][0], cov[0][1], 0.0), (cov[1][0], cov[1][1], 0.0), (0.0, 0.0, 0.0))
        label = (f"cold-start prior: {self.source.value}->{self.destination.value} fitted to {self.observations} copies "
                 f"timed on this worker, blocks of {self.block_bytes} bytes (per_page includes the bytes)")
        return LinkCost(profile=self.profile, source=self.source, destination=self.destination,
                        params=LinearCost((latency, per_page, 0.0), cov3), label=label, observations=self.observations,
                        page_bytes=self.block_bytes)


def assumed_hardware(profile: str, *, prefill_chunk_tokens: int = 2048, lookup_s: float = 2e-4, sync_s: float = 5e-5,
                     hbm_bytes_per_s: float = 2e10) -> HardwareProfile:
    """A hardware profile nobody measured: the constants a plan needs, assumed and labelled so."""
    return HardwareProfile(
        name=profile, hbm_bytes_per_s=hbm_bytes_per_s, prefill_chunk_tokens=prefill_chunk_tokens,
        lookup_s=lookup_s, sync_s=sync_s,
        label=(f"cold-start prior: prefill chunk {prefill_chunk_tokens} tokens; lookup {lookup_s * 1e6:.0f} us, "
               f"sync {sync_s * 1e6:.0f} us and memory {hbm_bytes_per_s / 1e9:.0f} GB/s assumed"))


def with_assumed_hardware(model: CostModel, profiles: frozenset[str]) -> CostModel:
    """``model`` with an :func:`assumed_hardware` profile for each of ``profiles`` it lacks (``model``
    itself when it lacks none); ``base`` names them, so decisions say the constants were assumed.

    A fleet planner meets workers whose profile only their own connectors know (a user's machine,
    ``vllm-cpu``); their compute and link costs arrive from calibration, but the hardware constants
    never do.
    """
    missing = sorted(p for p in profiles if p not in model.hardware)
    if not missing:
        return model
    hardware = dict(model.hardware)
    hardware.update({p: assumed_hardware(p) for p in missing})
    return CostModel(base=f"{model.base}+assumed-hardware({','.join(missing)})", hardware=hardware,
                     compute=model.compute, links=model.links, sized_links=model.sized_links,
                     overheads=model.overheads)


def with_assumed_reads(model: CostModel, profiles: frozenset[str]) -> CostModel:
    """``model`` with, for each of ``profiles``, a read from host, disk or the shared remote tier to
    the GPU assumed to cost what the measured write the other way costs, where only the write was
    measured.

    A worker's saves are timed from its first step (every block goes to its tier), its loads only
    once something was loaded; a fleet planner without a read cost never plans the first load. For
    the remote tier that froze every move: a worker saving to the shared tier was observed writing
    but no worker had read, so each remote alternative was refused as unpriced and the read link
    was never observed. The assumed read is labelled, carries no observations (so the gate's bound
    is wide and only the exploration budget takes it at first), and calibration's fit replaces it.
    """
    links, sized = dict(model.links), dict(model.sized_links)
    added = []
    for p in sorted(profiles):
        for tier in (Tier.HOST, Tier.DISK, Tier.REMOTE):
            write = links.get((p, Tier.GPU, tier))
            if (p, tier, Tier.GPU) not in links and write is not None and write.observations:
                links[(p, tier, Tier.GPU)] = _reverse(write, tier)
                added.append(f"{p}:{tier.value}->gpu")
            # Writes fitted at one page size give reads assumed at that size only.
            for (wp, src, dst, size), sized_write in sorted(model.sized_links.items(), key=lambda kv: kv[0][3]):
                if wp != p or src is not Tier.GPU or dst is not tier or not sized_write.observations:
                    continue
                if (p, tier, Tier.GPU, size) in sized:
                    continue
                sized[(p, tier, Tier.GPU, size)] = _reverse(sized_write, tier)
                added.append(f"{p}:{tier.value}->gpu@{size}B")
    if not added:
        return model
    return CostModel(base=f"{model.base}+assumed-reads({','.join(added)})", hardware=model.hardware,
                     compute=model.compute, links=links, sized_links=sized, overheads=model.overheads)


def _reverse(write: LinkCost, tier: Tier) -> LinkCost:
    return LinkCost(write.profile, tier, Tier.GPU, write.params, interference=write.interference,
                    label=f"assumed: the reverse of the measured gpu->{tier.value} link "
                          f"({write.observations} observations)", page_bytes=write.page_bytes)


class ColdStart:
    """What one worker knows about its own costs before the fleet's calibration covers it.

    Feed it the worker's measurements (:meth:`measured_gemm`, :meth:`observe_prefill`,
    :meth:`observe_copy`); :meth:`apply` returns a snapshot with the gaps filled and named.
    """

    def __init__(self, spec: ModelSpec, profile: str, *, block_bytes: int, prefill_chunk_tokens: int,
                 lookup_s: float = 2e-4, sync_s: float = 5e-5, hbm_bytes_per_s: float = 2e10) -> None:
        self.spec = spec
        self.profile = profile
        self.block_bytes = block_bytes
        self.hardware = assumed_hardware(profile, prefill_chunk_tokens=prefill_chunk_tokens, lookup_s=lookup_s,
                                         sync_s=sync_s, hbm_bytes_per_s=hbm_bytes_per_s)
        self.compute: FlopFit | None = None
        self.links: dict[tuple[Tier, Tier], PagedLinkFit] = {}
        self._pending: list[tuple[int, int, float]] = []  # prefills seen before the GEMM rate
        self._cache: tuple[tuple, CostModel] | None = None
        self.probes_refused: list[str] = []  # why each unstable GEMM probe was not taken

    def measured_probe(self, probe: GemmProbe) -> bool:
        """Anchor the compute prior on a repeated GEMM probe if its spread is within its bound; an
        unstable probe is refused (its reason kept in :attr:`probes_refused`). True when taken."""
        why = probe.refusal
        if why is not None:
            self.probes_refused.append(why)
            return False
        if self.compute is not None:
            return False
        self.measured_gemm(probe.rate_flops_per_s, probe.label)
        return True

    def measured_gemm(self, flops_per_s: float, label: str) -> None:
        """The device's GEMM rate (FLOP/s), measured on the worker: the compute prior's anchor (a
        single figure whose spread is unknown; :meth:`measured_probe` takes a repeated one)."""
        if self.compute is not None or not flops_per_s > 0:
            return
        self.compute = FlopFit(self.spec, flops_per_s, label)
        for e, s, y in self._pending:
            self.compute.observe(e, s, y)
        self._pending.clear()

    def observe_prefill(self, e: int, s: int, duration_s: float) -> None:
        if self.compute is None:
            self._pending.append((e, s, duration_s))
        else:
            self.compute.observe(e, s, duration_s)

    def observe_copy(self, source: Tier, destination: Tier, pages: int, duration_s: float) -> None:
        key = (source, destination)
        fit = self.links.get(key)
        if fit is None:
            fit = self.links[key] = PagedLinkFit(self.profile, source, destination, self.block_bytes)
        fit.observe(pages, duration_s)

    def _state(self, model: CostModel) -> tuple:
        return (model.version, self.compute.observations if self.compute else -1,
                tuple((k, f.observations) for k, f in sorted(self.links.items())))

    def apply(self, model: CostModel) -> CostModel:
        """``model`` with what it lacks for this (model, profile) filled from the priors; ``base`` names them."""
        state = self._state(model)
        if self._cache is not None and self._cache[0] == state:
            return self._cache[1]
        parts: list[str] = []
        hardware, compute, links = dict(model.hardware), dict(model.compute), dict(model.links)
        sized = dict(model.sized_links)
        if self.profile not in hardware:
            hardware[self.profile] = self.hardware
            parts.append(f"hardware {self.profile}: assumed")
        key = (self.spec.model, self.profile)
        if key not in compute and self.compute is not None:
            compute[key] = self.compute.cost(self.profile)
            parts.append(f"compute {self.spec.model}: FLOP prior at {self.compute.gemm_flops_per_s / 1e9:.3g} GFLOP/s "
                         f"GEMM + {self.compute.observations} prefills")
        for (src, dst), fit in sorted(self.links.items()):
            if model.link(self.profile, src, dst, fit.page_bytes) is None and fit.observations:
                sized[(self.profile, src, dst, fit.page_bytes)] = fit.cost()
                parts.append(f"{src.value}->{dst.value}: {fit.observations} copies")
        if (self.profile, Tier.GPU, Tier.GPU) not in links and self.profile not in model.hardware:
            links[(self.profile, Tier.GPU, Tier.GPU)] = LinkCost(
                profile=self.profile, source=Tier.GPU, destination=Tier.GPU,
                params=LinearCost.independent((1e-4, 0.0, 0.0), (1e-4, 0.0, 0.0)),
                label="cold-start prior: in place, block-table bookkeeping assumed 100 us")
        if not parts:
            out = model
        else:
            base = f"{model.base}+cold-start({self.profile}: {'; '.join(parts)})"
            out = CostModel(base=base, hardware=hardware, compute=compute, links=links,  # version: base + fitted digest
                            sized_links=sized, overheads=model.overheads)
        self._cache = (state, out)
        return out
