"""Factories for connector tests: a cost model for the reference engine, an index fed by runtimes.

The cost model makes recomputing the tiny reference model expensive next to reading its blocks
(``c1`` = 2 ms per token, links of a few GB/s), as a real model's is, so the planner decides to
move state; :func:`slow_links` makes every link slower than recomputing, so it decides not to.
"""

from __future__ import annotations

from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.cost import ComputeCost, CostModel, HardwareProfile, LinearCost, LinkCost
from nexuskv.descriptor import StateDescriptor, Tier
from nexuskv.index import GlobalIndex
from nexuskv.policy import ExecutionPolicy, PlannerSettings
from nexuskv.reference_engine.events import Record

PROFILE = "reference-cpu"
POLICY = ExecutionPolicy(version="connector-test", planner=PlannerSettings(default_hardware_profile=PROFILE))


def cost_model(descriptor: StateDescriptor, *, bytes_per_s: float = 2e9, per_token_s: float = 2e-3) -> CostModel:
    hw = HardwareProfile(name=PROFILE, hbm_bytes_per_s=1e11, prefill_chunk_tokens=2048, lookup_s=1e-5, sync_s=1e-5,
                         label="test: the reference engine on a CPU")
    compute = ComputeCost(model=descriptor.model, profile=PROFILE, source="test",
                          params=LinearCost.independent((1e-3, per_token_s, 0.0), (1e-5, per_token_s / 50, 0.0)))
    links = [LinkCost(profile=PROFILE, source=Tier.GPU, destination=Tier.GPU, label="test: in place",
                      params=LinearCost.independent((1e-5, 0.0, 0.0), (1e-6, 0.0, 0.0)))]
    for tier in (Tier.HOST, Tier.DISK, Tier.REMOTE):
        links.append(LinkCost(profile=PROFILE, source=tier, destination=Tier.GPU, label=f"test: {tier.value}",
                              params=LinearCost.independent((1e-4, 1e-6, 1.0 / bytes_per_s),
                                                            (1e-5, 1e-7, 0.02 / bytes_per_s))))
    return CostModel.build("connector-test", [hw], [compute], links)


def slow_links(descriptor: StateDescriptor) -> CostModel:
    """Every link at 1 kB/s: moving a block costs far more than recomputing it."""
    return cost_model(descriptor, bytes_per_s=1e3)


class IndexFeed:
    """A GlobalIndex that runtimes publish into (their ``publisher``)."""

    def __init__(self) -> None:
        self.index = GlobalIndex()
        self.batches = 0

    def __call__(self, record: Record) -> None:
        if isinstance(record, (KvEventBatch, KeyedBatch)):
            assert self.index.apply(record).status == "applied"
            self.batches += 1
