"""The topic contract: every topic's name, key, payload type and encoding, declared once.

High-volume lifecycle events are msgpack; everything else is JSON so an operator can read it
with any Kafka console consumer. Each payload carries ``schema_version``.

=========================== ============================ ==========================================
topic                       key                          carries
=========================== ============================ ==========================================
nexuskv.kv-events           publisher id                 lifecycle event batches (seq, incarnation)
nexuskv.observations        model and link or tier       measured prefill and transfer timings, load
nexuskv.plan-requests       request id                   describe-and-match requests at admission
nexuskv.decisions           request id                   decision records (revision 0, then fallbacks)
nexuskv.placement           tenant namespace/prefix root routing, pin, prefetch, demote, evict, cancel
nexuskv.transfers           destination worker           transfer commands with deadline and backend
nexuskv.transfer-results    request id                   completion, timing, failure
nexuskv.cost-models         cost-model entry id          fitted entries, each a complete posterior;
                                                         compacted: the latest per key is the model
nexuskv.tier-state          worker/tier                  a managed tier's usage and displacement
                                                         price; compacted: the latest per key
nexuskv.tier-offers         writer                       blocks a worker saved to the shared remote
                                                         tier, offered to its owner
nexuskv.dead-letter         source topic                 rejected inputs with the reason
=========================== ============================ ==========================================

Producers and consumers: engines and bridges produce kv-events and observations; the index
consumes kv-events; the calibration agent consumes observations and produces cost-models; the
planner service consumes plan-requests, transfer-results and cost-models and produces decisions,
placement and transfers; tier managers consume placement hints (pins, prefetch reservations,
demotions, evictions, cancels for their executor), produce kv-events for what their tiers hold and
tier-state, which planners read as the displacement price; executors consume transfers and produce
transfer-results and transfer observations; workers that save to the shared remote tier produce
tier-offers, which the remote-tier manager consumes (it produces that tier's kv-events and
tier-state); the analytics sink consumes decisions and outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nexuskv.contract import Contract
from nexuskv.contracts.cost_models import CostModelEntry
from nexuskv.contracts.dead_letter import DeadLetter
from nexuskv.contracts.decisions import Decision
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.observations import ObservationRecord
from nexuskv.contracts.placement import PlacementHint
from nexuskv.contracts.plans import PlanRequest
from nexuskv.contracts.tier_offers import TierOffer
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.transfers import TransferCommand, TransferResult

__all__ = ["Topic", "TOPICS", "KV_EVENTS", "OBSERVATIONS", "PLAN_REQUESTS", "DECISIONS",
           "PLACEMENT", "TRANSFERS", "TRANSFER_RESULTS", "COST_MODELS", "TIER_STATE", "TIER_OFFERS", "DEAD_LETTER",
           "topic_named"]

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class Topic:
    name: str
    key: str  # what the record key is (keeps related records ordered on one partition)
    contract: type[Contract]
    encoding: Literal["msgpack", "json"]
    doc: str
    config: dict[str, str] = field(default_factory=dict)  # topic-level Kafka configs
    versions: tuple[int, ...] = (1,)  # payload schema versions this build reads


KV_EVENTS = Topic(
    "nexuskv.kv-events", "publisher id", KvEventBatch, "msgpack",
    "batches of lifecycle events with publisher sequence number and incarnation",
    {"retention.ms": str(7 * DAY_MS)}, versions=(1, 2),
)
OBSERVATIONS = Topic(
    "nexuskv.observations", "model and link or tier", ObservationRecord, "json",
    "measured prefill and transfer timings, queue depths",
)
PLAN_REQUESTS = Topic(
    "nexuskv.plan-requests", "request id", PlanRequest, "json", "describe-and-match requests at admission",
    versions=(1, 2),  # 1 with keys only (its token_ids alternative is refused): keys come from the edge
)
DECISIONS = Topic("nexuskv.decisions", "request id", Decision, "json", "decision records")
PLACEMENT = Topic(
    "nexuskv.placement", "tenant namespace and prefix root", PlacementHint, "json",
    "routing and placement hints for routers, tier managers and executors", versions=(1, 2),
)
TRANSFERS = Topic(
    "nexuskv.transfers", "destination worker", TransferCommand, "json", "transfer commands with deadline",
)
TRANSFER_RESULTS = Topic(
    "nexuskv.transfer-results", "request id", TransferResult, "json", "completion, timing, failure",
)
COST_MODELS = Topic(
    "nexuskv.cost-models", "cost-model entry id", CostModelEntry, "json",
    "fitted cost-model entries (compute and link), each a complete posterior; latest per key wins",
    {"cleanup.policy": "compact"},
)
TIER_STATE = Topic(
    "nexuskv.tier-state", "worker/tier", TierStateRecord, "json",
    "each managed tier's usage and displacement price; latest per key wins",
    {"cleanup.policy": "compact"},
)
TIER_OFFERS = Topic(
    "nexuskv.tier-offers", "writer", TierOffer, "json",
    "blocks a worker saved to the shared remote tier, offered to the tier's owner to admit or refuse",
)
DEAD_LETTER = Topic(
    "nexuskv.dead-letter", "source topic", DeadLetter, "json", "rejected inputs with the reason",
    {"retention.ms": str(30 * DAY_MS)},
)

TOPICS: tuple[Topic, ...] = (
    KV_EVENTS, OBSERVATIONS, PLAN_REQUESTS, DECISIONS, PLACEMENT, TRANSFERS, TRANSFER_RESULTS, COST_MODELS,
    TIER_STATE, TIER_OFFERS, DEAD_LETTER,
)


def topic_named(name: str) -> Topic | None:
    for t in TOPICS:
        if t.name == name:
            return t
    return None
