"""Which topic and key a record goes to: one place, so every producer keys records alike.

* KvEventBatch and KeyedBatch (kv-events versions 1 and 2) -> ``nexuskv.kv-events``, keyed by publisher (one publisher's batches stay in order);
* ObservationRecord -> ``nexuskv.observations``, keyed by model and profile (prefill, request), by worker
  and link (transfer), by worker (load);
* TransferResult -> ``nexuskv.transfer-results``, keyed by request id;
* TierStateRecord -> ``nexuskv.tier-state``, keyed by worker and tier;
* TierOffer -> ``nexuskv.tier-offers``, keyed by writer (one writer's offers stay in order).
"""

from __future__ import annotations

from nexuskv.contract import Contract
from nexuskv.contracts.keyed_events import KeyedBatch
from nexuskv.contracts.kv_events import KvEventBatch
from nexuskv.contracts.observations import LoadObservation, ObservationRecord, PrefillObservation, RequestObservation
from nexuskv.contracts.tier_offers import TierOffer
from nexuskv.contracts.tier_state import TierStateRecord
from nexuskv.contracts.topics import KV_EVENTS, OBSERVATIONS, TIER_OFFERS, TIER_STATE, TRANSFER_RESULTS, Topic
from nexuskv.contracts.transfers import TransferResult
from nexuskv.errors import ContractError

__all__ = ["route"]


def route(record: Contract | KeyedBatch) -> tuple[Topic, str]:
    """(topic, key) for a record a NexusKV component publishes."""
    if isinstance(record, (KvEventBatch, KeyedBatch)):
        return KV_EVENTS, record.publisher
    if isinstance(record, TransferResult):
        return TRANSFER_RESULTS, record.request_id
    if isinstance(record, TierStateRecord):
        return TIER_STATE, record.key
    if isinstance(record, TierOffer):
        return TIER_OFFERS, record.writer
    if isinstance(record, ObservationRecord):
        obs = record.observation
        if isinstance(obs, (PrefillObservation, RequestObservation)):
            return OBSERVATIONS, f"{obs.model}/{obs.profile}"
        if isinstance(obs, LoadObservation):
            return OBSERVATIONS, obs.worker
        return OBSERVATIONS, f"{obs.worker}/{obs.link}"
    raise ContractError(f"no topic carries {type(record).__name__}")
