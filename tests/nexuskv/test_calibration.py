"""Online calibration: observations from a known profile plus noise recover it, and so do decisions."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from nexuskv.calibration import COMPUTE_SCALE, LINK_SCALE, Calibrator, FitKey, RecursiveFit, apply_entry
from nexuskv.contracts import decode, encode
from nexuskv.contracts.decisions import Action
from nexuskv.contracts.observations import (
    LoadObservation,
    ObservationRecord,
    PrefillObservation,
    RequestObservation,
    TransferObservation,
)
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.contracts.topics import COST_MODELS
from nexuskv.cost import ComputeCost, LinearCost, LinkCost
from nexuskv.descriptor import Tier
from nexuskv.models import known_model
from nexuskv.planner import plan
from nexuskv.policy import ExecutionPolicy
from nexuskv.profiles import shipped_cost_model

from tests.planning import NOW, lookup, match, query

MODEL_NAME = "meta-llama/Llama-3.1-8B"
PROFILE = "h200x1-rdma4x200"
SHIPPED = shipped_cost_model()
# The "real" hardware: slower compute than the FLOP estimate, a fixed overhead, and links whose
# fixed costs differ from the shipped assumptions.
TRUE_COMPUTE = (0.012, 3.6e-5, 7.0e-10)
TRUE_LINKS = {
    Tier.HOST: (2e-4, 3e-6, 1 / 42e9),
    Tier.DISK: (4e-4, 6e-5, 1 / 5.2e9),
    Tier.REMOTE: (2.5e-3, 8e-6, 1 / 70e9),
}
NOISE = 0.03


def _prefill(rng: random.Random, worker: str = "w-1", truth=TRUE_COMPUTE, profile: str = PROFILE):
    e = int(10 ** rng.uniform(1.0, 4.8))
    s = e + int(10 ** rng.uniform(0.0, 5.0))
    y = (truth[0] + truth[1] * e + truth[2] * e * s) * (1 + rng.gauss(0, NOISE))
    return ObservationRecord(observed_at=NOW, observation=PrefillObservation(
        model=MODEL_NAME, profile=profile, worker=worker, uncached_tokens=e, context_tokens=s, duration_s=y))


PAGE_SIZES = (16 << 10, 64 << 10, 256 << 10, 2 << 20)


def _transfer(rng: random.Random, tier: Tier, worker: str = "w-1", truth=None, page: int | None = None):
    lat, per_page, spb = truth or TRUE_LINKS[tier]
    pages = rng.randint(1, 5000)
    nbytes = pages * (page or rng.choice(PAGE_SIZES))
    y = (lat + per_page * pages + spb * nbytes) * (1 + rng.gauss(0, NOISE))
    return ObservationRecord(observed_at=NOW, observation=TransferObservation(
        source_tier=tier, destination_tier=Tier.GPU, backend="b", worker=worker, bytes=nbytes, pages=pages,
        duration_s=y))


def _calibrated(n: int = 3000, seed: int = 11, page: int | None = None) -> Calibrator:
    """Fits of ``n`` observations of each kind (transfers of one page size, else of all four)."""
    rng = random.Random(seed)
    cal = Calibrator(SHIPPED, default_profile=PROFILE)
    for _ in range(n):
        cal.observe(_prefill(rng))
        for tier in TRUE_LINKS:
            cal.observe(_transfer(rng, tier, page=page))
    return cal


def test_fitted_parameters_come_within_5_percent_and_their_intervals_cover_the_truth():
    cal = _calibrated()
    compute = cal.fits[FitKey("compute", PROFILE, model=MODEL_NAME)]
    for got, want in zip(compute.mean, TRUE_COMPUTE):
        assert got == pytest.approx(want, rel=0.05)
    assert compute.residual_rel_std == pytest.approx(NOISE, rel=0.2)
    for i, want in enumerate(TRUE_COMPUTE):
        lo, hi = compute.interval(i, z=4.0)
        assert lo <= want <= hi
    for tier, truth in TRUE_LINKS.items():
        for size in PAGE_SIZES:
            # One fit per block size: at one size pages and bytes move together, so the fit is judged
            # by what it predicts at that size (its latency and its cost per page of that size).
            fit = cal.fits[FitKey("link", PROFILE, source=tier, destination=Tier.GPU, page_bytes=size)]
            cost = fit.cost()
            for pages in (50, 500, 5000):  # the observed range (1..5000 pages, uniform)
                want = truth[0] + truth[1] * pages + truth[2] * pages * size
                got = cost.predict(1.0, pages, pages * size)
                assert got == pytest.approx(want, rel=0.05), (tier, size, pages, got, want)


def _true_model():
    model = SHIPPED.with_compute(ComputeCost(model=MODEL_NAME, profile=PROFILE, params=LinearCost(TRUE_COMPUTE),
                                             source="truth", observations=1, version=1))
    for tier, truth in TRUE_LINKS.items():
        # The truth at the deployment's block size (2 MiB pages), as the fits are kept: links of one
        # size compose serially (nexuskv.cost.compose_links), on both sides of the comparison.
        model = model.with_link(LinkCost(profile=PROFILE, source=tier, destination=Tier.GPU,
                                         params=LinearCost(truth), label="truth", observations=1, version=1,
                                         page_bytes=2 << 20))
    return model


def _scenarios():
    d = known_model(MODEL_NAME, tenant_namespace="cal")
    for tokens in (1024, 4096, 16384, 65536):
        for holder_tier in ("gpu", "host", "disk", "remote"):
            for queued in (0, 20_000, 300_000):
                q = query(d, tokens, [WorkerLoad(worker="w-1", profile=PROFILE, queued_prefill_tokens=queued),
                                      WorkerLoad(worker="w-2", profile=PROFILE)], seed=tokens)
                nb = len(q.keys)
                yield q, lookup(nb, match("w-1", holder_tier, nb), match("w-2", "gpu", nb // 8))


def test_the_planner_chooses_under_the_fitted_model_what_it_chooses_under_the_true_one():
    cal = _calibrated(page=2 << 20)  # a deployment's copies are of its own block size (Llama-3.1-8B: 2 MiB)
    fitted = SHIPPED
    for key in cal.fits:
        fitted = apply_entry(fitted, cal.entry(key, now=NOW, publisher="test"))
    truth = _true_model()
    policy = ExecutionPolicy(version="cal")
    shipped_differs = 0
    compared = 0
    for q, lk in _scenarios():
        want = plan(q, lk, truth, policy, now=NOW).decision
        got = plan(q, lk, fitted, policy, now=NOW).decision
        assert (got.action, got.worker, got.source) == (want.action, want.worker, want.source), (
            f"{q.prompt_tokens} tokens: true {want.reason} / fitted {got.reason}")
        before = plan(q, lk, SHIPPED, policy, now=NOW).decision
        shipped_differs += (before.action, before.worker, before.source) != (want.action, want.worker, want.source)
        compared += 1
    assert compared == 48
    assert shipped_differs > 0  # calibration changed something: the test is not vacuous


def test_transfers_are_attributed_to_the_profile_their_worker_reported():
    cal = Calibrator(SHIPPED, default_profile=PROFILE)
    rng = random.Random(3)
    assert cal.observe(_transfer(rng, Tier.HOST, worker="w-9", page=4096)) == FitKey(
        "link", PROFILE, source=Tier.HOST, destination=Tier.GPU, page_bytes=4096)
    cal.observe(_prefill(rng, worker="w-9", profile="h200x8-rdma8x400"))
    key = cal.observe(_transfer(rng, Tier.HOST, worker="w-9"))
    assert key.profile == "h200x8-rdma8x400"
    failed = ObservationRecord(observed_at=NOW, observation=TransferObservation(
        source_tier="host", destination_tier="gpu", backend="b", worker="w-9", bytes=10, pages=1, duration_s=1.0,
        ok=False))
    load = ObservationRecord(observed_at=NOW, observation=LoadObservation(worker="w-9", queued_prefill_tokens=1,
                                                                          decode_blocks=2, active_requests=1))
    cached = ObservationRecord(observed_at=NOW, observation=PrefillObservation(
        model=MODEL_NAME, profile=PROFILE, worker="w-9", uncached_tokens=0, context_tokens=100, duration_s=0.001))
    assert cal.observe(failed) is None and cal.observe(load) is None and cal.observe(cached) is None


def test_forgetting_tracks_a_change_of_hardware():
    rng = random.Random(5)
    prior = SHIPPED.compute_for(MODEL_NAME, PROFILE).params
    before, after = (0.01, 3e-5, 6e-10), (0.02, 4.5e-5, 9e-10)
    tracking, frozen = RecursiveFit(prior, COMPUTE_SCALE, forgetting=0.99), RecursiveFit(prior, COMPUTE_SCALE)
    for truth in (before, after):
        for _ in range(1500):
            obs = _prefill(rng, truth=truth).observation
            x = (1.0, obs.uncached_tokens, obs.uncached_tokens * obs.context_tokens)
            tracking.update(x, obs.duration_s)
            frozen.update(x, obs.duration_s)
    assert tracking.mean[1] == pytest.approx(after[1], rel=0.05)
    assert abs(frozen.mean[1] / after[1] - 1) > 0.1  # without forgetting it averages the two
    with pytest.raises(ValueError):
        RecursiveFit(prior, COMPUTE_SCALE, forgetting=0.5)


def test_bad_observations_are_ignored_by_the_estimator():
    fit = RecursiveFit(LinearCost((0.0, 1e-5, 0.0)), LINK_SCALE)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        fit.update((1.0, 10.0, 1e6), bad)
    fit.update((1.0, float("nan"), 1e6), 0.1)
    assert fit.observations == 0


def test_an_unidentifiable_direction_stays_at_the_prior():
    prior = SHIPPED.link(PROFILE, Tier.HOST, Tier.GPU).params
    fit = RecursiveFit(prior, LINK_SCALE)
    rng = random.Random(9)
    for _ in range(500):  # always 2 MiB pages: per-page cost and bandwidth cannot be told apart
        pages = rng.randint(1, 1000)
        y = (1e-4 + pages * (2e-6 + (2 << 20) / 40e9)) * (1 + rng.gauss(0, 0.01))
        fit.update((1.0, pages, pages * (2 << 20)), y)
    per_page_total = fit.mean[1] + fit.mean[2] * (2 << 20)
    assert per_page_total == pytest.approx(2e-6 + (2 << 20) / 40e9, rel=0.02)  # the sum is learned
    assert fit.cov[1][1] > 0 and fit.cov[2][2] > 0


def test_a_published_entry_is_the_whole_state_of_its_fit():
    rng = random.Random(1)
    cal = Calibrator(SHIPPED, default_profile=PROFILE, forgetting=0.999)
    for _ in range(300):
        cal.observe(_prefill(rng))
    key = FitKey("compute", PROFILE, model=MODEL_NAME)
    published = cal.entry(key, now=NOW, publisher="a")
    resumed = Calibrator(SHIPPED, default_profile=PROFILE, forgetting=0.999)
    assert resumed.resume(decode(COST_MODELS, encode(COST_MODELS, published))) == key
    for _ in range(50):
        nxt = _prefill(rng)
        cal.observe(nxt)
        resumed.observe(nxt)
    for a, b in zip(resumed.fits[key].mean, cal.fits[key].mean):
        assert a == pytest.approx(b, rel=1e-9)
    assert resumed.fits[key].residual_rel_std == pytest.approx(cal.fits[key].residual_rel_std, rel=1e-9)
    assert resumed.entry(key, now=NOW, publisher="b").version == published.version + 1


def test_entries_are_versioned_contracts_that_the_planner_folds_in():
    cal = _calibrated(n=300)
    key = FitKey("compute", PROFILE, model=MODEL_NAME)
    one, two = cal.entry(key, now=NOW, publisher="cal-0"), cal.entry(key, now=NOW + 1, publisher="cal-0")
    assert (one.version, two.version) == (1, 2) and one.key == key.id == f"compute/{MODEL_NAME}/{PROFILE}"
    assert decode(COST_MODELS, encode(COST_MODELS, two)) == two
    model = apply_entry(SHIPPED, two)
    assert model.version != SHIPPED.version
    fitted = model.compute_for(MODEL_NAME, PROFILE)
    assert fitted.params.mean == two.mean and fitted.observations == 300 and "fitted" in fitted.source
    link_key = FitKey("link", PROFILE, source=Tier.DISK, destination=Tier.GPU, page_bytes=2 << 20)
    link_entry = cal.entry(link_key, now=NOW, publisher="cal-0")
    assert link_entry.key == f"link/{PROFILE}/disk->gpu/{2 << 20}B" and link_entry.entry.page_bytes == 2 << 20
    with_link = apply_entry(model, link_entry)
    assert with_link.link(PROFILE, Tier.DISK, Tier.GPU, 2 << 20).interference == SHIPPED.link(PROFILE, Tier.DISK,
                                                                                               Tier.GPU).interference
    d = known_model(MODEL_NAME, tenant_namespace="cal")
    q = query(d, 4096, [WorkerLoad(worker="w-1", profile=PROFILE)])
    assert plan(q, lookup(len(q.keys)), with_link, ExecutionPolicy(version="v"),
                now=NOW).decision.cost_model_version == with_link.version


def test_fitted_parameters_stay_non_negative_under_adversarial_noise():
    fit = RecursiveFit(LinearCost.independent((2e-3, 1.5e-5, 5e-8), (1e-3, 1.5e-6, 5e-9)), COMPUTE_SCALE)
    rng = random.Random(3)
    for _ in range(300):  # long prompts observed fast, short ones slow: an unconstrained fit goes below zero
        e = rng.choice([50, 2000])
        y = 0.5 if e == 50 else 0.05
        fit.update((1.0, float(e), float(e * e)), y)
    assert all(v >= 0.0 for v in fit.mean), fit.mean
    assert LinearCost(fit.mean, fit.cov).predict(1.0, 10.0, 100.0) >= 0.0


def test_the_non_negative_mean_is_the_posterior_projection_not_a_clip():
    import numpy as np

    from nexuskv.calibration import _project_non_negative

    rng = np.random.default_rng(11)
    for _ in range(200):
        a = rng.normal(size=(3, 3))
        p = a @ a.T + 0.1 * np.eye(3)
        theta = rng.normal(size=3)
        t = np.array(_project_non_negative(theta.tolist(), p.tolist()))
        assert (t >= 0).all()
        inv = np.linalg.inv(p)
        best = (t - theta) @ inv @ (t - theta)
        # no other non-negative point is closer in the posterior metric: the clip, and random ones
        for other in [np.maximum(theta, 0.0), *np.abs(rng.normal(size=(300, 3)) + np.maximum(theta, 0.0))]:
            assert best <= (other - theta) @ inv @ (other - theta) + 1e-9
        if (theta >= 0).all():
            assert np.allclose(t, theta)


def test_a_fit_from_a_zero_overhead_prior_finds_a_positive_overhead():
    # The shipped compute priors have c0 = 0; the truth has a fixed cost per prefill. Early noisy
    # steps push c0 below zero; the fit must still converge to the truth, not stick at the boundary.
    truth = (0.015, 4.9e-5, 4.6e-10)
    fit = RecursiveFit(LinearCost.independent((0.0, 4.46e-5, 4.14e-10), (1e-3, 4.46e-6, 4.14e-11)), COMPUTE_SCALE)
    rng = random.Random(5)
    for _ in range(600):
        e = rng.randint(200, 60_000)
        y = (truth[0] + truth[1] * e + truth[2] * e * e) * math.exp(rng.gauss(0.0, 0.05))
        fit.update((1.0, float(e), float(e * e)), y)
    for got, want in zip(fit.mean, truth):
        assert got == pytest.approx(want, rel=0.15)


# -- fits per block size ------------------------------------------------------------------------------

def test_link_fits_are_kept_per_page_size_and_never_lent_to_another():
    """Copies of 16 KiB pages fit one entry, of 2 MiB another; a third size gets the size-free prior."""
    rng = random.Random(5)
    cal = Calibrator(SHIPPED, default_profile=PROFILE)
    keys = {cal.observe(_transfer(rng, Tier.DISK, page=size)) for size in (16 << 10, 2 << 20) for _ in range(200)}
    assert {k.page_bytes for k in keys} == {16 << 10, 2 << 20}
    model = SHIPPED
    for key in keys:
        model = apply_entry(model, cal.entry(key, now=NOW, publisher="t"))
    small, big = model.link(PROFILE, Tier.DISK, Tier.GPU, 16 << 10), model.link(PROFILE, Tier.DISK, Tier.GPU, 2 << 20)
    assert small.observations == big.observations == 200 and small.page_bytes == 16 << 10
    assert small.params.mean != big.params.mean
    prior = SHIPPED.link(PROFILE, Tier.DISK, Tier.GPU)
    assert model.link(PROFILE, Tier.DISK, Tier.GPU, 64 << 10) is prior  # never extrapolated from another size
    assert model.link(PROFILE, Tier.DISK, Tier.GPU) is prior
    assert model.version != SHIPPED.version


def test_the_planner_prices_a_load_with_the_fit_of_its_own_block_size():
    """Llama-3.1-8B's 16-token blocks are 2 MiB pages: a fit of 2 MiB copies prices its loads, and a fit of
    another size, however slow, does not."""
    d = known_model(MODEL_NAME, tenant_namespace="cal")
    q = query(d, 16384, [WorkerLoad(worker="w-1", profile=PROFILE)])
    nb = len(q.keys)
    lk = lookup(nb, match("w-1", "disk", nb))
    policy = ExecutionPolicy(version="v")
    shipped = plan(q, lk, SHIPPED, policy, now=NOW).decision
    slow = LinkCost(profile=PROFILE, source=Tier.DISK, destination=Tier.GPU, params=LinearCost((1.0, 1.0, 0.0)),
                    label="slow", observations=500, version=1, page_bytes=16 << 10)
    other_size = plan(q, lk, SHIPPED.with_link(slow), policy, now=NOW).decision
    assert other_size.action is shipped.action and other_size.t_with_reuse_s == shipped.t_with_reuse_s
    own_size = plan(q, lk, SHIPPED.with_link(replace(slow, page_bytes=2 << 20)), policy, now=NOW).decision
    assert own_size.action is Action.RECOMPUTE
    load = next(a for a in own_size.alternatives if a.action in (Action.TRANSFER, Action.PREFETCH))
    assert load.terms.transfer_s == pytest.approx(1.0 + load.reused_blocks)  # 1 s + 1 s per page: the 2 MiB fit


def test_an_entry_published_before_page_sizes_existed_still_applies_at_any_size():
    cal = _calibrated(n=50, page=2 << 20)
    entry = cal.entry(FitKey("link", PROFILE, source=Tier.HOST, destination=Tier.GPU, page_bytes=2 << 20), now=NOW,
                      publisher="t")
    raw = entry.model_dump(mode="json")
    del raw["entry"]["page_bytes"]
    legacy = decode(COST_MODELS, json.dumps(raw).encode())
    assert legacy.key == f"link/{PROFILE}/host->gpu"
    model = apply_entry(SHIPPED, legacy)
    assert model.link(PROFILE, Tier.HOST, Tier.GPU, 4096).observations == 50


# -- the fixed per-request overhead ------------------------------------------------------------------

TRUE_OVERHEAD = (0.03, 2e-6)  # 30 ms of HTTP and scheduling, 2 us per prompt token of tokenisation


def _request(rng: random.Random, worker: str = "w-1"):
    n = rng.randint(16, 32_000)
    y = (TRUE_OVERHEAD[0] + TRUE_OVERHEAD[1] * n) * (1 + rng.gauss(0, NOISE))
    return ObservationRecord(observed_at=NOW, request_id=f"q{n}", observation=RequestObservation(
        model=MODEL_NAME, profile=PROFILE, worker=worker, prompt_tokens=n, duration_s=y))


def test_the_per_request_overhead_is_fitted_published_and_priced_at_admission():
    rng = random.Random(21)
    cal = Calibrator(SHIPPED, default_profile=PROFILE)
    keys = {cal.observe(_request(rng)) for _ in range(400)}
    assert keys == {FitKey("overhead", PROFILE, model=MODEL_NAME)}
    key = keys.pop()
    fit = cal.fits[key]
    assert fit.mean[0] == pytest.approx(TRUE_OVERHEAD[0], rel=0.05)
    assert fit.mean[1] == pytest.approx(TRUE_OVERHEAD[1], rel=0.1)
    entry = cal.entry(key, now=NOW, publisher="t")
    assert entry.key == key.id == f"overhead/{MODEL_NAME}/{PROFILE}"
    assert decode(COST_MODELS, encode(COST_MODELS, entry)) == entry
    model = apply_entry(SHIPPED, entry)
    assert model.version != SHIPPED.version
    assert model.request_seconds(MODEL_NAME, PROFILE, 10_000) == pytest.approx(0.05, rel=0.05)
    assert model.request_seconds(MODEL_NAME, "another-profile", 10_000) == 0.0

    d = known_model(MODEL_NAME, tenant_namespace="cal")
    q = query(d, 8192, [WorkerLoad(worker="w-1", profile=PROFILE)])
    nb = len(q.keys)
    lk = lookup(nb, match("w-1", "gpu", nb // 2))
    policy = ExecutionPolicy(version="v", planner={"explore_share": 0.0})
    without = plan(q, lk, SHIPPED, policy, now=NOW).decision
    with_overhead = plan(q, lk, model, policy, now=NOW).decision
    overhead = model.request_seconds(MODEL_NAME, PROFILE, 8192)
    # In every predicted time to first token alike: the choice and its EG do not move, the TTFT does.
    assert with_overhead.action is without.action and with_overhead.eg_s == pytest.approx(without.eg_s)
    assert with_overhead.terms.request_s == pytest.approx(overhead)
    assert with_overhead.t_with_reuse_s == pytest.approx(without.t_with_reuse_s + overhead)
    assert with_overhead.t_compute_s == pytest.approx(without.t_compute_s + overhead)
    recompute = next(a for a in with_overhead.alternatives if a.action is Action.RECOMPUTE)
    assert recompute.terms.request_s == pytest.approx(overhead) and recompute.t_with_reuse_s == pytest.approx(
        with_overhead.t_compute_s)
    # An engine's own connector plans after the request's HTTP and tokenisation: no overhead ahead.
    inside = plan(replace(q, at_admission=False), lk, model, policy, now=NOW).decision
    assert inside.terms.request_s == 0.0 and inside.t_with_reuse_s == pytest.approx(without.t_with_reuse_s)
