"""The cost model's forms, its uncertainty, and the shipped profiles against their sources."""

from __future__ import annotations

import math

import pytest

from nexuskv.cost import (
    CacheTerms,
    ComputeCost,
    LinearCost,
    LinkCost,
    compose_links,
    extent_bytes,
    extent_pages,
    normal_cdf,
    prefetch_expected_gain,
)
from nexuskv.descriptor import Tier
from nexuskv.models import known_model
from nexuskv.profiles import (
    HARDWARE,
    SGLANG_26305,
    SHIPPED_BASE,
    minimax_m27_descriptor,
    sglang_26305_cost_model,
    shipped_cost_model,
)

from tests.factories import descriptor, mla

# anchors.md §3, "My FLOP-based estimates": seconds at 2K, 8K, 32K, 128K tokens.
ANCHORS_FLOP_TABLE = {
    ("meta-llama/Llama-3.1-8B", "h200x1-rdma4x200"): (0.068, 0.301, 1.63, 13.3),
    ("meta-llama/Llama-3.1-70B", "h200x8-rdma8x400"): (0.093, 0.393, 1.91, 13.0),
    ("Qwen/Qwen3-32B", "h200x8-rdma8x400"): (0.043, 0.184, 0.90, 6.3),
}


@pytest.mark.parametrize("key", sorted(ANCHORS_FLOP_TABLE))
def test_flop_profiles_reproduce_the_anchors_table(key):
    cost = shipped_cost_model().compute_for(*key)
    assert cost is not None and "FLOP-derived" in cost.source and "not measured" in cost.source
    for n, published in zip((2048, 8192, 32768, 131072), ANCHORS_FLOP_TABLE[key]):
        assert cost.seconds(n, n) == pytest.approx(published, rel=0.03), (key, n)


def test_compute_form_and_features():
    cost = ComputeCost(model="m", profile="p", params=LinearCost((0.01, 2e-5, 1e-9)), source="test")
    assert cost.seconds(0, 100) == 0.0  # nothing to compute costs nothing
    assert cost.seconds(1000, 5000) == pytest.approx(0.01 + 2e-5 * 1000 + 1e-9 * 1000 * 5000)
    assert ComputeCost.features(10, 20) == (1.0, 10.0, 200.0) and ComputeCost.features(0, 20) == (0.0, 0.0, 0.0)


def test_prediction_variance_is_a_quadratic_form_of_the_covariance():
    lin = LinearCost((1.0, 2.0, 3.0), ((4.0, 1.0, 0.0), (1.0, 9.0, 0.0), (0.0, 0.0, 0.0)))
    # x = (1, 2, 5): x'Σx = 4 + 2*1*2*1 + 9*4 = 44
    assert lin.variance(1.0, 2.0, 5.0) == pytest.approx(44.0)
    rel = LinearCost.with_relative_uncertainty((0.5, -2.0, 0.0), (0.1, 0.5, 1.0))
    assert rel.std(0) == pytest.approx(0.05) and rel.std(1) == pytest.approx(1.0) and rel.std(2) == 0.0


def test_link_form_bandwidth_and_composition():
    host = shipped_cost_model().link("h200x1-rdma4x200", Tier.HOST, Tier.GPU)
    assert host is not None and host.bandwidth_bytes_per_s == pytest.approx(50e9)
    assert host.seconds(10, 50_000_000) == pytest.approx(host.latency_s + 10 * host.per_page_s + 1e-3)
    assert host.variance(10, 50_000_000) > 0
    disk = shipped_cost_model().link("h200x1-rdma4x200", Tier.DISK, Tier.GPU)
    both = compose_links(disk, host, profile="x", source=Tier.DISK, destination=Tier.GPU)
    assert both.latency_s == pytest.approx(disk.latency_s + host.latency_s)
    assert both.bandwidth_bytes_per_s == pytest.approx(disk.bandwidth_bytes_per_s)  # the slower hop bounds it
    in_place = shipped_cost_model().link("h200x1-rdma4x200", Tier.GPU, Tier.GPU)
    assert math.isinf(in_place.bandwidth_bytes_per_s)


def test_shipped_links_carry_their_sources():
    model = shipped_cost_model()
    assert model.version == SHIPPED_BASE
    labels = {k: v.label for k, v in model.links.items()}
    assert "50 GB/s" in labels[("h200x1-rdma4x200", Tier.HOST, Tier.GPU)]
    assert "6.5 GB/s" in labels[("h200x1-rdma4x200", Tier.DISK, Tier.GPU)]
    assert "87 GB/s" in labels[("h200x1-rdma4x200", Tier.REMOTE, Tier.GPU)]
    assert "190 GB/s" in labels[("h200x8-rdma8x400", Tier.REMOTE, Tier.GPU)]
    assert "TCP" in labels[("h200x8-tcp4x200", Tier.REMOTE, Tier.GPU)]
    tcp = model.link("h200x8-tcp4x200", Tier.REMOTE, Tier.GPU)
    assert tcp.bandwidth_bytes_per_s == pytest.approx(87e9 / 4.6)
    for model_name in ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-32B",
                       "deepseek-ai/DeepSeek-V3"):
        assert any(m == model_name for m, _p in model.compute), model_name


def test_anchors_transfer_time_per_1k_tokens():
    # anchors §3 "Transfer time per 1K tokens of KV": Llama-3.1-8B 2.6 ms over PCIe5, 1.5 ms over TE 4x200,
    # 20.2 ms from a Gen4 NVMe (bandwidth only; the table leaves fixed costs out).
    d = known_model("meta-llama/Llama-3.1-8B")
    nbytes = 1024 * sum(d.bytes_per_token.values())
    model = shipped_cost_model()
    for tier, ms in ((Tier.HOST, 2.6), (Tier.REMOTE, 1.5), (Tier.DISK, 20.2)):
        link = model.link("h200x1-rdma4x200", tier, Tier.GPU)
        assert nbytes / link.bandwidth_bytes_per_s * 1e3 == pytest.approx(ms, rel=0.05), tier


def test_extent_bytes_and_pages_follow_the_descriptor():
    d = descriptor()  # 4 layers x (2 heads x 8 dims) x K,V x bf16 = 256 B per token, 4-token blocks
    assert d.bytes_per_token == {0: 256}
    assert extent_bytes(d, 3) == 3 * 4 * 256 and extent_pages(d, 3) == 3
    assert extent_bytes(d, 0) == 0 and extent_pages(d, 0) == 0
    m = mla()
    assert extent_bytes(m, 2) == 2 * 4 * m.bytes_per_token[0]
    llama = known_model("meta-llama/Llama-3.1-8B")
    assert extent_bytes(llama, 1) == 16 * 128 * 1024  # a 16-token block = 2 MiB (anchors §3)


def test_cache_terms_total_charges_only_the_visible_transfer():
    t = CacheTerms(lookup_s=0.001, queue_s=0.2, transfer_s=0.5, overlap_s=0.2, restore_s=0.01, sync_s=0.002,
                   interference_s=0.05)
    assert t.visible_transfer_s == pytest.approx(0.3)
    assert t.total_s == pytest.approx(0.001 + 0.2 + 0.3 + 0.01 + 0.002 + 0.05)
    assert CacheTerms(transfer_s=0.1, overlap_s=1.0).visible_transfer_s == 0.0


def test_prefetch_expected_gain_formula():
    assert prefetch_expected_gain(1.0, 2.0, 0.5, 0.1, 0.1) == pytest.approx(2.0)
    assert prefetch_expected_gain(0.0, 2.0, 0.5, 0.1, 0.1) == pytest.approx(-0.7)
    assert prefetch_expected_gain(0.8, 1.0, 0.5, 0.2, 0.3) == pytest.approx(0.8 - 0.2 * 1.0)
    assert normal_cdf(0.0) == pytest.approx(0.5) and normal_cdf(1.645) == pytest.approx(0.95, abs=1e-3)


def test_snapshots_are_immutable_and_versioned_by_fitted_entries():
    base = shipped_cost_model()
    with pytest.raises(TypeError):
        base.compute[("x", "y")] = None  # type: ignore[index]
    old = base.compute_for("meta-llama/Llama-3.1-8B", "h200x1-rdma4x200")
    fitted = ComputeCost(model=old.model, profile=old.profile, params=LinearCost((0.01, 3e-5, 5e-10)),
                         source="fitted", observations=50, version=2)
    newer = base.with_compute(fitted)
    assert newer.version.startswith(SHIPPED_BASE + "+") and newer.version != base.version
    assert base.compute_for(old.model, old.profile) is old  # the old snapshot is untouched
    again = base.with_compute(fitted)
    assert again.version == newer.version  # same entries, same version
    link = base.link("h200x1-rdma4x200", Tier.HOST, Tier.GPU)
    refit = LinkCost(profile=link.profile, source=link.source, destination=link.destination,
                     params=LinearCost((1e-4, 1e-6, 2e-11)), label="fitted", observations=9, version=1)
    with_link = base.with_link(refit)
    assert with_link.link(*link.key).interference == link.interference  # observations do not measure it
    assert with_link.version != base.version


def test_hardware_decode_cost_grows_with_decode_load_and_prefill_chunks():
    hw = HARDWARE["h200x1-rdma4x200"]
    block = 2 * 1024 * 1024
    assert hw.decode_seconds(0, block, 8192) == 0.0
    one = hw.decode_seconds(1000, block, 2048)
    assert one == pytest.approx(1000 * block / 4.8e12)
    assert hw.decode_seconds(1000, block, 8192) == pytest.approx(4 * one)


def test_sglang_26305_back_solved_fixture_reproduces_the_published_ttfts():
    """Arithmetic check of the fixture (back-solved from these very TTFTs, so circular by design);
    tests/nexuskv/test_planner.py fits an independent profile for the decision test."""
    d = minimax_m27_descriptor()
    model = sglang_26305_cost_model(d)
    for op in SGLANG_26305:
        blocks = op.hit_blocks(d.block_size)
        tail_tokens = op.prompt_tokens - blocks * d.block_size
        compute = model.compute_for(d.model, op.profile)
        assert compute.seconds(op.prompt_tokens, op.prompt_tokens) == pytest.approx(op.recompute_s)
        tail = compute.seconds(tail_tokens, op.prompt_tokens)
        nbytes, pages = extent_bytes(d, blocks), extent_pages(d, blocks)
        for tier, published in ((Tier.GPU, op.hbm_hit_s), (Tier.DISK, op.file_hit_s), (Tier.REMOTE, op.ucm_hit_s)):
            link = model.link(op.profile, tier, Tier.GPU)
            moved = 0 if tier is Tier.GPU else nbytes
            assert tail + link.seconds(pages if moved else 0, moved) == pytest.approx(published, rel=1e-9)
    # The 128K file tier runs at what a Gen4 NVMe delivers: the overheads sit in the 8K row.
    big = model.link("sglang26305-128k-c1", Tier.DISK, Tier.GPU).bandwidth_bytes_per_s
    assert 5e9 < big < 8e9
