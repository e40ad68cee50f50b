"""Every record a NexusKV component publishes has one topic and one key."""

from __future__ import annotations

import pytest

from nexuskv.contracts.observations import LoadObservation, ObservationRecord, PrefillObservation, TransferObservation
from nexuskv.contracts.transfers import TransferResult
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import ContractError
from streams.bus.topic_keys import route

from tests.factories import kv_batch


def test_records_route_to_their_topics_and_keys():
    assert route(kv_batch()) == (route(kv_batch())[0], "vllm/pod-a/dp0")
    assert route(kv_batch())[0].name == "nexuskv.kv-events"
    prefill = ObservationRecord(observed_at=1.0, observation=PrefillObservation(
        model="m", profile="p", worker="w", uncached_tokens=1, context_tokens=1, duration_s=0.1))
    transfer = ObservationRecord(observed_at=1.0, observation=TransferObservation(
        source_tier=Tier.DISK, destination_tier=Tier.HOST, backend="file->memory", worker="w", bytes=1, pages=1,
        duration_s=0.1))
    load = ObservationRecord(observed_at=1.0, observation=LoadObservation(
        worker="w", queued_prefill_tokens=0, decode_blocks=0, active_requests=0))
    assert [(t.name, k) for t, k in map(route, (prefill, transfer, load))] == [
        ("nexuskv.observations", "m/p"), ("nexuskv.observations", "w/disk->host"), ("nexuskv.observations", "w")]
    loc = EntryLocation(worker="w", tier=Tier.HOST)
    result = TransferResult(transfer_id="t", request_id="r", status="completed", source=loc,
                            destination=loc.model_copy(update={"tier": Tier.GPU}), started_at=1, finished_at=2)
    assert [route(result)[0].name, route(result)[1]] == ["nexuskv.transfer-results", "r"]
    with pytest.raises(ContractError, match="no topic"):
        route(loc)
