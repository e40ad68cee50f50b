"""The cold-start prior: it fills only what a cost model lacks, learns from a few timings, and says so.

Acceptance: with the prior alone the planner does not move state for an unknown model (an
order-of-magnitude guess is not confidence); after a few observed prefills and copies it does,
and the decision's ``cost_model_version`` names the prior; a shipped or calibrated entry is never
overridden; the fit recovers a true (c0, R) from noisy timings with non-negative c0.
"""

from __future__ import annotations

import math
import random

import pytest

from nexuskv.contracts.decisions import Action
from nexuskv.contracts.plans import WorkerLoad
from nexuskv.cost import ComputeCost, CostModel, LinearCost, LinkCost
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.identity import IdentityScope, block_keys
from nexuskv.lookup import LocationMatch, LookupResult
from nexuskv.planner import PlanQuery, plan
from nexuskv.policy import ExecutionPolicy, PlannerSettings
from nexuskv.priors import MAX_GEMM_SPREAD, ColdStart, FlopFit, GemmProbe, PagedLinkFit, with_assumed_reads
from nexuskv.profiles import ModelSpec, shipped_cost_model

from tests.factories import descriptor

SPEC = ModelSpec("acme/tiny", active_params=3e5, layers=2, hidden=128, label="test")
PROFILE = "vllm-cpu"


def _true_seconds(e: int, s: int, *, c0: float = 2e-3, rate: float = 50e9) -> float:
    return c0 + (2 * SPEC.active_params * e + 2 * SPEC.layers * SPEC.hidden * e * s) / rate


def test_the_fit_recovers_overhead_and_rate_from_noisy_timings():
    fit = FlopFit(SPEC, 400e9, "test GEMM")
    rng = random.Random(3)
    for _ in range(40):
        e = rng.choice([16, 300, 1000, 3000])
        fit.observe(e, e, _true_seconds(e, e) * rng.uniform(0.95, 1.05))
    cost = fit.cost(PROFILE)
    c0, c1, _c2 = cost.params.mean
    assert c0 == pytest.approx(2e-3, rel=0.15)
    assert c1 == pytest.approx(2 * SPEC.active_params / 50e9, rel=0.1)
    assert "40 observed prefills" in cost.source and "FLOP-derived" in cost.source
    assert math.sqrt(cost.params.cov[1][1]) < 0.05 * c1  # confident after many


def test_overhead_is_never_negative():
    fit = FlopFit(SPEC, 400e9, "test GEMM")
    for e in (100, 1000, 3000):
        fit.observe(e, e, _true_seconds(e, e, c0=0.0) * 0.7)  # a rate faster than the prior mean
    assert fit.cost(PROFILE).params.mean[0] >= 0.0


def test_a_link_fit_from_timed_copies():
    fit = PagedLinkFit(PROFILE, Tier.DISK, Tier.GPU, block_bytes=16384)
    for pages in (1, 8, 40, 93):
        fit.observe(pages, 1e-4 + pages * 3e-5)
    cost = fit.cost()
    assert cost.params.mean[0] == pytest.approx(1e-4, rel=0.2) and cost.params.mean[1] == pytest.approx(3e-5, rel=0.05)
    assert cost.params.mean[2] == 0.0 and "16384 bytes" in cost.label


def _world():
    d = descriptor(model=SPEC.model, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32)
    scope = IdentityScope.of(d)
    tokens = list(range(3000))
    keys = tuple(block_keys(scope, tokens, 32))
    found = LookupResult(num_blocks=len(keys), matches=(
        LocationMatch(EntryLocation(worker="w", tier=Tier.DISK), "w", 93),))
    query = PlanQuery(request_id="r", scope=scope, descriptor=d, keys=keys, prompt_tokens=3000, arrival_at=0.0,
                      candidates=(WorkerLoad(worker="w", profile=PROFILE),))
    policy = ExecutionPolicy(version="t", planner=PlannerSettings(default_hardware_profile=PROFILE))
    return query, found, policy


def test_reuse_starts_after_a_few_observations_and_the_decision_names_the_prior():
    query, found, policy = _world()
    cold = ColdStart(SPEC, PROFILE, block_bytes=16384, prefill_chunk_tokens=4096)
    shipped = shipped_cost_model()
    first = plan(query, found, cold.apply(shipped), policy, now=0.0)
    assert first.chosen.action is Action.RECOMPUTE and "no cost profile" in first.decision.reason
    cold.measured_gemm(400e9, "test GEMM")
    for pages in (1, 8):
        cold.observe_copy(Tier.DISK, Tier.GPU, pages, 1e-4 + pages * 3e-5)
    guess = plan(query, found, cold.apply(shipped), policy, now=0.0)
    assert guess.chosen.action is Action.RECOMPUTE  # the GEMM rate alone is not enough to act on
    cold.observe_prefill(1024, 1024, _true_seconds(1024, 1024))
    cold.observe_prefill(3000, 3000, _true_seconds(3000, 3000))
    p = plan(query, found, cold.apply(shipped), policy, now=0.0)
    assert p.chosen.action is Action.TRANSFER and p.decision.reused_tokens == 93 * 32
    version = p.decision.cost_model_version
    assert version.startswith(shipped.base + "+cold-start(vllm-cpu: hardware vllm-cpu: assumed; compute acme/tiny: FLOP")
    assert "2 prefills" in version and "disk->gpu: 2 copies" in version


def test_what_the_cost_model_has_is_never_overridden():
    cold = ColdStart(SPEC, "h200x1-rdma4x200", block_bytes=16384, prefill_chunk_tokens=4096)
    cold.measured_gemm(400e9, "test GEMM")
    cold.observe_prefill(1000, 1000, 0.05)
    cold.observe_copy(Tier.DISK, Tier.GPU, 8, 1e-3)
    shipped = shipped_cost_model()
    out = cold.apply(shipped)
    assert out.hardware["h200x1-rdma4x200"] is shipped.hardware["h200x1-rdma4x200"]
    assert out.link("h200x1-rdma4x200", Tier.DISK, Tier.GPU) is shipped.link("h200x1-rdma4x200", Tier.DISK, Tier.GPU)
    assert out.compute_for(SPEC.model, "h200x1-rdma4x200").source.startswith("cold-start prior")
    calibrated = shipped.with_compute(ComputeCost(model=SPEC.model, profile="h200x1-rdma4x200", source="fitted",
                                                  params=LinearCost((0.0, 1e-5, 0.0)), observations=30, version=1))
    assert cold.apply(calibrated) is calibrated  # nothing left to fill: the same snapshot, no label
    assert cold.apply(shipped) is cold.apply(shipped)  # memoised until something changes


def test_a_read_is_assumed_from_the_measured_write_until_it_is_measured():
    write = LinkCost("cpu", Tier.GPU, Tier.DISK, LinearCost((1e-3, 2e-4, 1e-9)), label="fit", observations=6, version=3)
    model = CostModel.build("b", [], [], [write])
    filled = with_assumed_reads(model, frozenset({"cpu", "other"}))
    read = filled.link("cpu", Tier.DISK, Tier.GPU)
    assert read.params == write.params and read.observations == 0 and "assumed" in read.label
    assert filled.base == "b+assumed-reads(cpu:disk->gpu)" and filled.link("cpu", Tier.HOST, Tier.GPU) is None
    measured = LinkCost("cpu", Tier.DISK, Tier.GPU, LinearCost((5e-4, 1e-4, 1e-9)), label="fit", observations=2)
    both = CostModel.build("b", [], [], [write, measured])
    assert with_assumed_reads(both, frozenset({"cpu"})) is both  # a measured read is kept
    unmeasured = CostModel.build("b", [], [], [LinkCost("cpu", Tier.GPU, Tier.DISK, LinearCost((1.0, 0, 0)),
                                                        label="prior")])
    assert with_assumed_reads(unmeasured, frozenset({"cpu"})).link("cpu", Tier.DISK, Tier.GPU) is None


def test_a_read_from_the_shared_tier_is_assumed_from_the_measured_save_to_it():
    """A worker saving to the remote tier is timed; no one has read it yet. Without the assumed read
    every remote alternative was refused as unpriced, so the read was never observed."""
    size = 512 << 10
    save = LinkCost("vllm-cpu", Tier.GPU, Tier.REMOTE, LinearCost((2e-3, 1.5e-3, 0.0)), label="fit", observations=9,
                    page_bytes=size)
    filled = with_assumed_reads(CostModel.build("b", [], [], []).with_link(save), frozenset({"vllm-cpu"}))
    read = filled.link("vllm-cpu", Tier.REMOTE, Tier.GPU, size)
    assert read is not None and read.params == save.params and read.page_bytes == size and read.observations == 0
    assert filled.link("vllm-cpu", Tier.REMOTE, Tier.GPU, size * 2) is None  # never lent to another block size
    assert "vllm-cpu:remote->gpu@524288B" in filled.base


# -- the GEMM probe, repeated and bounded ---------------------------------------------------------------

def test_a_repeated_probe_reports_its_median_and_spread():
    flops = 2.0 * 512 * 512 * 1536
    runs = [0.5] + [flops / r for r in (100e9, 98e9, 102e9, 101e9, 99e9, 100e9, 97e9, 103e9)]  # a slow first run
    probe = GemmProbe.of(flops, runs, warmup=1)
    assert probe.samples == 8  # the warm-up run is dropped
    assert probe.rate_flops_per_s == pytest.approx(100e9, rel=0.01)
    assert probe.spread < 0.05 and probe.max_over_min == pytest.approx(103 / 97, rel=1e-6)
    assert probe.stable and probe.refusal is None
    assert "median of 8 runs 100 GFLOP/s" in probe.label and "IQR" in probe.label


def test_a_probe_that_swings_as_measured_between_engines_is_refused_and_reported():
    """13.4 to 392 GFLOP/s, the swing the issue measured between two engine processes on one machine."""
    flops = 1e9
    rates = (13.4e9, 392e9, 40e9, 300e9, 20e9, 250e9, 100e9)
    probe = GemmProbe.of(flops, [flops / r for r in rates], warmup=0)
    assert not probe.stable and probe.spread > MAX_GEMM_SPREAD
    assert probe.max_over_min == pytest.approx(392 / 13.4, rel=1e-6)
    cold = ColdStart(SPEC, PROFILE, block_bytes=16384, prefill_chunk_tokens=4096)
    assert not cold.measured_probe(probe)
    assert cold.compute is None and "unstable GEMM probe refused" in cold.probes_refused[0]
    # A later, stable probe anchors the prior, and its label says how it was measured.
    steady = GemmProbe.of(flops, [flops / r for r in (50e9, 51e9, 49e9, 50e9, 50.5e9)], warmup=0)
    assert cold.measured_probe(steady)
    assert cold.compute is not None and cold.compute.gemm_flops_per_s == pytest.approx(50e9, rel=0.01)
    assert "median of 5 runs" in cold.compute.rate_label


def test_too_few_runs_cannot_bound_a_spread():
    probe = GemmProbe.of(1e9, [0.01, 0.01], warmup=0)
    assert not probe.stable and "at least 3" in probe.refusal
    with pytest.raises(ValueError):
        GemmProbe.measure(lambda: 0.01, 1e9, repeats=2)


def test_measure_runs_the_probe_and_drops_the_warm_up():
    timings = iter([1.0, 1.0] + [0.01] * 15)
    probe = GemmProbe.measure(lambda: next(timings), 1e9, repeats=15, warmup=2)
    assert probe.samples == 15 and probe.rate_flops_per_s == pytest.approx(100e9) and probe.spread == 0.0
