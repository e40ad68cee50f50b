"""Online calibration of the cost model from observations: weighted recursive least squares.

Both cost forms are linear in their parameters (:mod:`nexuskv.cost`), so one estimator fits both:

* prefill observations fit ``T_compute(e, s) = c0 + c1*e + c2*e*s`` per (model, profile);
* request observations fit the fixed per-request cost outside the forward pass (HTTP,
  tokenisation) ``o0 + o1*prompt_tokens`` per (model, profile), features ``(1, n, 0)``;
* completed transfer observations fit ``latency + pages*per_page + bytes*seconds_per_byte`` per
  (profile, source tier -> destination tier, page size). A transfer observation names its worker,
  not a profile: the profile is the one that worker's prefill observations named (else the
  default). The page size (:func:`nexuskv.cost.page_bytes_of`, bytes per page of the copy) is in
  the key because copies of one block size move pages and bytes in fixed proportion: such a fit
  cannot tell a per-page cost from a per-byte one, so it holds at that block size only and is
  never extrapolated to another (each size starts from the shipped, size-free prior).

:class:`RecursiveFit` is recursive least squares with:

* **relative weighting** — timings spread over four orders of magnitude and their noise grows with
  them, so each observation is weighted by ``1/y²`` (the fit minimises relative error);
* **a prior** — the shipped profile's mean and covariance (scaled by an assumed 10% relative
  noise), floored so that a parameter shipped as exactly known can still move; directions the
  data cannot identify (pages and bytes in fixed proportion) stay at the prior;
* **forgetting** — factor ``λ`` (1 = none; 0.999 ≈ the last 1,000 observations) so the fit tracks
  drift;
* **confidence intervals** — the parameter covariance is ``s² P`` with ``s²`` the weighted residual
  variance, so :meth:`RecursiveFit.interval` gives ``mean ± z·sd`` per parameter and the planner's
  gate inherits the uncertainty.

Features are scaled internally so that the 3×3 algebra stays well conditioned (token counts of
1e4, products of 1e9, byte counts of 1e9). One update costs a few microseconds of pure Python
(``tests/nexuskv/test_calibration.py`` fits thousands), light enough for an agent's event loop.

:class:`Calibrator` holds the fits of one calibration worker; :func:`apply_entry` folds a published
:class:`~nexuskv.contracts.cost_models.CostModelEntry` into a planner's :class:`~nexuskv.cost.CostModel`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nexuskv.contracts.cost_models import ComputeFit, CostModelEntry, LinkFit, OverheadFit, link_entry_id
from nexuskv.contracts.observations import (
    ObservationRecord,
    PrefillObservation,
    RequestObservation,
    TransferObservation,
)
from nexuskv.cost import ComputeCost, CostModel, LinearCost, LinkCost, Vec3, page_bytes_of
from nexuskv.descriptor import Tier

__all__ = ["RecursiveFit", "FitKey", "Calibrator", "apply_entry", "COMPUTE_SCALE", "LINK_SCALE", "OVERHEAD_SCALE"]

COMPUTE_SCALE: Vec3 = (1.0, 1e4, 1e9)  # 1, e (tokens), e*s (tokens²)
LINK_SCALE: Vec3 = (1.0, 1e3, 1e9)  # 1, pages, bytes
OVERHEAD_SCALE: Vec3 = (1.0, 1e4, 1.0)  # 1, prompt tokens, (unused: always 0)
PRIOR_NOISE = 0.1  # relative noise assumed when weighing the prior against data
PRIOR_FLOOR = 1e2  # floor of a scaled parameter's prior variance, seconds² at the feature's scale
METHOD = "weighted RLS (1/y² weights), shipped prior, forgetting {lam}"

_Mat = list[list[float]]


def _project_non_negative(theta: Sequence[float], p: _Mat) -> tuple[float, float, float]:
    """``argmin (t - theta)' P^-1 (t - theta)`` subject to ``t >= 0``.

    The minimiser lies on one face of the orthant: some coordinates ``S`` held at zero, the others
    at their Gaussian conditional mean given ``t_S = 0`` (``theta_F - P_FS P_SS^-1 theta_S``), at a
    cost of ``theta_S' P_SS^-1 theta_S``. With three parameters every face is tried and the cheapest
    feasible one kept (``S`` = all is always feasible). ``theta`` itself when already non-negative.
    """
    if all(v >= 0.0 for v in theta):
        return (theta[0], theta[1], theta[2])
    th = np.asarray(theta, dtype=float)
    cov = np.asarray(p, dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for active in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (1, 2, 3)):
        fixed = list(active)
        free = [i for i in range(3) if i not in active]
        pss = cov[np.ix_(fixed, fixed)]
        try:
            w = np.linalg.solve(pss, th[fixed])
        except np.linalg.LinAlgError:
            w = np.linalg.pinv(pss) @ th[fixed]
        t = np.zeros(3)
        if free:
            t[free] = th[free] - cov[np.ix_(free, fixed)] @ w
            if (t[free] < 0.0).any():
                continue
        cost = float(th[fixed] @ w)
        if best is None or cost < best[0]:
            best = (cost, t)
    assert best is not None  # every coordinate at zero is feasible
    return (float(best[1][0]), float(best[1][1]), float(best[1][2]))


class RecursiveFit:
    """Weighted RLS over three features with a Gaussian prior and exponential forgetting."""

    __slots__ = ("scale", "forgetting", "theta", "p", "sum_sq", "dof", "observations")

    def __init__(self, prior: LinearCost, scale: Vec3, *, forgetting: float = 1.0) -> None:
        if not 0.9 <= forgetting <= 1.0:
            raise ValueError(f"forgetting: {forgetting} not in [0.9, 1]")
        self.scale = scale
        self.forgetting = forgetting
        self.theta = [prior.mean[i] * scale[i] for i in range(3)]
        noise2 = PRIOR_NOISE * PRIOR_NOISE
        self.p: _Mat = [[prior.cov[i][j] * scale[i] * scale[j] / noise2 for j in range(3)] for i in range(3)]
        for i in range(3):
            self.p[i][i] = max(self.p[i][i], PRIOR_FLOOR / noise2)
        self.sum_sq = 0.0
        self.dof = 0.0
        self.observations = 0

    def update(self, x: Vec3, y: float) -> None:
        """Fold in one observation ``y`` seconds at features ``x`` (natural units)."""
        if not (y > 0 and math.isfinite(y)) or not all(math.isfinite(v) for v in x):
            return
        s = self.scale
        xs = (x[0] / s[0], x[1] / s[1], x[2] / s[2])
        w = 1.0 / (y * y)
        lam = self.forgetting
        p, th = self.p, self.theta
        px = [p[i][0] * xs[0] + p[i][1] * xs[1] + p[i][2] * xs[2] for i in range(3)]
        xpx = xs[0] * px[0] + xs[1] * px[1] + xs[2] * px[2]
        denom = lam / w + xpx
        k = [v / denom for v in px]
        err = y - (th[0] * xs[0] + th[1] * xs[1] + th[2] * xs[2])
        for i in range(3):
            th[i] += k[i] * err
        for i in range(3):
            for j in range(3):
                p[i][j] = (p[i][j] - k[i] * px[j]) / lam
        for i in range(3):  # keep P symmetric against rounding
            for j in range(i):
                p[i][j] = p[j][i] = 0.5 * (p[i][j] + p[j][i])
        self.sum_sq = lam * self.sum_sq + err * err * lam / denom  # = w e² / (1 + w x'Px / λ)
        self.dof = lam * self.dof + 1.0
        self.observations += 1

    @property
    def residual_rel_std(self) -> float:
        """Standard deviation of one observation's relative error (prior noise until 4 observations)."""
        if self.dof <= 3.0:
            return PRIOR_NOISE
        return math.sqrt(self.sum_sq / (self.dof - 3.0))

    @property
    def mean(self) -> Vec3:
        """The fitted parameters, none negative: costs are sums of non-negative terms (a fixed
        overhead, per token, per token of context), so the unconstrained estimate is projected onto
        that orthant in its own posterior metric (:func:`_project_non_negative`). The recursion itself
        stays unconstrained: clipping each step breaks the recursion's covariance and biased the
        fit (measured in the harness: calibrated worse than not calibrating)."""
        s = self.scale
        th = _project_non_negative(self.theta, self.p)
        return (th[0] / s[0], th[1] / s[1], th[2] / s[2])

    @property
    def cov(self) -> tuple[Vec3, Vec3, Vec3]:
        """Parameter covariance in natural units: ``s² P`` unscaled."""
        s, s2 = self.scale, self.residual_rel_std ** 2
        rows = [tuple(s2 * self.p[i][j] / (s[i] * s[j]) for j in range(3)) for i in range(3)]
        return (rows[0], rows[1], rows[2])  # type: ignore[return-value]

    def interval(self, i: int, z: float = 1.96) -> tuple[float, float]:
        """``mean[i] ± z·sd[i]``."""
        sd = math.sqrt(max(self.cov[i][i], 0.0))
        return (self.mean[i] - z * sd, self.mean[i] + z * sd)

    def cost(self) -> LinearCost:
        return LinearCost(self.mean, self.cov)

    @classmethod
    def from_posterior(cls, mean: Vec3, cov: tuple[Vec3, Vec3, Vec3], residual_rel_std: float, observations: int,
                       scale: Vec3, *, forgetting: float = 1.0) -> RecursiveFit:
        """Resume from a published posterior (:class:`CostModelEntry`): ``P = cov / s²`` scaled.

        Exact up to rounding: a published entry is the whole state of the fit, so a restarted
        calibration worker reads its last entries back instead of keeping a second copy.
        """
        fit = cls(LinearCost(mean, cov), scale, forgetting=forgetting)
        s2 = max(residual_rel_std, 1e-6) ** 2
        fit.p = [[cov[i][j] * scale[i] * scale[j] / s2 for j in range(3)] for i in range(3)]
        fit.observations = observations
        fit.dof = float(observations) if forgetting == 1.0 else (1 - forgetting ** observations) / (1 - forgetting)
        fit.sum_sq = s2 * max(fit.dof - 3.0, 0.0)
        return fit


@dataclass(frozen=True, slots=True)
class FitKey:
    """What one fit is of: a compute profile or a link of a profile."""

    kind: str  # "compute" | "link" | "overhead"
    profile: str
    model: str = ""
    source: Tier | None = None
    destination: Tier | None = None
    page_bytes: int | None = None  # links: bytes of one copied page (the block size the fit holds for)

    @property
    def id(self) -> str:
        """The entry id on ``nexuskv.cost-models`` (:attr:`CostModelEntry.key`)."""
        if self.kind == "compute":
            return f"compute/{self.model}/{self.profile}"
        if self.kind == "overhead":
            return f"overhead/{self.model}/{self.profile}"
        return link_entry_id(self.profile, self.source, self.destination, self.page_bytes)  # type: ignore[arg-type]


class Calibrator:
    """The fits of one calibration worker, started from a shipped cost model's priors."""

    def __init__(self, base: CostModel, *, default_profile: str, forgetting: float = 1.0) -> None:
        self.base = base
        self.default_profile = default_profile
        self.forgetting = forgetting
        self.fits: dict[FitKey, RecursiveFit] = {}
        self.worker_profiles: dict[str, str] = {}
        self.versions: dict[FitKey, int] = {}

    def _fit(self, key: FitKey) -> RecursiveFit:
        fit = self.fits.get(key)
        if fit is None:
            if key.kind == "compute":
                prior_cost = self.base.compute_for(key.model, key.profile)
                prior, scale = (prior_cost.params if prior_cost else LinearCost((0.0, 0.0, 0.0))), COMPUTE_SCALE
            elif key.kind == "overhead":
                prior_over = self.base.overheads.get((key.model, key.profile))
                prior, scale = (prior_over.params if prior_over else LinearCost((0.0, 0.0, 0.0))), OVERHEAD_SCALE
            else:
                prior_link = self.base.link(key.profile, key.source, key.destination)  # type: ignore[arg-type]
                prior, scale = (prior_link.params if prior_link else LinearCost((0.0, 0.0, 0.0))), LINK_SCALE
            fit = self.fits[key] = RecursiveFit(prior, scale, forgetting=self.forgetting)
        return fit

    def observe(self, record: ObservationRecord) -> FitKey | None:
        """Fold in one observation; returns the fit it updated (None: nothing to fit)."""
        obs = record.observation
        if isinstance(obs, PrefillObservation):
            if obs.uncached_tokens == 0:
                return None
            self.worker_profiles[obs.worker] = obs.profile
            key = FitKey("compute", obs.profile, model=obs.model)
            self._fit(key).update(ComputeCost.features(obs.uncached_tokens, obs.context_tokens), obs.duration_s)
            return key
        if isinstance(obs, TransferObservation):
            if not obs.ok or obs.bytes == 0:
                return None  # a failed copy measures the failure, not the link
            profile = self.worker_profiles.get(obs.worker, self.default_profile)
            key = FitKey("link", profile, source=obs.source_tier, destination=obs.destination_tier,
                         page_bytes=page_bytes_of(obs.bytes, obs.pages))
            self._fit(key).update((1.0, float(obs.pages), float(obs.bytes)), obs.duration_s)
            return key
        if isinstance(obs, RequestObservation):
            key = FitKey("overhead", obs.profile, model=obs.model)
            self._fit(key).update((1.0, float(obs.prompt_tokens), 0.0), obs.duration_s)
            return key
        return None  # load observations describe workers, not costs

    def resume(self, entry: CostModelEntry) -> FitKey:
        """Resume a fit from its last published entry (versions continue from it)."""
        fit = entry.entry
        if isinstance(fit, ComputeFit):
            key, scale = FitKey("compute", fit.profile, model=fit.model), COMPUTE_SCALE
        elif isinstance(fit, OverheadFit):
            key, scale = FitKey("overhead", fit.profile, model=fit.model), OVERHEAD_SCALE
        else:
            key = FitKey("link", fit.profile, source=fit.source_tier, destination=fit.destination_tier,
                         page_bytes=fit.page_bytes)
            scale = LINK_SCALE
        self.fits[key] = RecursiveFit.from_posterior(entry.mean, entry.cov, entry.residual_rel_std,
                                                     entry.observations, scale, forgetting=self.forgetting)
        self.versions[key] = entry.version
        return key

    def entry(self, key: FitKey, *, now: float, publisher: str) -> CostModelEntry:
        """The fit as a publishable, versioned record (each call is a new version)."""
        fit = self.fits[key]
        version = self.versions.get(key, 0) + 1
        self.versions[key] = version
        if key.kind == "compute":
            what: ComputeFit | LinkFit | OverheadFit = ComputeFit(model=key.model, profile=key.profile)
        elif key.kind == "overhead":
            what = OverheadFit(model=key.model, profile=key.profile)
        else:
            what = LinkFit(profile=key.profile, source_tier=key.source, destination_tier=key.destination,
                           page_bytes=key.page_bytes)
        return CostModelEntry(entry=what, mean=fit.mean, cov=fit.cov, residual_rel_std=fit.residual_rel_std,
                              observations=fit.observations, version=version, fitted_at=now, publisher=publisher,
                              method=METHOD.format(lam=fit.forgetting))


def apply_entry(model: CostModel, entry: CostModelEntry) -> CostModel:
    """``model`` with ``entry``'s fit in place of what it had for that key (a new snapshot)."""
    params = LinearCost(entry.mean, entry.cov)
    label = (f"fitted: {entry.method}, {entry.observations} observations, residual "
             f"{entry.residual_rel_std:.1%}, v{entry.version} by {entry.publisher}")
    fit = entry.entry
    if isinstance(fit, ComputeFit):
        return model.with_compute(ComputeCost(model=fit.model, profile=fit.profile, params=params, source=label,
                                              observations=entry.observations, version=entry.version))
    if isinstance(fit, OverheadFit):
        return model.with_overhead(ComputeCost(model=fit.model, profile=fit.profile, params=params,
                                               source=f"per-request overhead {label}",
                                               observations=entry.observations, version=entry.version))
    if fit.page_bytes is not None:
        label += f", copies of {fit.page_bytes}-byte pages"
    return model.with_link(LinkCost(profile=fit.profile, source=fit.source_tier, destination=fit.destination_tier,
                                    params=params, label=label, observations=entry.observations,
                                    version=entry.version, page_bytes=fit.page_bytes))
